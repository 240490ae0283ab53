"""The stability guard beyond one step: its state saved in every checkpoint and restored on a
resume (:func:`save_state`, :func:`load_state`), rewound by a rollback (:func:`rewind`),
and the checkpoints the retention keeps for a rollback (:func:`protect_before`).

The state is JSON (``DriverState.guard`` in ``driver_state.json``): the windows (``[step,
value]`` per signal, NaN as None), each rule's streak and the step its signal began, the
actions (their ``guard.jsonl`` records) and rollbacks taken, the cooldown (observed steps,
the one of the last action) and the decision counts. Pure (no Ray, no I/O).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from services.loop.guard import WINDOW_KEPT, Decision, Guard

STATE_VERSION = 1
"""Version of :func:`save_state`'s layout."""


def save_state(guard: Guard) -> dict[str, Any]:
    """Everything :func:`load_state` needs, JSON-serialisable (module docstring)."""
    return {
        "version": STATE_VERSION,
        "values": {k: [[s, None if math.isnan(v) else v] for s, v in d]
                   for k, d in guard.values.items()},
        "streaks": dict(guard.streaks), "began": dict(guard.began),
        "actions": [a.record() for a in guard.actions],
        "rollbacks": [dict(r) for r in guard.rollbacks],
        "steps_seen": guard.steps_seen, "last_action_seen": guard.last_action_seen,
        "last_action_step": guard.last_action_step, "decisions": dict(guard.decisions),
    }  # fmt: skip


def _check(state: Mapping[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"guard state version {state.get('version')!r}, expected {STATE_VERSION}")


def load_state(state: Mapping[str, Any] | None) -> Guard:
    """The guard :func:`save_state` described; a fresh one for None or ``{}`` (a checkpoint
    from before the guard's state was saved).

    Raises:
        ValueError: a state of another layout version.
    """
    guard = Guard()
    if not state:
        return guard
    _check(state)
    _load_windows(guard, state)
    guard.actions = [decision_from_record(r) for r in state.get("actions", [])]
    guard.rollbacks = [dict(r) for r in state.get("rollbacks", [])]
    guard.steps_seen = int(state.get("steps_seen", 0))
    guard.last_action_seen = state.get("last_action_seen")
    guard.last_action_step = state.get("last_action_step")
    guard.decisions.update(state.get("decisions", {}))
    return guard


def rewind(guard: Guard, saved: Mapping[str, Any] | None) -> None:
    """A rollback to a checkpoint whose guard state is ``saved``: the windows, streaks and
    signal starts go back to that checkpoint's (cleared when it has none); the actions,
    rollbacks, cooldown and decision counts stay (budgets are never given back).

    Raises:
        ValueError: a state of another layout version.
    """
    if saved:
        _check(saved)
    _load_windows(guard, saved or {})


def _load_windows(guard: Guard, state: Mapping[str, Any]) -> None:
    guard.values = {
        k: deque(((int(s), math.nan if v is None else float(v)) for s, v in entries),
                 maxlen=WINDOW_KEPT)
        for k, entries in state.get("values", {}).items()
    }  # fmt: skip
    guard.streaks = {k: int(v) for k, v in state.get("streaks", {}).items()}
    guard.began = {k: int(v) for k, v in state.get("began", {}).items()}


def decision_from_record(record: Mapping[str, Any]) -> Decision:
    """The decision a :meth:`services.loop.guard.Decision.record` line describes (None
    signals back to NaN)."""
    signals = {k: (math.nan if v is None else float(v))
               for k, v in (record.get("signals") or {}).items()}  # fmt: skip
    return Decision(
        step=int(record["step"]), level=record["level"], mode=record.get("mode", ""),
        rule=record.get("rule"), signals=signals, holding=list(record.get("holding", [])),
        action=record.get("action"), would_act=bool(record.get("would_act", False)),
        reason=record.get("reason", ""), before=dict(record.get("before") or {}),
        after=dict(record.get("after") or {}), rollback=record.get("rollback"),
    )  # fmt: skip


def protect_before(guard: Guard, step: int, window: int) -> tuple[int, bool]:
    """What the checkpoint retention keeps for a rollback decided from now on
    (:attr:`services.loop.checkpoint.CheckpointStore.keep_before`), at learner step
    ``step``: ``(before, newer)``, keep the newest checkpoint before learner step
    ``before``, and with ``newer`` also every one at or after it.

    While an ``act`` rule holds, ``before`` is the earliest step at which such a rule's
    signal began (``newer`` False: what came after is the fall). Otherwise a rule that first
    holds at the next step began within its window, at ``step - window + 2`` or later, so
    the newest checkpoint before that and every newer one may be needed (``newer`` True;
    at most the last ``window - 1`` steps' checkpoints)."""
    began = [b for name, b in guard.began.items()
             if guard.streaks.get(name, 0) > 0 and name in guard.act_rules]  # fmt: skip
    if began:
        return min(began), False
    return step - window + 2, True
