"""The asynchronous actor-learner loop: ``ray.wait`` -> buffer -> learner step -> weight sync.

One driver process orchestrates N rollout actors, one learner actor and one buffer actor:

1. Rollout actors generate trajectories with the weights they last loaded (stamped with
   that ``policy_version``). A new rollout is admitted only if all of its output will be
   consumed within ``buffer.max_staleness``, counting the trajectories buffered and in
   flight ahead of it (:func:`learner.admission.may_admit`, AReaL's bound per version); so
   actors never run ahead, no rollout is generated to be thrown away, and
   ``max_staleness = 0`` is synchronous PPO through the same loop.
2. Finished rollouts go into the buffer actor; when ``learner.train_batch_size`` trajectories
   are ready, none older is still in flight (:func:`learner.admission.may_take`) and the
   learner is idle, the driver takes the oldest ones and starts a learner step. Stale ones
   (only after a live lowering of the bound) are dropped and counted at that moment.
3. After every ``sync.every_k_steps`` steps the learner's new weights go to every engine,
   in memory, on the actor's weight thread: applied when the running batch ends, or at its
   next safe point (between turns, every ``rollout.interrupt_every_tokens`` tokens) with
   interruptible generation. A rollout is submitted with the version last pushed to its
   actor and waits for it to land, so every token is at least as new as admission counted.
4. Live config changes from the control plane are applied between learner steps.

Trajectories held in the buffer or in flight when a checkpoint is written are not saved:
on ``--resume`` they are regenerated from the next questions of the sampler (whose position
is checkpointed). Nothing is trained on twice: a trajectory is only ever consumed once, and
the sampler never re-issues a question drawn before the checkpoint.

How a start treats a used run directory (``run.resume``), the run id and attempt on every
record line, and the records a resume supersedes: :mod:`services.run_records`. On SIGTERM
the run checkpoints and raises :class:`services.run_records.TrainingInterrupted`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.rendezvous import advertised_host
from services.config import RunConfig
from services.control import ControlState, changed_fields, public_config
from services.env import ray_temp_dir
from services.run_records import (
    RecordWriter,
    StartPlan,
    TrainingInterrupted,
    move_aside,
    plan_start,
    read_records,
    start_attempt,
)

log = logging.getLogger("stppo.driver")


class RolloutActorLost(RuntimeError):
    """A rollout actor cannot come back: its constructor raised, or its restarts are spent."""


def _first_line_of_cause(error: Exception) -> str:
    """The last line of a Ray creation-task traceback: the original exception, e.g.
    ``AttributeError: 'RolloutConfig' object has no attribute 'x'``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


@dataclass
class RunningRollout:
    """One rollout call running on an actor."""

    ref: Any  # ObjectRef of its trajectories
    submitted_version: int  # the actor's engine_version when it was submitted
    started_s: float
    first_draw: int  # sampler draw index of its first question


@dataclass
class RolloutSlot:
    """Driver-side bookkeeping of one rollout actor."""

    handle: Any
    index: int
    engine_version: int = -1  # last version pushed (loads are applied in call order)
    running: list[RunningRollout] = field(default_factory=list)  # <= rollout.calls_per_actor
    started_s: float = 0.0  # when its last rollout was submitted
    busy_since: float | None = None  # since when a call has been running (None: idle)
    crashes_in_a_row: int = 0  # crashes since its last completed rollout
    lost: bool = False  # crashed, and not back yet (Ray restarts it where it can be placed)


@dataclass
class DriverState:
    """What a checkpoint stores besides the learner's own state."""

    learner_step: int = 0
    policy_version: int = 0
    questions_drawn: int = 0
    trajectories_admitted: int = 0
    trajectories_generated: int = 0
    trajectories_consumed: int = 0
    trajectories_dropped_stale: int = 0
    actor_restarts: int = 0
    inflight_weight_updates: int = 0  # updates that landed while a rollout batch ran
    warm_started: bool = False
    elapsed_s: float = 0.0  # training wall time up to the checkpoint, summed over attempts
    record_lines: dict[str, int] = field(default_factory=dict)  # lines per *.jsonl file


