"""The stability guard in the driver's loop: after every learner step :class:`Autopilot`
hands the step record to :class:`services.loop.guard.Guard`, sends an action's change to
the control plane (the path of ``stppo ctl``, applied at the next step boundary), and
writes what was decided. The driver carries out what the decision says beyond that: the
rollback to its checkpoint (:attr:`services.loop.guard.Decision.rollback_to`), or the end
of the run (:attr:`services.loop.guard.Decision.stops`).

Outputs: ``guard.jsonl`` in the run directory (:data:`GUARD_LOG`, one
:meth:`services.loop.guard.Decision.record` line per decision that is not ``ok``), the
``stppo_guard_*`` metrics (:meth:`services.metrics.TrainingMetrics.observe_guard`), a
progress line when the decision changes or the guard acts, and one line over the log at
the end of the run and in ``stppo show`` (:func:`log_line`). Ray-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.config import RunConfig
from services.loop.checkpoint import CheckpointStore, DriverState
from services.loop.guard import STOP, Decision, Guard
from services.loop.guard_state import load_state, protect_before, rewind, save_state

GUARD_LOG = "guard.jsonl"
"""The decision log in the run directory."""


class Autopilot:
    """The guard of one run and its outputs.

    Args:
        control: the :class:`services.control.ControlState` (``person_fields``,
            ``request_change``).
        services: anything with ``records`` (:class:`services.run_records.RecordWriter`)
            and ``metrics`` (:class:`services.metrics.TrainingMetrics`).
        say: prints a progress line.

    Attributes:
        stop: the decision that ended the run (:attr:`services.loop.guard.Decision.stops`),
            or None.
    """

    def __init__(self, control: Any, services: Any, say: Any) -> None:
        self.control = control
        self.records = services.records
        self.metrics = services.metrics
        self.say = say
        self.guard = Guard()
        self.stop: Decision | None = None
        self._last: tuple[Any, ...] = ("ok", None, False)

    def request(self, changes: dict[str, Any]) -> list[str]:
        """Send the guard's change to the control plane (``source = "guard"``).

        Raises:
            services.config.ConfigError: the control plane refused it.
        """
        return self.control.request_change(changes, source="guard")

    def step(
        self, record: dict[str, Any], cfg: RunConfig, checkpoints: CheckpointStore | None = None
    ) -> Decision:
        """Decide on one step record under the live config ``cfg`` and write the decision.

        Args:
            record: the step's ``steps.jsonl`` record.
            cfg: the live run config.
            checkpoints: the run's checkpoints: a rollback may go to one of them, and their
                retention is told what to keep for one (:meth:`keep_before`). None: no
                rollback.
        """
        steps = checkpoints.steps if checkpoints is not None else None
        decision = self.guard.observe(record, cfg, self.control.person_fields, self.request, steps)
        self.metrics.observe_guard(
            decision.level, decision.action, decision.signals,
            rolled_back=decision.rollback_to is not None,
        )  # fmt: skip
        key = (decision.level, decision.rule, decision.would_act)
        changed, self._last = key != self._last, key
        if decision.level != "ok":
            self.records.append(GUARD_LOG, decision.record())
            if changed or decision.level == "act":
                self.say(progress_line(decision))
        if decision.stops:
            self.stop = decision
        if checkpoints is not None:
            checkpoints.keep_before = self.keep_before(decision.step, cfg)
        return decision

    def keep_before(self, step: int, cfg: RunConfig) -> tuple[int, bool] | None:
        """What the checkpoint retention keeps for a rollback at learner step ``step``
        (:func:`services.loop.guard_state.protect_before`); None when the guard cannot roll
        back (mode not ``act``, or ``guard.rollback`` off)."""
        g = cfg.guard
        if g.mode != "act" or not g.rollback:
            return None
        return protect_before(self.guard, step, g.window)

    def state(self) -> dict[str, Any]:
        """The guard's state for a checkpoint (:func:`services.loop.guard_state.save_state`)."""
        return save_state(self.guard)

    def restore(self, state: dict[str, Any] | None) -> None:
        """A resume: the guard's state saved in the checkpoint
        (:func:`services.loop.guard_state.load_state`).

        Raises:
            ValueError: a state of another layout version.
        """
        self.guard = load_state(state)

    def rewind(self, state: DriverState, cfg: RunConfig, checkpoints: CheckpointStore) -> None:
        """A rollback to the checkpoint whose driver state is ``state``: the guard's windows
        go back to it, its budgets stay (:func:`services.loop.guard_state.rewind`), and the
        retention keeps what a next rollback may need.

        Raises:
            ValueError: a guard state of another layout version.
        """
        rewind(self.guard, state.guard)
        checkpoints.keep_before = self.keep_before(state.learner_step, cfg)

    def end(self, run_dir: Path) -> None:
        """The end of a run: after a stop, say so and raise.

        Raises:
            services.run_records.GuardStopped: the guard stopped the run.
        """
        if self.stop is not None:
            from services.run_records import GuardStopped

            self.say(f"stopped by the stability guard at step {self.stop.step}")
            raise GuardStopped(self.stop.step, self.stop.reason, run_dir)


