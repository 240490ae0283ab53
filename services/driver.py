"""The asynchronous actor-learner loop: ``ray.wait`` -> buffer -> learner step -> weight sync.

One driver process orchestrates N rollout actors and one learner (group); the trajectory
buffer lives in the driver's process:

1. Rollout actors generate trajectories with the weights they last loaded (stamped with
   that ``policy_version``); a rollout is admitted only if all of its output will be
   consumed within ``buffer.max_staleness`` (:mod:`services.loop.pipeline`).
2. Finished rollouts go into the buffer; when a batch is ready and nothing older is in
   flight, a learner step takes it (:mod:`services.loop.pipeline`).
3. After every ``sync.every_k_steps`` steps the learner's new weights go to every engine
   (:mod:`services.loop.sync`); a rollout waits for the version admission counted it at.
4. Between learner steps, live config changes apply (:mod:`services.loop.live_config`), and
   checkpoints (:mod:`services.loop.checkpoint`) and evaluations (``run.eval_every``,
   :mod:`services.loop.phases`) run when due; each step is reported (:mod:`services.loop.report`).
5. The stability guard reads every step record (:mod:`services.loop.autopilot`); it may roll
   the job back to a checkpoint in process (:mod:`services.loop.restore`) or end the run.

The driver builds these parts and then only routes finished Ray refs to their owners; it
alone changes the run's counters (:class:`services.loop.checkpoint.DriverState`), from what
the parts return. Trajectories buffered or in flight at a checkpoint are not saved: a resume
regenerates them from the sampler's next questions, so nothing is trained on twice. On
SIGTERM the run checkpoints and raises :class:`services.run_records.TrainingInterrupted`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from services.atomic import write_atomic
from services.config import RunConfig
from services.control import ControlState, public_config
from services.loop.checkpoint import CheckpointStore, DriverState
from services.run_records import TrainingInterrupted


class Driver:
    """Runs one training job end to end (see module docstring).

    Args:
        cfg: the validated run config.
        resume: continue from the latest checkpoint in ``cfg.run_dir`` (``run.resume =
            "must"``); False follows ``cfg.run.resume``.
        max_train_s: wall-clock cap on the training loop in seconds (0 = none), counted from
            the loop's start; when it expires no new learner step starts, the one in
            progress finishes, and the run checkpoints and evaluates as usual.
        overwrite: move a used ``cfg.run_dir`` aside and start a new run there.

    ``run`` raises :class:`services.run_records.RunDirInUse` (``never`` on a used directory),
    ``FileNotFoundError`` (``must`` without a checkpoint),
    :class:`services.atomic.DiskFullError` (a checkpoint did not fit), after SIGTERM and
    its checkpoint :class:`services.run_records.TrainingInterrupted`, after the end of a run
    the stability guard stopped :class:`services.run_records.GuardStopped`.
    """

    def __init__(
        self, cfg: RunConfig, resume: bool = False, max_train_s: float = 0.0,
        overwrite: bool = False,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.resume_mode = "must" if resume else cfg.run.resume
        self.overwrite = overwrite
        self.max_train_s = max_train_s
        self.state = DriverState()
        self.control = ControlState(config=cfg)
        self.stop_requested = threading.Event()
        self.checkpoints = CheckpointStore(
            cfg.run_dir / "checkpoints", cfg.checkpoint.keep_last, cfg.checkpoint.every_k_steps
        )
        self.services: Any = None  # services.loop.bootstrap.Services, once run() starts
        self._run_started_s = time.perf_counter()

    def run(self) -> DriverState:
        """Start everything, warm-start, evaluate, train, evaluate, checkpoint, shut down."""
        from services.loop.bootstrap import install_sigterm

        try:
            self._start()
            resumed = self.services.plan.checkpoint is not None
            if resumed:
                self._restore(self.services.plan.checkpoint)
            elif self.cfg.sft.enabled:
                self._warm_start()
            self.sync.push(self.state.policy_version, blocking=True)
            self._evaluate("resume" if resumed else "start")
            install_sigterm(self.stop_requested, self.report.say)
            self._train_loop()
            self.report.stabilisers(self.services.run_dir)
            if self.checkpoints.last_saved_step != self.state.learner_step:
                self._checkpoint()
            if self.interrupted:  # not the end: no final evaluation, the caller exits non-zero
                self.report.curves(self.services.run_dir)
                self.report.say(f"interrupted at step {self.state.learner_step}")
                raise TrainingInterrupted(self.state.learner_step, self.services.run_dir)
            self.sync.push_final(self.state.policy_version)  # the end evaluation's weights
            self._evaluate("end")
            self.report.curves(self.services.run_dir)
            self.autopilot.end(self.services.run_dir)  # raises GuardStopped after its stop
            return self.state
        finally:
            if self.services is not None:
                self.services.close()

    @property
    def interrupted(self) -> bool:
        """SIGTERM stopped the loop before ``run.num_steps``."""
        return self.stop_requested.is_set() and self.state.learner_step < self.cfg.run.num_steps

    # ------------------------------------------------------------------ the parts

    def _start(self) -> None:
        """Open the run directory, start the services, build the parts."""
        from services.loop import autopilot, bootstrap, restore
        from services.loop.parts import build_parts

        bootstrap.preflight(self.cfg)
        self.services = bootstrap.open_run_dir(self.cfg, self.resume_mode, self.overwrite)
        bootstrap.start_services(self.cfg, self.control, self.services)
        p = build_parts(lambda: self.cfg, self.control, self.services)
        self.report, self.learner, self.sampler = p.report, p.learner, p.sampler
        self.fleet, self.sync, self.pipeline, self.phases = p.fleet, p.sync, p.pipeline, p.phases
        self.targets = p.targets  # where a new config takes effect
        self.autopilot = autopilot.Autopilot(self.control, self.services, self.report.say)
        self.restore = restore.Restore(self.checkpoints, p, self.services.records, self.autopilot)

    # ------------------------------------------------------------------ the loop

    def _train_loop(self) -> None:
        import ray

        self._deadline = time.monotonic() + (max(self.max_train_s, 0.0) or float("inf"))
        while self.state.learner_step < self.cfg.run.num_steps and not self._stopping():
            if self.pipeline.step is None:
                self._apply_pending_changes()
                self._start_step()
            retrieval_up = self.services.retrieval_up()
            if retrieval_up:  # no new rollout while the managed server restarts
                self.state.trajectories_admitted += self.pipeline.admit(self.state.policy_version)
            waiting = self.fleet.refs() + self.pipeline.refs() + self.sync.refs()
            if not waiting:
                if retrieval_up:
                    raise RuntimeError("deadlock: no rollout, learner step or sync in flight")
                time.sleep(0.5)
                continue
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in ready:
                self._route(ref)
        self.fleet.abandon_running()  # never trained on, regenerated on resume
        if self.pipeline.step is not None:
            self._on_step_done()

    def _stopping(self) -> bool:  # SIGTERM, the guard's stop or max_train_s ends the loop
        stop = self.stop_requested.is_set() or self.autopilot.stop is not None
        return stop or time.monotonic() >= self._deadline

    def _route(self, ref: Any) -> None:
        """Hand a finished ref to its owner and count what it says happened."""
        if self.pipeline.owns(ref):
            self._on_step_done()
            return
        if self.sync.owns(ref):
            self.sync.on_ack(ref)
            return
        slot, call = self.fleet.owner(ref)
        outcome = self.fleet.finish(slot, call)
        if outcome.crash is not None:  # re-synced; stamped output is dropped as stale
            self._on_crash(slot, outcome.crash)
        if outcome.died:  # every call running on it is lost
            return
        trajectories = outcome.trajectories
        ids = self.services.records.lineage.attempt, len(self.autopilot.guard.rollbacks)
        accepted = self.pipeline.accept(trajectories, call.first_draw, *ids)
        landed = sum(int(t.extra.get("inflight_weight_updates", 0)) for t in trajectories)
        self.state.inflight_weight_updates += landed
        self.state.trajectories_generated += len(trajectories)
        self.report.rollouts_done(trajectories, accepted, landed)

    def _on_crash(self, slot: Any, error: BaseException) -> None:
        self.sync.on_crash(slot, error)
        self._count_restarts(1)

    def _count_restarts(self, n: int) -> None:
        self.state.actor_restarts += n
        self.services.metrics.actor_restarts_total.inc(n)

    def _start_step(self) -> None:
        take = self.pipeline.start_step(self.state.policy_version)
        if take is not None:
            self.state.trajectories_dropped_stale += take.dropped_stale
            self.report.step_taken(take)

    def _on_step_done(self) -> None:
        variant = self.cfg.algorithm.variant
        step_metrics, step = self.pipeline.finish_step(self.state.policy_version + 1, variant)
        self.state.learner_step += 1
        self.state.policy_version += 1
        self.state.trajectories_consumed += len(step.take.trajectories)
        self.report.consumed(self.state.learner_step, step.take)
        stats = self.pipeline.buffer_stats()
        now = time.perf_counter()
        record = self.report.step_record(
            step_metrics, step.take, self.state, variant=variant,
            wall_s=now - step.started_s, elapsed_s=now - self._run_started_s,
            window=self.fleet.take_window(), buffer_stats=stats,
        )  # fmt: skip
        if self.state.learner_step % self.cfg.sync.every_k_steps == 0:
            record["weight_sync_s"] = self.sync.push(self.state.policy_version, blocking=False)
        engines = [s.engine_version for s in self.fleet.slots]
        self.report.step_done(record, self.state, stats, engines)
        decision = self.autopilot.step(record, self.cfg, self.checkpoints)  # the stability guard
        if decision.rollback_to is not None:  # then the guard's change, and a checkpoint
            self.state = self.restore.rollback(decision, self.state, self.cfg, self._on_crash)
            self._apply_pending_changes()
        elif self.phases.eval_due(self.state.learner_step) and not self._stopping():  # eval_every
            self._count_restarts(self.phases.evaluate_midway(self.state, self._route))
        if decision.rollback_to is not None or self.checkpoints.due(self.state.learner_step):
            self._checkpoint()

    # ------------------------------------------------------------------ phases

    def _warm_start(self) -> None:
        if self.cfg.run.eval_before_warm_start:
            self._evaluate("before_warm_start")
        done = self.phases.warm_start()
        self.state.warm_started = True
        self.state.policy_version = done.policy_version  # SFT steps are versions too
        self.report.append("sft.jsonl", done.record)

    def _evaluate(self, tag: str) -> None:
        step, version = self.state.learner_step, self.state.policy_version
        self._count_restarts(self.phases.evaluate(tag, step, version))

    # ------------------------------------------------------------------ config, checkpoints

    def _apply_pending_changes(self) -> None:
        from services.loop.live_config import apply_config

        new = self.control.take_pending()
        if new is None:
            return
        old, self.cfg = self.cfg, new
        applied = apply_config(old, new, self.targets, self.state.policy_version)
        self.state.trajectories_dropped_stale += applied.purged
        self.services.metrics.dropped_stale_total.inc(applied.purged)
        self.sync.push_to_new(applied.new_slots)
        self.control.publish(config=new)
        self.report.config_changed(new, self.state.learner_step, applied.fields)

    def _restore(self, path: Any) -> None:
        """Load a checkpoint: the learner's state, the driver's counters and sampler
        position, and the live-changed fields of the config saved with it (variant and its
        options, staleness bound, learning rates, actors, sync period), which override the
        command line's, so the learner, the driver, ``ctl status`` and the metrics agree."""
        from services.loop.live_config import apply_config, restore_live_fields

        self.state, saved = self.restore.load(path)
        self.autopilot.restore(self.state.guard)  # the guard's budgets, cooldown, windows
        self._run_started_s = time.perf_counter() - self.state.elapsed_s
        if saved is not None:
            self.cfg = restore_live_fields(self.cfg, saved)
            self.control.reset(self.cfg)
            apply_config(None, self.cfg, self.targets, self.state.policy_version)
            self.report.live_config(self.cfg)
            config_json = json.dumps(public_config(self.cfg), indent=2)
            write_atomic(self.services.run_dir / "config.json", config_json)
        self.report.say(
            f"resumed from {path}: step {self.state.learner_step}, version "
            f"{self.state.policy_version}, variant {self.cfg.algorithm.variant}, "
            f"max_staleness {self.cfg.buffer.max_staleness}"
        )

    def _checkpoint(self) -> None:
        import ray

        self.state.guard = self.autopilot.state()
        self.state.questions_drawn = self.sampler.num_drawn
        self.state.elapsed_s = round(time.perf_counter() - self._run_started_s, 3)
        self.state.record_lines = self.services.records.line_counts()
        path = self.checkpoints.save(
            self.state.learner_step, self.state, public_config(self.cfg),
            lambda p: ray.get(self.learner.save_checkpoint.remote(str(p))),
        )  # fmt: skip
        self.report.say(f"checkpoint: {path}")


def run_training(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> DriverState:
    """Entry point of ``stppo train``: resolves ``model.path`` (a hub id is downloaded once,
    :mod:`services.model_source`) and runs the :class:`Driver`.

    Raises:
        services.model_source.ModelSourceError: ``model.path`` is not usable.
        services.run_records.RunDirInUse, FileNotFoundError, TrainingInterrupted: see
            :class:`Driver`.
    """
    from services.model_source import with_resolved_model

    return Driver(with_resolved_model(cfg), resume=resume, overwrite=overwrite).run()