class Driver:
    """Runs one training job end to end (see module docstring).

    Args:
        cfg: the validated run config.
        resume: continue from the latest checkpoint in ``cfg.run_dir`` (``run.resume =
            "must"``); False follows ``cfg.run.resume``.
        max_train_s: wall-clock cap on the training loop in seconds (0 = none), counted from
            the loop's start (after startup, warm start and the ``start`` evaluation); when it
            expires no new learner step starts, the one in progress finishes, and the run
            checkpoints and evaluates as usual.
        overwrite: move a used ``cfg.run_dir`` aside and start a new run there.

    ``run`` raises :class:`services.run_records.RunDirInUse` (``never`` on a used directory),
    ``FileNotFoundError`` (``must`` without a checkpoint), and, after SIGTERM and its
    checkpoint, :class:`services.run_records.TrainingInterrupted`.
    """

    def __init__(
        self,
        cfg: RunConfig,
        resume: bool = False,
        max_train_s: float = 0.0,
        overwrite: bool = False,
    ) -> None:
        self.cfg = cfg
        self.resume_mode = "must" if resume else cfg.run.resume
        self.overwrite = overwrite
        self.resume = False  # set by _prepare_run_dir: a checkpoint is restored
        self.max_train_s = max_train_s
        self.run_dir = cfg.run_dir
        self.state = DriverState()
        self.control = ControlState(config=cfg)
        self.slots: list[RolloutSlot] = []
        self.stop_requested = threading.Event()
        self._step_ref: Any = None
        self._step_started_s = 0.0
        self._step_take: Any = None
        self._sync: Any = None
        self._pending_acks: dict[Any, tuple[float, float]] = {}
        self._revival_acks: dict[Any, RolloutSlot] = {}  # weight loads queued on lost actors
        self._resynced_sync: Any = None  # the broken sync last re-sent to the survivors
        self._rollout_tokens = 0
        self._rollout_trajs = 0
        self._calls_running_max = 0  # most rollout calls running on one actor, this step
        self._busy_s = 0.0  # actor-seconds with a call running, this step (ended intervals)
        self._rollout_durations_s: list[float] = []
        self._window_start_s = time.perf_counter()
        self._run_started_s = time.perf_counter()
        self._closers: list[Any] = []
        self._lagged_sync: Any = None  # services.lagged_sync, with sync.fixed_lag
        self._retrieval_supervisor: Any = None
        self._last_checkpoint_step = -1
        self.records: RecordWriter | None = None  # set by _prepare_run_dir
        self.tracker: Any = None  # services.tracking.Tracker when tracking.backends is set

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> DriverState:
        """Start everything, warm-start, evaluate, train, evaluate, checkpoint, shut down."""
        try:
            self._prepare_run_dir()
            self._start_retrieval()
            self._start_ray()
            self._start_observability()
            self._create_actors()
            if self.resume:
                self._restore()
            elif self.cfg.sft.enabled:
                self._evaluate("before_warm_start")
                self._warm_start()
            self._sync_weights(blocking=True)
            self._evaluate("resume" if self.resume else "start")
            self._install_signal_handlers()
            self._train_loop()
            self._report_stabilisers()
            if self._last_checkpoint_step != self.state.learner_step:  # not saved at the last step
                self._checkpoint()
            if self.interrupted:  # not the end: no final evaluation, the caller exits non-zero
                self._plot()
                self.progress.say(f"interrupted at step {self.state.learner_step}")
                raise TrainingInterrupted(self.state.learner_step, self.run_dir)
            self._evaluate("end")
            self._plot()
            return self.state
        finally:
            self._shutdown()

    @property
    def interrupted(self) -> bool:
        """SIGTERM stopped the loop before ``run.num_steps``."""
        return self.stop_requested.is_set() and self.state.learner_step < self.cfg.run.num_steps

    def _prepare_run_dir(self) -> None:
        plan = plan_start(self.run_dir, self.resume_mode, self.overwrite)
        moved_to = move_aside(self.run_dir) if plan.move_aside else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resume = plan.checkpoint is not None
        lineage = start_attempt(self.run_dir, plan, _checkpoint_step(plan))
        self.records = RecordWriter(self.run_dir, lineage)
        (self.run_dir / "config.json").write_text(json.dumps(public_config(self.cfg), indent=2))
        handler = logging.FileHandler(self.run_dir / "driver.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("stppo").addHandler(handler)
        logging.getLogger("stppo").setLevel(logging.INFO)
        from services.progress import Progress

        self.progress = Progress(total_steps=self.cfg.run.num_steps, run_dir=self.run_dir)
        if moved_to is not None:
            self.progress.say(f"moved the previous run aside to {moved_to}")
        self.progress.say(_describe_start(plan, lineage))

    def _start_retrieval(self) -> None:
        if self.cfg.retrieval.url:
            self.retrieval_url = self.cfg.retrieval.url.rstrip("/")
            _wait_external_retrieval(self.retrieval_url, timeout_s=60.0)
            return
        from services.retrieval_supervisor import RetrievalSupervisor

        self.progress.say(f"starting retrieval server ({self.cfg.retrieval.server.method})")
        supervisor = RetrievalSupervisor(
            self.cfg.retrieval.server,
            self.run_dir / "retrieval.log",
            self.cfg.retrieval.supervisor,
            on_restart=lambda: self.metrics.retrieval_server_restarts_total.inc(),
        )
        self.retrieval_url = supervisor.start()
        self._retrieval_supervisor = supervisor
        self._closers.append(supervisor.stop)
        self.progress.say(f"retrieval server ready at {self.retrieval_url}")

    def _start_ray(self) -> None:
        import ray

        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if self.cfg.ray.address:
            ray.init(address=self.cfg.ray.address, **kwargs)
        else:
            ray.init(
                address="local",
                num_cpus=self.cfg.ray.num_cpus,
                _temp_dir=str(ray_temp_dir()),
                **kwargs,
            )
        self._closers.append(ray.shutdown)

    def _start_observability(self) -> None:
        from prometheus_client import CollectorRegistry

        from services.metrics import TrainingMetrics, start_metrics_server

        self.registry = CollectorRegistry()
        self.metrics = TrainingMetrics(self.registry)
        self._publish_live_config()
        if self.cfg.metrics.enabled:
            server = start_metrics_server(
                self.registry, self.cfg.metrics.host, self.cfg.metrics.port
            )
            self._closers.append(server.close)
            host = advertised_host(self.cfg.metrics.host)
            self.metrics_url = f"http://{host}:{server.port}/metrics"
            self.progress.say(f"metrics: {self.metrics_url}")
        if self.cfg.tracking.backends:
            from services.tracking import Tracker

            self.tracker = Tracker(
                self.cfg.tracking, self.run_dir, self.cfg.run.name, public_config(self.cfg),
                live_config=lambda: public_config(self.control.config),
            )  # fmt: skip
            self._closers.append(self.tracker.close)
            self.progress.say(
                f"tracking: {', '.join(self.cfg.tracking.backends)} in {self.tracker.dir}"
            )
        if self.cfg.control.enabled:
            self._start_control()

    def _start_control(self) -> None:
        """Serve the control plane. The token is never printed: one from ``control.token``
        or ``STPPO_CONTROL_TOKEN`` (how the KubeRay Secret reaches the driver) is only named;
        a generated one is written to ``control.json`` with mode 0600."""
        from services.control import (
            create_control_app,
            new_token,
            start_control_server,
            write_private,
        )
        from services.metrics import make_asgi_app

        env_token = os.environ.get("STPPO_CONTROL_TOKEN")
        source = "control.token" if self.cfg.control.token else None
        source = source or ("STPPO_CONTROL_TOKEN" if env_token else None)
        self.control_token = self.cfg.control.token or env_token or new_token()
        app = create_control_app(self.control, self.control_token, make_asgi_app(self.registry))
        server = start_control_server(app, self.cfg.control.host, self.cfg.control.port)
        self._closers.append(server.close)
        self.control_url = server.url
        path = self.run_dir / "control.json"
        record = {"url": server.url, "token_source": source or "generated"}
        if source is None:
            record["token"] = self.control_token
        write_private(path, json.dumps(record))
        if source is not None:
            self.progress.say(f"control plane: {server.url}  token: from {source} (not printed)")
            return
        self.progress.say(
            f"control plane: {server.url}  token: in {path} (mode 0600, not printed)\n"
            f"  e.g. STPPO_CONTROL_URL={server.url} STPPO_CONTROL_TOKEN=$(python3 -c "
            f"'import json,sys; print(json.load(open(sys.argv[1]))[\"token\"])' {path}) "
            "stppo ctl set buffer.max_staleness=2"
        )

    def _create_actors(self) -> None:
        import ray

        from services.learner_group import create_learner_group
        from services.ray_actors import create_buffer_actor
        from services.sampler import QuestionSampler
        from services.weight_sync import make_weight_sync

        self.weight_sync = make_weight_sync(
            self.cfg.sync.transport,
            backend="nccl" if self.cfg.ray.learner_gpus > 0 else "gloo",
            timeout_s=self.cfg.sync.collective_timeout_s,
            join_timeout_s=self.cfg.sync.join_timeout_s,
            say=self.progress.say,
        )
        self.sampler = QuestionSampler.from_data(
            self.cfg.data, "train", self.cfg.run.seed, side="rl"
        )
        self.learner = create_learner_group(
            self.cfg, say=self.progress.say
        )  # learner.num_ranks actors, one handle
        self._closers.append(self.learner.shutdown)
        self.buffer = create_buffer_actor(self.cfg)
        ray.get(self.buffer.set_capacity.remote(self.cfg.effective_buffer_capacity))
        self._check_rollout_capacity(ray.cluster_resources())
        self._resize_rollout_actors(self.cfg.rollout.num_actors)
        self.progress.say(
            f"{len(self.slots)} rollout actor(s), {self.learner.num_ranks} learner rank(s), "
            "1 buffer on Ray"
        )
        nodes = ray.get([slot.handle.node_address.remote() for slot in self.slots])
        self.progress.say(
            "rollout actors on "
            + ", ".join(f"{slot.index}: {ip}" for slot, ip in zip(self.slots, nodes, strict=True))
        )
        if self.cfg.rollout.engine_metrics_port is not None:
            urls = ray.get([slot.handle.metrics_url.remote() for slot in self.slots])
            for slot, url in zip(self.slots, urls, strict=True):
                self.progress.say(f"rollout actor {slot.index} engine metrics: {url or 'none'}")

    def _check_rollout_capacity(self, cluster_total: dict[str, float]) -> None:
        """Set the control plane's cap on ``rollout.num_actors`` and check the start value.

        Raises:
            ConfigError: ``rollout.num_actors`` exceeds the cap, which would leave actors
                pending forever.
        """
        from services.ray_actors import rollout_actor_capacity

        if self.cfg.ray.max_rollout_actors is not None:
            cap, why = self.cfg.ray.max_rollout_actors, "ray.max_rollout_actors"
        else:
            cap, why = rollout_actor_capacity(self.cfg, cluster_total)
        self.control.max_rollout_actors, self.control.capacity_reason = cap, why
        self.control.check_rollout_actors(self.cfg.rollout.num_actors)

    def _shutdown(self) -> None:
        for close in reversed(self._closers):
            try:
                close()
            except Exception as e:
                log.warning("shutdown step %s failed: %s", getattr(close, "__qualname__", close), e)
        self._closers.clear()

    def _install_signal_handlers(self) -> None:
        def on_sigterm(signum, frame):
            self.progress.say(
                "SIGTERM: finishing the current step, checkpointing, exiting with status 75"
            )
            self.stop_requested.set()

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)

    # ------------------------------------------------------------------ actors

    def _resize_rollout_actors(self, n: int) -> None:
        import ray

        from services.ray_actors import create_rollout_actor

        while len(self.slots) < n:
            index = len(self.slots)
            self.slots.append(
                RolloutSlot(create_rollout_actor(self.cfg, self.retrieval_url, index), index)
            )
            if self._sync is not None:
                self._track_acks(self.weight_sync.push_to(self._sync, [self.slots[-1].handle]))
                self.slots[-1].engine_version = self._sync.policy_version
        while len(self.slots) > n:
            slot = self.slots.pop()  # its in-flight rollout, if any, is abandoned
            ray.kill(slot.handle, no_restart=True)

    def _on_actor_crash(self, slot: RolloutSlot, error: Exception) -> None:
        """A rollout actor died mid-batch: count it, re-sync its weights once Ray restarts it.

        Raises:
            RolloutActorLost: its constructor raised (a bad engine config, a missing model:
                a restart cannot help), or it crashed more than ``ray.max_actor_restarts``
                + 1 times in a row without completing a rollout (Ray no longer restarts it).
        """
        slot.crashes_in_a_row += 1
        if getattr(error, "actor_init_failed", False):
            raise RolloutActorLost(
                f"rollout actor {slot.index} failed to start: {_first_line_of_cause(error)}"
            ) from error
        if slot.crashes_in_a_row > self.cfg.ray.max_actor_restarts + 1:
            raise RolloutActorLost(
                f"rollout actor {slot.index} crashed {slot.crashes_in_a_row} times in a row "
                f"(ray.max_actor_restarts = {self.cfg.ray.max_actor_restarts}): {error}"
            ) from error
        self.state.actor_restarts += 1
        self.metrics.actor_restarts_total.inc()
        self.progress.say(
            f"rollout actor {slot.index} crashed ({type(error).__name__}); restarting "
            "(it rejoins with current weights once Ray has placed it again)"
        )
        log.warning("rollout actor %d crashed: %s", slot.index, error)
        slot.running.clear()
        self._end_busy(slot)
        self._mark_lost(slot, f"rollout actor {slot.index} lost ({type(error).__name__})")

    def _mark_lost(self, slot: RolloutSlot, reason: str) -> None:
        """Take a crashed actor out of syncs and admission until Ray has it back: the
        collective group (if it is a member) is aborted so no survivor waits for it, and a
        weight load is queued on it, which runs first when it restarts (its success brings
        the slot back, :meth:`_on_sync_ack`)."""
        weight_sync = getattr(self, "weight_sync", None)
        if weight_sync is not None:
            weight_sync.on_member_lost(slot.handle, reason)
        if slot.lost or self._sync is None:
            return  # before the first sync there is nothing to re-send: that sync reaches it
        slot.lost = True
        acks = weight_sync.push_to(self._sync, [slot.handle])
        self._track_acks(acks)
        self._revival_acks.update({ack: slot for ack in acks})
        slot.engine_version = self._sync.policy_version

    # ------------------------------------------------------------------ warm start / eval

    def _warm_start(self) -> None:
        """SFT on demonstrations (search the gold entity, answer with the gold answer) built
        from the training split and the real retrieval server; teaches the tool format."""
        import ray
        from transformers import AutoTokenizer

        from actors.retrieval_client import RetrievalClient
        from learner.sft import build_demonstrations
        from services.sampler import QuestionSampler

        n = self.cfg.sft.num_demonstrations
        self.progress.say(f"warm start: building demonstrations from {n} training questions")
        # a separate stream (seed + 1) so RL questions are not used up by the warm start;
        # with data.warm_start_share > 0 the two draw from disjoint sides of the split
        records = QuestionSampler.from_data(
            self.cfg.data, "train", self.cfg.run.seed + 1, side="warm_start"
        ).sample(n)
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        with RetrievalClient(self.retrieval_url, self.cfg.rollout.retrieval) as client:
            demos = build_demonstrations(
                records, tokenizer, client.retrieve,
                max_information_tokens=self.cfg.rollout.max_information_tokens,
                system_prompt=self.cfg.rollout.system_prompt,
                early_answer_share=self.cfg.sft.early_answer_share,
                seed=self.cfg.run.seed + 1,
            )  # fmt: skip
        early_note = ""
        if self.cfg.sft.early_answer_share > 0.0:  # build_demonstrations raised if none could
            early_note = f", {demos.num_early_answer} answering after their first search"
        self.progress.say(
            f"warm start: {len(demos.demonstrations)} demonstrations "
            f"({demos.num_answer_not_retrieved} skipped: answer not retrieved, "
            f"{demos.num_invalid} invalid{early_note}); SFT {self.cfg.sft.epochs} epoch(s)"
        )
        report = ray.get(self.learner.warm_start.remote(demos.demonstrations, self.cfg.sft))
        self.state.warm_started = True
        # SFT steps are weight updates too: versions continue from the learner's count
        self.state.policy_version = report.policy_version
        record = {k: v for k, v in report.__dict__.items() if k != "losses"}
        record.update(loss_first=report.losses[0], loss_last=report.losses[-1])
        self._append_jsonl("sft.jsonl", record)
        self.progress.say(f"warm start done: {_fmt(record)}")

    def _evaluate(self, tag: str) -> None:
        """Greedy evaluation on the validation questions (``run.eval_questions``), and with
        ``run.eval_sampled`` the same questions again at the rollout temperature (tag
        ``<tag>_sampled``)."""
        from services.sampler import evaluation_questions

        n = self.cfg.run.eval_questions
        if n == 0:
            return
        records = evaluation_questions(self.cfg.data, "validation", n)
        shards = [records[i :: len(self.slots)] for i in range(len(self.slots))]
        self._evaluate_shards(shards, tag, greedy=True)
        if self.cfg.run.eval_sampled:
            self._evaluate_shards(shards, f"{tag}_sampled", greedy=False)

    def _evaluate_shards(self, shards: list[list[dict[str, Any]]], tag: str, greedy: bool) -> None:
        from services.evaluate import summarize_eval
        from services.records import EVAL_RECORDS, eval_records

        trajectories = self._rollout_shards(shards, tag, greedy=greedy)
        summary = summarize_eval(trajectories)
        summary.update(
            tag=tag, learner_step=self.state.learner_step, policy_version=self.state.policy_version
        )
        self._append_jsonl("eval.jsonl", summary)
        self._write_records(
            EVAL_RECORDS,
            f"eval_samples/{tag}",
            eval_records(
                trajectories, tag, self.state.learner_step, self.cfg.run.record_text_chars
            ),
        )
        self.progress.say(f"eval ({tag}) validation: {_fmt(summary)}")

    def _rollout_shards(
        self, shards: list[list[dict[str, Any]]], tag: str, greedy: bool = True
    ) -> list[Any]:
        """Evaluation rollouts of ``shards[i]`` on rollout actor ``i``, all in parallel:
        greedy (one episode per question), or with ``greedy = False`` at the rollout
        temperature (``rollout.group_size`` episodes per question).

        An actor that crashes mid-shard (or came back from a restart with the base weights)
        is counted, re-synced and given its shard again: evaluation is never trained
        on, so re-running it is safe. Raises ``RuntimeError`` after
        ``ray.max_actor_restarts`` failed rounds.
        """
        import ray

        chunk = max(1, self.cfg.rollout.prompts_per_batch)
        total = sum(len(shard) for shard in shards)
        done, started = 0, time.perf_counter()
        pending = {i: shard for i, shard in enumerate(shards) if shard}
        trajectories: list[Any] = []
        restarting: set[int] = set()  # actors that crashed and have not answered since
        for _ in range(self.cfg.ray.max_actor_restarts + 1):
            # each shard in chunks, all queued at once (an actor runs them in order), read
            # back in order per actor so that progress shows as chunks finish
            queues = {
                i: [
                    (k, self.slots[i].handle.rollout.remote(shard[k : k + chunk], greedy=greedy))
                    for k in range(0, len(shard), chunk)
                ]
                for i, shard in pending.items()
            }
            failed: dict[int, list[dict[str, Any]]] = {}
            while queues:
                heads = {queue[0][1]: i for i, queue in queues.items()}
                ready, _ = ray.wait(list(heads), num_returns=1)
                i = heads[ready[0]]
                k, ref = queues[i].pop(0)
                slot = self.slots[i]
                try:
                    batch = ray.get(ref)
                    lost = _lost_weights(batch, slot.engine_version)
                    if lost:
                        self._on_actor_crash(
                            slot, RuntimeError("engine lost its weights (restarted)")
                        )
                except ray.exceptions.RayActorError as e:
                    if i not in restarting:  # one crash, however many of its chunks fail
                        self._on_actor_crash(slot, e)
                    lost = True
                restarting.discard(i)
                if lost:
                    restarting.add(i)
                    failed[i] = pending[i][k:]  # this chunk and the ones queued behind it
                    del queues[i]
                    continue
                if not queues[i]:
                    del queues[i]
                trajectories.extend(batch)
                done += len(pending[i][k : k + chunk])
                elapsed = time.perf_counter() - started
                self.progress.say(
                    f"eval ({tag}) {done}/{total} questions, "
                    f"ETA {_fmt_seconds(elapsed / done * (total - done))}"
                )
            if not failed:
                return trajectories
            for ack in list(self._pending_acks):  # the re-synced weights must land first
                self._on_sync_ack(ack)
            for i in failed:  # wait until Ray has restarted them (a dead one fails next round)
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(self.slots[i].handle.__ray_ready__.remote(), timeout=300)
            pending = failed
        raise RuntimeError(
            f"eval[{tag}]: rollout actors {sorted(pending)} crashed "
            f"{self.cfg.ray.max_actor_restarts + 1} times in a row"
        )

    # ------------------------------------------------------------------ the loop

    def _train_loop(self) -> None:
        import ray

        num_steps = self.cfg.run.num_steps
        deadline = time.monotonic() + self.max_train_s if self.max_train_s > 0 else float("inf")
        while (
            self.state.learner_step < num_steps
            and not self.stop_requested.is_set()
            and time.monotonic() < deadline
        ):
            if self._step_ref is None:
                self._apply_pending_changes()
                self._maybe_start_step()
            retrieval_up = self._retrieval_up()
            if retrieval_up:  # no new rollout while the managed server restarts
                self._admit_rollouts()
            waiting = [r.ref for s in self.slots for r in s.running]
            waiting += [self._step_ref] if self._step_ref is not None else []
            waiting += list(self._pending_acks)
            if not waiting and not retrieval_up:
                time.sleep(0.5)
                continue
            if not waiting:
                raise RuntimeError("deadlock: no rollout, learner step or sync in flight")
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in ready:
                self._dispatch(ref)
        # rollouts still in flight are abandoned: never trained on, regenerated on resume
        for slot in self.slots:
            slot.running.clear()
            slot.busy_since = None
        if self._step_ref is not None:
            self._on_step_done(ray.get(self._step_ref).to_dict())

    def _retrieval_up(self) -> bool:
        """False while the managed retrieval server restarts; raises once it cannot come back."""
        if self._retrieval_supervisor is None:
            return True
        self._retrieval_supervisor.raise_if_failed()
        return self._retrieval_supervisor.up

    def _admit_rollouts(self) -> None:
        """Start a rollout on every actor with a free call (``rollout.calls_per_actor``)
        whose output :func:`learner.admission.may_admit` says will be consumed within
        ``buffer.max_staleness`` (no wasted rollouts)."""
        import ray

        from learner.admission import may_admit

        live = self.control.config
        per_call = live.rollout.prompts_per_batch * live.rollout.group_size
        # what is already over the bound at the next take will be dropped, not consumed
        unconsumed = ray.get(self.buffer.ready_counts.remote(self._next_take_version()))
        for v, c in self._in_flight_counts().items():
            unconsumed[v] = unconsumed.get(v, 0) + c
        # least recently started first: when admission lets in fewer rollouts than there are
        # idle actors (learner-bound), they take turns, so none sits unused for the whole run
        # (a pod lost while its actor idles is noticed at its next rollout, not at the end)
        for slot in sorted(self.slots, key=lambda s: s.started_s):
            full = len(slot.running) >= self.cfg.rollout.calls_per_actor
            if full or slot.engine_version < 0 or slot.lost:
                continue
            if not may_admit(
                unconsumed, slot.engine_version, per_call, self._next_take_version(),
                live.buffer.max_staleness, live.learner.train_batch_size,
            ):  # fmt: skip
                continue
            first_draw = self.sampler.num_drawn
            records = self.sampler.sample(live.rollout.prompts_per_batch)
            # the actor may run this before the load of engine_version lands (weight loads
            # have a thread of their own): it waits for it, so its oldest token is at least
            # the version admission counted it at
            ref = slot.handle.rollout.remote(records, min_policy_version=slot.engine_version)
            slot.started_s = time.perf_counter()
            if slot.busy_since is None:
                slot.busy_since = slot.started_s
            slot.running.append(
                RunningRollout(ref, slot.engine_version, slot.started_s, first_draw)
            )
            self._calls_running_max = max(self._calls_running_max, len(slot.running))
            unconsumed[slot.engine_version] = unconsumed.get(slot.engine_version, 0) + per_call
            self.state.trajectories_admitted += per_call

    def _end_busy(self, slot: RolloutSlot) -> None:
        """The actor has no call running any more: add its busy interval to the step's."""
        if slot.busy_since is not None:
            self._busy_s += time.perf_counter() - slot.busy_since
            slot.busy_since = None

    def _in_flight_counts(self) -> dict[int, int]:
        """version -> trajectories being generated (running rollout calls)."""
        per_call = self.cfg.rollout.prompts_per_batch * self.cfg.rollout.group_size
        counts: dict[int, int] = {}
        for r in (r for s in self.slots for r in s.running):
            counts[r.submitted_version] = counts.get(r.submitted_version, 0) + per_call
        return counts

    def _next_take_version(self) -> int:
        return self.state.policy_version + int(self._step_ref is not None)

    def _dispatch(self, ref: Any) -> None:
        import ray

        if ref is self._step_ref or ref == self._step_ref:
            self._step_ref = None
            self._on_step_done(ray.get(ref).to_dict())
            return
        if ref in self._pending_acks:
            self._on_sync_ack(ref)
            return
        slot, call = next((s, r) for s in self.slots for r in s.running if r.ref == ref)
        try:
            trajectories = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._on_actor_crash(slot, e)  # every call running on it is lost
            return
        slot.running.remove(call)
        if not slot.running:
            self._end_busy(slot)
        slot.crashes_in_a_row = 0
        self._rollout_durations_s.append(time.perf_counter() - call.started_s)
        if _lost_weights(trajectories, call.submitted_version):
            # Its output is correctly stamped (and will be dropped as stale); re-sync it.
            self._on_actor_crash(slot, RuntimeError("engine lost its weights (restarted)"))
        _stamp_ids(
            trajectories, call.first_draw, self.cfg.rollout.group_size, self.records.lineage.attempt
        )
        landed = sum(int(t.extra.get("inflight_weight_updates", 0)) for t in trajectories)
        self.state.inflight_weight_updates += landed
        self.metrics.inflight_weight_updates_total.inc(landed)
        self._on_rollout_done(trajectories)

    def _on_rollout_done(self, trajectories: list[Any]) -> None:
        import ray

        accepted = ray.get(self.buffer.put.remote(trajectories))
        self.state.trajectories_generated += len(trajectories)
        self.metrics.trajectories_generated_total.inc(len(trajectories))
        self._rollout_trajs += len(trajectories)
        self._rollout_tokens += sum(t.num_policy_tokens for t in trajectories)
        for t in trajectories:
            if t.malformed_reason:
                self.metrics.count_malformed_answer(t.malformed_reason)
            if t.retrieval_failed:
                # extra["retrieval_error"] is "<reason>: <message>" (timeout, connect, http_503...)
                self.metrics.retrieval_failed_trajectories_total.inc()
                error = t.extra.get("retrieval_error") or "unknown"
                self.metrics.count_retrieval_error(error.split(":", 1)[0])
        if accepted < len(trajectories):
            log.warning("buffer full: %d trajectories rejected", len(trajectories) - accepted)

    def _maybe_start_step(self) -> None:
        import ray

        from learner.admission import may_take

        n = self.cfg.learner.train_batch_size
        ready = ray.get(self.buffer.ready_counts.remote(self.state.policy_version))
        if not may_take(ready, self._in_flight_counts(), n):
            return  # too few ready, or an older rollout is still running (consume oldest first)
        take = ray.get(self.buffer.take.remote(n, self.state.policy_version))
        self.metrics.dropped_stale_total.inc(take.dropped_stale)
        self.state.trajectories_dropped_stale += take.dropped_stale
        # only this driver touches the buffer, so n ready means take returns n
        if len(take.trajectories) != n:
            raise RuntimeError(
                f"buffer returned {len(take.trajectories)} trajectories, expected {n}"
            )
        self.metrics.observe_staleness(take.staleness)
        self.metrics.observe_token_staleness(take.token_staleness)
        self.metrics.mixed_version_trajectories_total.inc(
            sum(t.policy_version_min != t.policy_version_max for t in take.trajectories)
        )
        self._step_take = take
        self._step_started_s = time.perf_counter()
        # the learner trains on tokens: the transcripts stay here (for samples.jsonl)
        self._step_ref = self.learner.step.remote(
            [t.without_transcript() for t in take.trajectories]
        )

    def _on_step_done(self, step_metrics: dict[str, float]) -> None:
        import ray

        take = self._step_take
        self.state.learner_step += 1
        self.state.policy_version += 1
        if (
            step_metrics.get("policy_version", self.state.policy_version)
            != self.state.policy_version
        ):
            raise RuntimeError(
                f"learner is at policy_version {step_metrics['policy_version']}, "
                f"driver expected {self.state.policy_version}"
            )
        self.state.trajectories_consumed += len(take.trajectories)
        self._append_jsonl(
            "consumed.jsonl",
            {
                "step": self.state.learner_step,
                "ids": [t.extra.get("trajectory_id") for t in take.trajectories],
                "staleness": list(take.staleness),
                # per trajectory: [version, policy tokens it sampled], oldest first
                "token_versions": [
                    [[v, n] for v, n in t.version_counts().items()] for t in take.trajectories
                ],
                # per token: {staleness: policy tokens}, over the whole take
                "token_staleness": {str(k): n for k, n in take.token_staleness.items()},
            },
        )
        self.metrics.trajectories_consumed_total.inc(len(take.trajectories))
        self.metrics.nonfinite_steps_total.inc(int(step_metrics.get("skipped_steps", 0)))
        stats = ray.get(self.buffer.stats.remote())
        record = dict(step_metrics)
        self._write_samples(take, record.pop("turn_advantages", None) or [])
        trained = step_metrics.get("variant", self.control.config.algorithm.variant)
        if trained != self.control.config.algorithm.variant:
            raise RuntimeError(
                f"learner trained {trained} but the live config says "
                f"{self.control.config.algorithm.variant}"
            )
        record["trained_variant"] = trained
        record.update(self._throughput())
        record.update(
            step=self.state.learner_step,
            policy_version=self.state.policy_version,
            variant=self.control.config.algorithm.variant,
            wall_s=round(time.perf_counter() - self._step_started_s, 3),
            elapsed_s=round(time.perf_counter() - self._run_started_s, 3),
            staleness_mean=sum(take.staleness) / len(take.staleness),
            staleness_max=max(take.staleness),
            **_token_staleness_summary(take.token_staleness),
            inflight_weight_updates=self.state.inflight_weight_updates,
            malformed_rate=sum(bool(t.malformed_reason) for t in take.trajectories)
            / len(take.trajectories),
            dropped_stale=stats.dropped_stale_total,
            buffer_depth=stats.depth,
            **self._waste(),
        )
        if self.state.learner_step % self.cfg.sync.every_k_steps == 0:
            record["weight_sync_s"] = self._sync_weights(blocking=False)
        self.metrics.observe_step(
            {k: v for k, v in record.items() if k in _learner_gauges()},
        )
        self.metrics.set_learner_state(self.state.learner_step, self.state.policy_version)
        self.metrics.buffer_depth.set(stats.depth)
        self._append_jsonl("steps.jsonl", record)
        self.progress.step(record)
        self._publish_status(stats)
        every = self.cfg.checkpoint.every_k_steps
        if every and self.state.learner_step % every == 0:
            self._checkpoint()

    def _waste(self) -> dict[str, float | int]:
        """Run totals: trajectories generated, consumed, dropped as stale, and the waste
        fraction ``dropped_stale / generated`` (0 at a constant bound, see learner.admission)."""
        st = self.state
        return {
            "trajectories_generated": st.trajectories_generated,
            "trajectories_consumed": st.trajectories_consumed,
            "trajectories_dropped_stale": st.trajectories_dropped_stale,
            "waste_fraction": st.trajectories_dropped_stale / max(st.trajectories_generated, 1),
        }

    def _throughput(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = max(now - self._window_start_s, 1e-9)
        durations = self._rollout_durations_s
        out = {
            "trajectories_per_s": self._rollout_trajs / elapsed,
            "rollout_tokens_per_s": self._rollout_tokens / elapsed,
            "rollouts_completed": len(durations),
            "rollout_s_mean": sum(durations) / len(durations) if durations else 0.0,
            "rollout_calls_running_max": self._calls_running_max,
            # actor-seconds with at least one call running (engine idle = 1 - busy / span)
            "rollout_busy_s": self._busy_s
            + sum(now - s.busy_since for s in self.slots if s.busy_since is not None),
        }
        self._busy_s = 0.0
        for slot in self.slots:
            if slot.busy_since is not None:
                slot.busy_since = now
        self._rollout_durations_s = []
        self._calls_running_max = max((len(s.running) for s in self.slots), default=0)
        self.metrics.trajectories_per_s.set(out["trajectories_per_s"])
        self.metrics.rollout_tokens_per_s.set(out["rollout_tokens_per_s"])
        self._rollout_trajs = self._rollout_tokens = 0
        self._window_start_s = now
        return out

    # ------------------------------------------------------------------ weight sync

    def _sync_weights(self, blocking: bool) -> float:
        """Push the learner's current weights to every engine that is not lost (a lost one
        gets them when Ray has restarted it); returns the export seconds."""
        live = [s for s in self.slots if not s.lost]
        engines = [s.handle for s in live]
        if self.cfg.sync.fixed_lag:  # engines exactly buffer.max_staleness versions behind
            from services.lagged_sync import LaggedWeightSync

            self._lagged_sync = self._lagged_sync or LaggedWeightSync()
            handle = self._lagged_sync.push(
                self.learner, engines, self.state.policy_version, self.cfg.buffer.max_staleness
            )
        else:
            handle = self._push_to_live(live)
        self._sync = handle
        for slot in live:
            slot.engine_version = handle.policy_version
        self._track_acks(handle.acks)
        if blocking:
            # _on_sync_ack blocks on the ack and tolerates a crashed actor (re-synced later)
            for ack in list(handle.acks):
                self._on_sync_ack(ack)
        return handle.export_s

    def _push_to_live(self, live: list[RolloutSlot]) -> Any:
        """``weight_sync.push`` to the slots in ``live``; engines that turn out to be gone
        while the collective group forms are marked lost (and removed from ``live``) and the
        push is made again without them."""
        from services.weight_sync import EnginesLost

        while True:
            try:
                return self.weight_sync.push(
                    self.learner, [s.handle for s in live], self.state.policy_version
                )
            except EnginesLost as e:
                gone = {id(h) for h in e.engines}
                for slot in [s for s in live if id(s.handle) in gone]:
                    live.remove(slot)
                    self._mark_lost(slot, f"rollout actor {slot.index} did not answer the sync")

    def _track_acks(self, acks: list[Any]) -> None:
        for ack in acks:
            self._pending_acks[ack] = (self._sync.export_s, time.perf_counter())

    def _on_sync_ack(self, ack: Any) -> None:
        import ray

        export_s, _ = self._pending_acks.pop(ack)
        revived = self._revival_acks.pop(ack, None)
        try:
            load_s = ray.get(ack)
        except ray.exceptions.RayActorError as e:
            # an engine died before or during this sync: no survivor may wait for it
            self.weight_sync.on_member_lost(
                None, f"an engine died during a sync ({type(e).__name__})"
            )
            if revived is not None:
                revived.lost = False  # it crashed again: _mark_lost queues another load
                self._mark_lost(revived, f"rollout actor {revived.index} lost again")
            return  # a crashed actor is re-synced by _on_actor_crash / _mark_lost
        except ray.exceptions.RayTaskError as e:
            # a collective sync broken by an engine that died mid-broadcast: the group is
            # formed again, and every engine re-synced, at the next sync
            if not self.weight_sync.on_broken_sync(e):
                raise
            self._resync_after_broken_broadcast()
            return
        if isinstance(load_s, int | float):
            self.metrics.observe_weight_sync(export_s + float(load_s))
        if revived is not None:
            self._on_revived(revived)

    def _resync_after_broken_broadcast(self) -> None:
        """The engines that survived a broken broadcast did not get ``self._sync``'s weights,
        yet their next rollouts wait for that version (``min_policy_version``): send them
        the learner's weights through the object store now, once per broken sync, instead
        of at the next sync (which may need their trajectories first: the run would stall
        for ``rollout.weight_wait_timeout_s``). The group is formed again at the next sync."""
        if self._sync is None or self._resynced_sync is self._sync:
            return
        self._resynced_sync = self._sync
        live = [s for s in self.slots if not s.lost]
        self.progress.say(
            "weight sync: the collective broadcast broke (an engine died); re-sending "
            f"policy_version {self._sync.policy_version} to {len(live)} engine(s) through "
            "the object store, re-forming the group at the next sync"
        )
        self._track_acks(self.weight_sync.push_to(self._sync, [s.handle for s in live]))

    def _on_revived(self, slot: RolloutSlot) -> None:
        """A lost actor is back (Ray restarted it and it loaded the weights queued at the
        crash): bring it up to the current version before its first rollout, then let it
        take part in syncs and admission again."""
        import ray

        slot.lost = False
        # a restarted actor starts from its creation config; a live change must survive it
        self._set_interrupt([slot], self.cfg.rollout.interrupt_every_tokens)
        behind = self.state.policy_version - slot.engine_version
        if self._sync is not None and behind > 0:
            ray.get(self.weight_sync.push_to(self._sync, [slot.handle]))
            slot.engine_version = self._sync.policy_version
        from services.weight_sync import engine_weights_call

        node = ray.get(engine_weights_call(slot.handle, "node_address").remote())
        self.progress.say(
            f"rollout actor {slot.index} is back on {node} with policy_version "
            f"{slot.engine_version}"
        )

    # ------------------------------------------------------------------ live changes

    def _apply_pending_changes(self) -> None:
        import ray

        new = self.control.take_pending()
        if new is None:
            return
        old = self.control.config
        fields = changed_fields(old, new)
        if new.buffer.max_staleness != old.buffer.max_staleness:
            ray.get(self.buffer.set_max_staleness.remote(new.buffer.max_staleness))
            # a lowered bound: what is already over it is dropped and counted now
            purged = ray.get(self.buffer.purge_stale.remote(self.state.policy_version))
            self.metrics.dropped_stale_total.inc(purged)
            self.state.trajectories_dropped_stale += purged
        if new.effective_buffer_capacity != old.effective_buffer_capacity:
            ray.get(self.buffer.set_capacity.remote(new.effective_buffer_capacity))
        if new.buffer.stale_policy != old.buffer.stale_policy:
            ray.get(self.buffer.set_stale_policy.remote(new.buffer.stale_policy))
        if new.algorithm != old.algorithm:
            ray.get(self.learner.set_algorithm.remote(new.algorithm))
        if (new.learner.actor_lr, new.learner.critic_lr) != (
            old.learner.actor_lr,
            old.learner.critic_lr,
        ):
            ray.get(self.learner.set_lr.remote(new.learner.actor_lr, new.learner.critic_lr))
        self.cfg = new
        if new.rollout.interrupt_every_tokens != old.rollout.interrupt_every_tokens:
            self._set_interrupt(self.slots, new.rollout.interrupt_every_tokens)
        if new.rollout.num_actors != len(self.slots):
            self._resize_rollout_actors(new.rollout.num_actors)
        self.control.publish(config=new)
        for f in fields:
            self.metrics.count_config_change(f)
        self._publish_live_config()
        self._append_jsonl(
            "config_changes.jsonl", {"learner_step": self.state.learner_step, "fields": fields}
        )
        self.progress.say(
            f"applied live change at step {self.state.learner_step}: {', '.join(fields)}"
        )
        log.info("applied live change: %s", fields)

    def _set_interrupt(self, slots: list[RolloutSlot], every_tokens: int) -> None:
        """Set ``rollout.interrupt_every_tokens`` on ``slots``' actors (from their next
        rollout on), through their weight thread so a running rollout does not delay it."""
        import ray

        from services.weight_sync import engine_weights_call

        ray.get([
            engine_weights_call(s.handle, "set_interrupt_every_tokens").remote(every_tokens)
            for s in slots if not s.lost
        ])  # fmt: skip

    def _publish_live_config(self) -> None:
        cfg = self.control.config
        self.metrics.set_live_config(
            max_staleness=cfg.buffer.max_staleness,
            variant=cfg.algorithm.variant,
            learning_rate=cfg.learner.actor_lr,
            clip_eps=cfg.algorithm.clip_eps_high,
            num_rollout_actors=cfg.rollout.num_actors,
        )

    def _publish_status(self, stats: Any) -> None:
        self.control.publish(
            learner_step=self.state.learner_step,
            policy_version=self.state.policy_version,
            engine_versions=[s.engine_version for s in self.slots],
            buffer={"depth": stats.depth, "capacity": stats.capacity,
                    "dropped_stale_total": stats.dropped_stale_total},
            **self._waste(),
            actor_restarts=self.state.actor_restarts,
        )  # fmt: skip

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint(self) -> Path:
        import ray

        self.state.questions_drawn = self.sampler.num_drawn
        self.state.elapsed_s = round(time.perf_counter() - self._run_started_s, 3)
        self.state.record_lines = self.records.line_counts()
        path = self.run_dir / "checkpoints" / f"step_{self.state.learner_step:06d}"
        ray.get(self.learner.save_checkpoint.remote(str(path)))
        (path / "driver_state.json").write_text(json.dumps(self.state.__dict__, indent=2))
        (path / "config.json").write_text(json.dumps(public_config(self.control.config), indent=2))
        (self.run_dir / "checkpoints" / "latest").write_text(path.name)
        self._prune_checkpoints()
        self._last_checkpoint_step = self.state.learner_step
        self.progress.say(f"checkpoint: {path}")
        return path

    def _report_stabilisers(self) -> None:
        """Say whether the stabilisers acted over the run's steps (:mod:`services.stabilisers`)."""
        from services.stabilisers import activity_line, stabiliser_activity

        steps = read_records(self.run_dir / "steps.jsonl", "step")
        if steps:
            self.progress.say(activity_line(stabiliser_activity(steps)))

    def _plot(self) -> None:
        """``<run_dir>/curves.png`` (what ``stppo plot <run_dir>`` draws); a failure to draw
        is logged, never fatal: the run's results are already on disk."""
        from services.plots import plot_runs

        if not (self.run_dir / "steps.jsonl").exists():
            return
        try:
            path = plot_runs([self.run_dir], self.run_dir / "curves.png")
        except Exception as e:
            log.warning("could not draw the curves: %s", e)
            return
        self.progress.say(f"curves: {path}")

    def _prune_checkpoints(self) -> None:
        import shutil

        root = self.run_dir / "checkpoints"
        done = sorted(p for p in root.glob("step_*") if (p / "driver_state.json").exists())
        for old in done[: -self.cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def _restore(self) -> None:
        """Load the latest checkpoint: the learner's state, the driver's counters and sampler
        position, and the live-changed fields of the config saved with it (variant and its
        options, staleness bound, learning rates, actors, sync period) which override the
        command line's, so the learner, the driver, ``ctl status`` and the metrics agree."""
        import ray

        root = self.run_dir / "checkpoints"
        latest = root / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"--resume: no checkpoint in {root}")
        path = root / latest.read_text().strip()
        ray.get(self.learner.load_checkpoint.remote(str(path)))
        saved = json.loads((path / "driver_state.json").read_text())
        self.state = DriverState(**saved)
        self.sampler.num_drawn = self.state.questions_drawn
        self._run_started_s = time.perf_counter() - self.state.elapsed_s
        config_path = path / "config.json"
        if config_path.exists():
            restored = restore_live_fields(self.cfg, json.loads(config_path.read_text()))
            self._apply_restored_config(restored)
        self.progress.say(
            f"resumed from {path}: step {self.state.learner_step}, version "
            f"{self.state.policy_version}, variant {self.cfg.algorithm.variant}, "
            f"max_staleness {self.cfg.buffer.max_staleness}"
        )

    def _apply_restored_config(self, new: RunConfig) -> None:
        import ray

        self.cfg = new
        self.control.reset(new)
        ray.get(self.buffer.set_max_staleness.remote(new.buffer.max_staleness))
        ray.get(self.buffer.set_stale_policy.remote(new.buffer.stale_policy))
        ray.get(self.buffer.set_capacity.remote(new.effective_buffer_capacity))
        ray.get(self.learner.set_algorithm.remote(new.algorithm))
        ray.get(self.learner.set_lr.remote(new.learner.actor_lr, new.learner.critic_lr))
        if new.rollout.num_actors != len(self.slots):
            self._resize_rollout_actors(new.rollout.num_actors)
        self._publish_live_config()
        (self.run_dir / "config.json").write_text(json.dumps(public_config(new), indent=2))

    # ------------------------------------------------------------------ logs

    def _write_samples(self, take: Any, turn_advantages: list[Any]) -> None:
        """``run.samples_per_step`` of the step's trained trajectories to ``samples.jsonl``."""
        from services.records import TRAIN_SAMPLES, sample_records

        run = self.cfg.run
        records = sample_records(
            take.trajectories, take.staleness, turn_advantages, self.state.learner_step,
            run.samples_per_step, run.seed, run.record_text_chars,
        )  # fmt: skip
        self._write_records(TRAIN_SAMPLES, "samples/train", records)

    def _write_records(self, name: str, key: str, records: list[dict[str, Any]]) -> None:
        """Append per-question records to ``<run_dir>/<name>`` and the trackers (``key``),
        at the current learner step (see :mod:`services.records`)."""
        if not records:
            return
        for record in records:  # through the run's one writer: run id and attempt on each line
            self.records.append(name, record)
        if self.tracker is not None:
            self.tracker.log_records(key, records, self.state.learner_step)

    def _append_jsonl(self, name: str, record: dict[str, Any]) -> None:
        """One record line through :class:`services.run_records.RecordWriter` (which adds
        ``run_id`` and ``attempt``), and to the tracking backends without them."""
        self.records.append(name, record)
        if self.tracker is not None:  # steps, evaluations, warm start, live changes
            self.tracker.log_record(name, record)


def restore_live_fields(cfg: RunConfig, saved: dict[str, Any]) -> RunConfig:
    """``cfg`` with every :data:`services.control.LIVE_FIELDS` value taken from ``saved`` (a
    checkpoint's ``config.json``): a resumed run continues with the last applied live change.

    Raises:
        services.config.ConfigError: the saved values do not validate with ``cfg``.
    """
    from services.config import update_config
    from services.control import LIVE_FIELDS

    changes: dict[str, Any] = {}
    for dotted in LIVE_FIELDS:
        *parents, leaf = dotted.split(".")
        node, target = saved, changes
        for p in parents:
            node = node.get(p, {})
            target = target.setdefault(p, {})
        if leaf in node:
            target[leaf] = node[leaf]
    return update_config(cfg, changes)


def _stamp_ids(trajectories: list[Any], first_draw: int, group_size: int, attempt: int) -> None:
    """Set ``extra["trajectory_id"] = "a<attempt>-d<draw>-g<k>"``: the run's attempt, the
    sampler draw of its question and its index in the group. Unique across a run and its
    resumes: within an attempt the sampler never re-issues a draw, and a resume re-issues the
    draws made after its checkpoint under a new attempt (unlike ``group_id``, whose batch
    counter restarts with the actor).

    ``RolloutWorker.rollout`` returns ``group_size`` trajectories per record, in record order.
    """
    for k, t in enumerate(trajectories):
        draw, g = first_draw + k // group_size, k % group_size
        t.extra["trajectory_id"] = f"a{attempt}-d{draw}-g{g}"


def _checkpoint_step(plan: StartPlan) -> int:
    """The learner step of ``plan.checkpoint`` (0 without one)."""
    if plan.checkpoint is None:
        return 0
    return int(json.loads((plan.checkpoint / "driver_state.json").read_text())["learner_step"])


def _describe_start(plan: StartPlan, lineage: Any) -> str:
    what = f"run {lineage.run_id} attempt {lineage.attempt}"
    if plan.checkpoint is not None:
        return f"{what}: resuming from {plan.checkpoint.name}"
    if plan.continue_lineage:
        return f"{what}: no checkpoint, starting over (earlier records moved to superseded/)"
    return f"{what}: new run"


def _token_staleness_summary(counts: dict[int, int]) -> dict[str, float]:
    """``staleness_token_mean`` / ``staleness_token_max`` of a take's per-token histogram
    (staleness -> policy tokens); NaN / -1 for a take without policy tokens."""
    total = sum(counts.values())
    if total == 0:
        return {"staleness_token_mean": float("nan"), "staleness_token_max": -1}
    return {
        "staleness_token_mean": sum(k * n for k, n in counts.items()) / total,
        "staleness_token_max": max(counts),
    }


def _lost_weights(trajectories: list[Any], expected_version: int) -> bool:
    """Ray restarted the actor while it was idle, so it came back with the base weights: its
    trajectories carry an older ``policy_version`` than the last one pushed to it."""
    return bool(trajectories) and min(t.policy_version_min for t in trajectories) < expected_version


def _wait_external_retrieval(url: str, timeout_s: float) -> None:
    """Block until an external retrieval server answers ``/healthz`` 200.

    Raises:
        RuntimeError: not healthy within ``timeout_s`` (message has the last error).
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{url}/healthz", timeout=2.0)
            if resp.status_code == 200:
                return
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise RuntimeError(f"retrieval server {url} not healthy after {timeout_s:.0f} s ({last})")


def _learner_gauges() -> set[str]:
    from services.metrics import LEARNER_STEP_METRICS

    return set(LEARNER_STEP_METRICS)


def _fmt(values: dict[str, Any]) -> str:
    parts = []
    for k, v in values.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.3g}")
        elif isinstance(v, int | str):
            parts.append(f"{k}={v}")
    return " ".join(parts)


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


def _fmt_seconds(seconds: float) -> str:
    """``95`` -> ``"1m35s"``; ``4000`` -> ``"1h06m"``."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
