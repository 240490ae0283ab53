"""The stability guard in the driver's loop: after every learner step :class:`Autopilot`
hands the step record to :class:`services.loop.guard.Guard`, sends an action's change to
the control plane (the path of ``stppo ctl``, applied at the next step boundary), and
writes what was decided.

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
from services.loop.guard import Decision, Guard

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
    """

    def __init__(self, control: Any, services: Any, say: Any) -> None:
        self.control = control
        self.records = services.records
        self.metrics = services.metrics
        self.say = say
        self.guard = Guard()
        self._last: tuple[Any, ...] = ("ok", None, False)

    def request(self, changes: dict[str, Any]) -> list[str]:
        """Send the guard's change to the control plane (``source = "guard"``).

        Raises:
            services.config.ConfigError: the control plane refused it.
        """
        return self.control.request_change(changes, source="guard")

    def step(self, record: dict[str, Any], cfg: RunConfig) -> Decision:
        """Decide on one step record under the live config ``cfg`` and write the decision."""
        decision = self.guard.observe(record, cfg, self.control.person_fields, self.request)
        self.metrics.observe_guard(decision.level, decision.action, decision.signals)
        key = (decision.level, decision.rule, decision.would_act)
        changed, self._last = key != self._last, key
        if decision.level != "ok":
            self.records.append(GUARD_LOG, decision.record())
            if changed or decision.level == "act":
                self.say(progress_line(decision))
        return decision


def progress_line(decision: Decision) -> str:
    """``guard act at step 16: behavior_log_ratio_abs_mean > 0.1; lower_staleness requested
    ({'buffer.max_staleness': 16} -> {'buffer.max_staleness': 4})``."""
    if decision.level == "act":
        what = f"{decision.action} requested ({decision.before} -> {decision.after})"
    elif decision.would_act:
        what = f"would act: {decision.action or decision.reason} ({decision.reason})"
    else:
        what = "watching"
    return f"guard {decision.level} at step {decision.step}: {decision.rule}; {what}"


def log_line(records: list[dict[str, Any]], mode: str | None = None) -> str:
    """One line over a run's ``guard.jsonl`` records (the end of a run, ``stppo show``):
    warnings, the first step the guard would have acted at, and its actions.

    Example: ``stability guard (mode warn): 9 warnings from step 21; would have acted at
    step 22 (behavior_log_ratio_abs_mean > 0.1: lower_staleness); no action``.
    """
    head = f"stability guard (mode {mode})" if mode else "stability guard"
    if not records:
        return f"{head}: no warning"
    warns = [r for r in records if r.get("level") == "warn"]
    acts = [r for r in records if r.get("level") == "act"]
    would = [r for r in warns if r.get("would_act")]
    parts = [f"{len(warns)} warning{'s' * (len(warns) != 1)} from step {records[0]['step']}"]
    if would:
        first = would[0]
        parts.append(
            f"would have acted at step {first['step']} ({first.get('rule')}: "
            f"{first.get('action') or first.get('reason')})"
        )
    if acts:
        listed = ", ".join(f"{r['action']} at step {r['step']} ({r['rule']})" for r in acts)
        parts.append(f"acted: {listed}")
    else:
        parts.append("no action")
    return f"{head}: " + "; ".join(parts)


def summary_line(run_dir: Path, mode: str | None = None) -> str:
    """:func:`log_line` over ``<run_dir>/guard.jsonl`` (no file: no warning)."""
    from services.run_records import read_records

    return log_line(read_records(Path(run_dir) / GUARD_LOG), mode)