def _rollback_text(rollback: dict[str, Any] | None) -> str:
    """``; rolled back to step 10`` / ``; no rollback: no checkpoint before step 3`` / ``""``."""
    if rollback is None:
        return ""
    if rollback.get("to_step") is not None:
        return f"; rolled back to step {rollback['to_step']}"
    return f"; no rollback: {rollback.get('reason')}"


def progress_line(decision: Decision) -> str:
    """``guard act at step 16: behavior_log_ratio_abs_mean > 0.1; lower_staleness requested
    ({'buffer.max_staleness': 16} -> {'buffer.max_staleness': 4}), rolling back to step 14
    (the signal began at step 15)``; a stop: ``guard act at step 30: ...; the run stops:
    rollback budget spent (2 of 2)``."""
    rollback = decision.rollback
    if decision.stops:
        what = f"the run stops: {decision.reason}"
    elif decision.level == "act":
        what = f"{decision.action} requested ({decision.before} -> {decision.after})"
        if rollback is not None and rollback.get("to_step") is not None:
            what += (
                f", rolling back to step {rollback['to_step']} (the signal began at step "
                f"{rollback['signal_began']})"
            )
        elif rollback is not None:
            what += f", no rollback: {rollback.get('reason')}"
    elif decision.would_act:
        what = f"would act: {decision.action or decision.reason} ({decision.reason})"
    else:
        what = "watching"
    return f"guard {decision.level} at step {decision.step}: {decision.rule}; {what}"


def log_line(records: list[dict[str, Any]], mode: str | None = None) -> str:
    """One line over a run's ``guard.jsonl`` records (the end of a run, ``stppo show``):
    warnings, the first step the guard would have acted at, its actions with their
    rollbacks, the number of rollbacks, and the stop.

    Examples: ``stability guard (mode warn): 9 warnings from step 21; would have acted at
    step 22 (behavior_log_ratio_abs_mean > 0.1: lower_staleness); no action``;
    ``stability guard (mode act): 2 warnings from step 3; acted: lower_staleness at step 3
    (step > 2.5; rolled back to step 2); 1 rollback``.
    """
    head = f"stability guard (mode {mode})" if mode else "stability guard"
    if not records:
        return f"{head}: no warning"
    warns = [r for r in records if r.get("level") == "warn"]
    acts = [r for r in records if r.get("level") == "act" and r.get("action") != STOP]
    stops = [r for r in records if r.get("level") == "act" and r.get("action") == STOP]
    would = [r for r in warns if r.get("would_act")]
    parts = [f"{len(warns)} warning{'s' * (len(warns) != 1)} from step {records[0]['step']}"]
    if would:
        first = would[0]
        parts.append(
            f"would have acted at step {first['step']} ({first.get('rule')}: "
            f"{first.get('action') or first.get('reason')})"
        )
    if acts:
        listed = ", ".join(
            f"{r['action']} at step {r['step']} ({r['rule']}{_rollback_text(r.get('rollback'))})"
            for r in acts
        )
        parts.append(f"acted: {listed}")
    else:
        parts.append("no action")
    considered = [r for r in acts if r.get("rollback") is not None]
    if considered or stops:
        n = sum(1 for r in considered if r["rollback"].get("to_step") is not None)
        parts.append(f"{n} rollback{'s' * (n != 1)}")
    for r in stops:
        parts.append(f"stopped at step {r['step']} ({r.get('rule')}): {r.get('reason')}")
    return f"{head}: " + "; ".join(parts)


def summary_line(run_dir: Path, mode: str | None = None) -> str:
    """:func:`log_line` over ``<run_dir>/guard.jsonl`` (no file: no warning)."""
    from services.run_records import read_records

    return log_line(read_records(Path(run_dir) / GUARD_LOG), mode)
