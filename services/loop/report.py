"""What a run tells the world: record lines, the step record, Prometheus, progress, status.

:class:`Report` is the one place that writes a run's records (through
:class:`services.run_records.RecordWriter`, which stamps the run id and attempt, and to the
tracking backends), turns a finished learner step into its ``steps.jsonl`` record and
``consumed.jsonl`` line, counts rollouts for the throughput window, sets the Prometheus
gauges and publishes the control plane's status. Ray-free; it reads the driver's counters
and changes none of them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from services.loop.checkpoint import DriverState
from services.metrics import LEARNER_STEP_METRICS

if TYPE_CHECKING:
    from services.loop.fleet import FleetWindow

log = logging.getLogger("stppo.driver")


def token_staleness_summary(counts: dict[int, int]) -> dict[str, float]:
    """``staleness_token_mean`` / ``staleness_token_max`` of a take's per-token histogram
    (staleness -> policy tokens); NaN / -1 for a take without policy tokens."""
    total = sum(counts.values())
    if total == 0:
        return {"staleness_token_mean": float("nan"), "staleness_token_max": -1}
    return {
        "staleness_token_mean": sum(k * n for k, n in counts.items()) / total,
        "staleness_token_max": max(counts),
    }


def waste(state: DriverState) -> dict[str, float | int]:
    """Run totals: trajectories generated, consumed, dropped as stale, and the waste
    fraction ``dropped_stale / generated`` (0 at a constant bound, see learner.admission)."""
    return {
        "trajectories_generated": state.trajectories_generated,
        "trajectories_consumed": state.trajectories_consumed,
        "trajectories_dropped_stale": state.trajectories_dropped_stale,
        "waste_fraction": state.trajectories_dropped_stale / max(state.trajectories_generated, 1),
    }


def fmt(values: dict[str, Any]) -> str:
    """``k=v`` pairs of a record's numbers and strings (floats to 3 significant digits)."""
    parts = []
    for k, v in values.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.3g}")
        elif isinstance(v, int | str):
            parts.append(f"{k}={v}")
    return " ".join(parts)


class Report:
    """The run's outputs (module docstring).

    Args:
        records: the run's :class:`services.run_records.RecordWriter`.
        metrics: :class:`services.metrics.TrainingMetrics`.
        progress: :class:`services.progress.Progress` (or anything with ``say``/``step``).
        tracker: :class:`services.tracking.Tracker` or None.
        control: the :class:`services.control.ControlState` whose status is published.
        run: the ``run`` config section (samples per step, text cap, seed).
    """

    def __init__(
        self, records: Any, metrics: Any, progress: Any, tracker: Any, control: Any, run: Any
    ) -> None:
        self.records = records
        self.metrics = metrics
        self.progress = progress
        self.tracker = tracker
        self.control = control
        self.run = run
        self._window_start_s = time.perf_counter()
        self._rollout_trajs = 0
        self._rollout_tokens = 0

    def say(self, message: str) -> None:
        self.progress.say(message)

    # ------------------------------------------------------------------ records

    def append(self, name: str, record: dict[str, Any]) -> None:
        """One record line (``run_id`` and ``attempt`` added), and to the trackers without
        them."""
        self.records.append(name, record)
        if self.tracker is not None:
            self.tracker.log_record(name, record)

    def write_records(self, name: str, key: str, records: list[dict[str, Any]], step: int) -> None:
        """Per-question records to ``<run_dir>/<name>`` and the trackers (``key``)."""
        if not records:
            return
        for record in records:
            self.records.append(name, record)
        if self.tracker is not None:
            self.tracker.log_records(key, records, step)

    # ------------------------------------------------------------------ rollouts

    def rollouts_done(self, trajectories: list[Any], accepted: int, landed: int) -> None:
        """Count a finished rollout call (``accepted`` by the buffer; ``landed`` weight
        updates mid-call) for the throughput window and the metrics."""
        self.metrics.inflight_weight_updates_total.inc(landed)
        self.metrics.trajectories_generated_total.inc(len(trajectories))
        self._rollout_trajs += len(trajectories)
        self._rollout_tokens += sum(t.num_policy_tokens for t in trajectories)
        for t in trajectories:
            if t.malformed_reason:
                self.metrics.count_malformed_answer(t.malformed_reason)
            if t.retrieval_failed:
                # extra["retrieval_error"] is "<reason>: <message>" (timeout, http_503...)
                self.metrics.retrieval_failed_trajectories_total.inc()
                error = t.extra.get("retrieval_error") or "unknown"
                self.metrics.count_retrieval_error(error.split(":", 1)[0])
        if accepted < len(trajectories):
            log.warning("buffer full: %d trajectories rejected", len(trajectories) - accepted)

    def throughput(self, window: FleetWindow) -> dict[str, float]:
        """The window since the last step: trajectories and tokens per second, the calls
        that completed and their mean duration, the most calls on one actor and the
        actor-seconds busy (engine idle = 1 - busy / span); starts a new window."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start_s, 1e-9)
        durations = window.durations_s
        out = {
            "trajectories_per_s": self._rollout_trajs / elapsed,
            "rollout_tokens_per_s": self._rollout_tokens / elapsed,
            "rollouts_completed": len(durations),
            "rollout_s_mean": sum(durations) / len(durations) if durations else 0.0,
            "rollout_calls_running_max": window.calls_running_max,
            "rollout_busy_s": window.busy_s,
        }
        self.metrics.trajectories_per_s.set(out["trajectories_per_s"])
        self.metrics.rollout_tokens_per_s.set(out["rollout_tokens_per_s"])
        self._rollout_trajs = self._rollout_tokens = 0
        self._window_start_s = now
        return out

    def pause_window(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation between steps) out of the throughput window."""
        self._window_start_s += seconds

    # ------------------------------------------------------------------ a learner step

    def step_taken(self, take: Any) -> None:
        """The batch a learner step took: its staleness to the histograms."""
        self.metrics.dropped_stale_total.inc(take.dropped_stale)
        self.metrics.observe_staleness(take.staleness)
        self.metrics.observe_token_staleness(take.token_staleness)
        self.metrics.mixed_version_trajectories_total.inc(
            sum(t.policy_version_min != t.policy_version_max for t in take.trajectories)
        )

    def consumed(self, step: int, take: Any) -> None:
        """The ``consumed.jsonl`` line of a finished step: which trajectories it trained on."""
        self.append(
            "consumed.jsonl",
            {
                "step": step,
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

    def samples(self, take: Any, turn_advantages: list[Any], step: int) -> None:
        """``run.samples_per_step`` of the step's trajectories to ``samples.jsonl``."""
        from services.records import TRAIN_SAMPLES, sample_records

        run = self.run
        records = sample_records(
            take.trajectories, take.staleness, turn_advantages, step,
            run.samples_per_step, run.seed, run.record_text_chars,
        )  # fmt: skip
        self.write_records(TRAIN_SAMPLES, "samples/train", records, step)

    def step_record(
        self,
        step_metrics: dict[str, Any],
        take: Any,
        state: DriverState,
        *,
        variant: str,
        wall_s: float,
        elapsed_s: float,
        window: FleetWindow,
        buffer_stats: Any,
    ) -> dict[str, Any]:
        """The ``steps.jsonl`` record of a finished step (its ``turn_advantages`` go to the
        samples, not to the record)."""
        record = dict(step_metrics)
        self.samples(take, record.pop("turn_advantages", None) or [], state.learner_step)
        self.metrics.nonfinite_steps_total.inc(int(step_metrics.get("skipped_steps", 0)))
        record["trained_variant"] = step_metrics.get("variant", variant)
        record.update(self.throughput(window))
        record.update(
            step=state.learner_step,
            policy_version=state.policy_version,
            variant=variant,
            wall_s=round(wall_s, 3),
            elapsed_s=round(elapsed_s, 3),
            staleness_mean=sum(take.staleness) / len(take.staleness),
            staleness_max=max(take.staleness),
            **token_staleness_summary(take.token_staleness),
            inflight_weight_updates=state.inflight_weight_updates,
            malformed_rate=sum(bool(t.malformed_reason) for t in take.trajectories)
            / len(take.trajectories),
            dropped_stale=buffer_stats.dropped_stale_total,
            buffer_depth=buffer_stats.depth,
            **waste(state),
        )
        return record

    def step_done(
        self, record: dict[str, Any], state: DriverState, buffer_stats: Any, engines: list[int]
    ) -> None:
        """Export and log a step record: Prometheus, ``steps.jsonl``, the progress line and
        the control plane's status."""
        self.metrics.observe_step({k: v for k, v in record.items() if k in LEARNER_STEP_METRICS})
        self.metrics.set_learner_state(state.learner_step, state.policy_version)
        self.metrics.buffer_depth.set(buffer_stats.depth)
        self.append("steps.jsonl", record)
        self.progress.step(record)
        self.status(state, buffer_stats, engines)

    def status(self, state: DriverState, buffer_stats: Any, engines: list[int]) -> None:
        """Publish the control plane's ``/status``."""
        self.control.publish(
            learner_step=state.learner_step,
            policy_version=state.policy_version,
            engine_versions=engines,
            buffer={"depth": buffer_stats.depth, "capacity": buffer_stats.capacity,
                    "dropped_stale_total": buffer_stats.dropped_stale_total},
            **waste(state),
            actor_restarts=state.actor_restarts,
        )  # fmt: skip

    def config_changed(self, cfg: Any, step: int, fields: list[str]) -> None:
        """A live change was applied at learner step ``step``: counted, logged, recorded."""
        for name in fields:
            self.metrics.count_config_change(name)
        self.live_config(cfg)
        self.append("config_changes.jsonl", {"learner_step": step, "fields": fields})
        self.say(f"applied live change at step {step}: {', '.join(fields)}")
        log.info("applied live change: %s", fields)

    def live_config(self, cfg: Any) -> None:
        """The live-config gauges (staleness bound, variant, lr, clip, actors)."""
        self.metrics.set_live_config(
            max_staleness=cfg.buffer.max_staleness,
            variant=cfg.algorithm.variant,
            learning_rate=cfg.learner.actor_lr,
            clip_eps=cfg.algorithm.clip_eps_high,
            num_rollout_actors=cfg.rollout.num_actors,
        )

    # ------------------------------------------------------------------ the end of a run

    def stabilisers(self, run_dir: Any) -> None:
        """Say whether the stabilisers acted over the run's steps (:mod:`services.stabilisers`),
        and what the stability guard decided (:func:`services.loop.autopilot.summary_line`)."""
        from services.run_records import read_records
        from services.stabilisers import activity_line, stabiliser_activity

        steps = read_records(run_dir / "steps.jsonl", "step")
        if steps:
            self.say(activity_line(stabiliser_activity(steps)))
        if self.control is not None and self.control.config.guard.mode != "off":
            from services.loop.autopilot import summary_line  # and the stability guard's

            self.say(summary_line(run_dir, self.control.config.guard.mode))

    def curves(self, run_dir: Any) -> None:
        """``<run_dir>/curves.png`` (what ``stppo plot <run_dir>`` draws); a failure to draw
        is logged, never fatal: the run's results are already on disk."""
        from services.plots import plot_runs

        if not (run_dir / "steps.jsonl").exists():
            return
        try:
            path = plot_runs([run_dir], run_dir / "curves.png")
        except Exception as e:
            log.warning("could not draw the curves: %s", e)
            return
        self.say(f"curves: {path}")
