"""The stability guard's decisions: each learner step it reads the step record, smooths the
signals that show a fall as it happens, and decides ``ok``, ``warn`` or ``act``.

The signals are numbers the step record (``steps.jsonl``) has already: the training
rollouts' malformed share (``malformed_rate``), the mean absolute log weight between the
proximal and the behaviour policy (``behavior_log_ratio_abs_mean``, nats per token; the
decoupled objective only), the k1 estimate of KL(behaviour || current) (``approx_kl``,
nats per token), the gradient norm... Each :class:`services.config.GuardRule` names one, a
threshold and a level; a rule holds at a step when the trailing mean of its signal over
``guard.window`` steps is past its threshold. The decision of a step
(:meth:`Guard.observe`):

- ``act``: an ``act`` rule has held for ``guard.patience`` steps in a row, from step
  ``guard.warmup_steps`` on and outside the cooldown of the previous action;
- ``warn``: any rule holds (also an ``act`` rule in its patience or cooldown, past the
  action budget, or with ``guard.mode = "warn"``: the decision names the action it would
  have taken);
- ``ok``: no rule holds (and always with ``guard.mode = "off"``).

An ``act`` decision with ``guard.mode = "act"`` takes the first step of ``guard.ladder``
that still applies (:func:`services.loop.ladder.plan_action`): lower
``buffer.max_staleness`` (again, until ``guard.min_staleness``), switch to the behaviour
objective, lower the learning rate. Its change is requested from the control plane like a
person's (:meth:`services.control.ControlState.request_change`, applied at the next step
boundary), and a step that would change a field a person changed live during the run is
skipped: a person's change is never undone. ``guard.max_actions`` bounds the actions.

With ``guard.rollback`` (and the checkpoints given), the ``act`` decision also names the
checkpoint the driver restores first: the newest before the step at which the rule's signal
began (:meth:`Guard.signal_began`, :func:`services.loop.ladder.plan_rollback`), or none. With
``guard.max_rollbacks`` spent, an action that would roll back is a stop (:data:`STOP`).
:mod:`services.loop.guard_state` carries the guard through checkpoints and rollbacks.

Pure (no Ray, no torch, no I/O): :mod:`services.loop.autopilot` runs it in the driver's
loop and writes what it decides; ``experiments/guard_replay.py`` replays archived runs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from services.config import GuardRule, RunConfig
from services.loop.ladder import Plan, last_good, plan_action, plan_rollback, touches

__all__ = ["LEVELS", "STOP", "Decision", "Guard", "Plan", "last_good", "plan_action",
           "plan_rollback", "rule_holds"]  # fmt: skip

Level = Literal["ok", "warn", "act"]

LEVELS: tuple[str, ...] = ("ok", "warn", "act")
"""Decision levels, in order (the ``stppo_guard_level`` gauge is the index)."""

STOP = "stop"
"""The action of an ``act`` decision that would roll back with ``guard.max_rollbacks``
spent: the run ends (``stppo train`` exits with
:data:`services.run_records.EXIT_GUARD_STOPPED`)."""

WINDOW_KEPT = 1000
"""Values kept per signal (the largest ``guard.window``)."""


@dataclass
class Decision:
    """One step's decision (written to ``guard.jsonl`` when not ``ok``).

    Attributes:
        step: the learner step whose record was read.
        level: ``ok``, ``warn`` or ``act`` (``act`` only when an action was requested).
        mode: ``guard.mode`` at the step.
        rule: the rule that decided (the first ``act`` rule past its patience, else the first
            rule that holds); None when ``ok``.
        signals: each rule signal's trailing mean (NaN where not logged).
        holding: the names of every rule that holds.
        action: the ladder step taken, or that would have been taken (``would_act``).
        would_act: an ``act`` rule is past its patience but no action was taken.
        reason: why not (``mode warn``, ``cooldown``, ``warmup``, ``budget spent``,
            ``ladder spent``) or what a refused step said.
        before, after: the dotted config fields the action changed, before and after.
        rollback: None where none was considered (no ``act`` in mode ``act`` with
            ``guard.rollback`` and checkpoints); else ``from_step``, ``signal_began``,
            ``to_step`` and ``checkpoint`` (None when there is none before the signal, or the
            budget is spent) and ``reason`` (why none; ``""`` when it rolls back).
    """

    step: int
    level: Level
    mode: str
    rule: str | None = None
    signals: dict[str, float] = field(default_factory=dict)
    holding: list[str] = field(default_factory=list)
    action: str | None = None
    would_act: bool = False
    reason: str = ""
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    rollback: dict[str, Any] | None = None

    @property
    def rollback_to(self) -> int | None:
        """The learner step of the checkpoint this decision rolls back to (None: none)."""
        if self.level != "act" or self.action == STOP or self.rollback is None:
            return None
        return self.rollback.get("to_step")

    @property
    def stops(self) -> bool:
        """The run ends here (the rollback budget is spent)."""
        return self.level == "act" and self.action == STOP

    def record(self) -> dict[str, Any]:
        """The ``guard.jsonl`` line (NaN signals as None)."""
        signals = {k: (None if math.isnan(v) else round(v, 6)) for k, v in self.signals.items()}
        return {
            "step": self.step, "level": self.level, "mode": self.mode, "rule": self.rule,
            "holding": self.holding, "signals": signals, "action": self.action,
            "would_act": self.would_act, "reason": self.reason,
            "before": self.before, "after": self.after, "rollback": self.rollback,
        }  # fmt: skip


def rule_holds(rule: GuardRule, value: float) -> bool:
    """Whether ``value`` (the rule's smoothed signal) is past its threshold (False for NaN)."""
    if math.isnan(value):
        return False
    if rule.above is not None:
        return value > rule.above
    return value < rule.below  # type: ignore[operator]


class Guard:
    """The per-run guard state: each signal's recent values (with their learner steps), each
    rule's streak and the step its signal began, the actions and rollbacks taken, the
    cooldown (module docstring). One per run, kept through checkpoints and resumes
    (:mod:`services.loop.guard_state`).

    :meth:`observe` reads the ``guard`` section of the config it is given each step, so a
    live change of the rules or the mode applies at once. The cooldown counts observed steps
    (learner steps), not step numbers, which go back after a rollback.
    """

    def __init__(self) -> None:
        self.values: dict[str, deque[tuple[int, float]]] = {}
        self.streaks: dict[str, int] = {}
        self.began: dict[str, int] = {}
        self.actions: list[Decision] = []
        self.rollbacks: list[dict[str, Any]] = []
        self.steps_seen = 0
        self.act_rules: set[str] = set()  # the act rules' names at the last observe
        self.last_action_seen: int | None = None
        self.last_action_step: int | None = None
        self.decisions: dict[str, int] = {level: 0 for level in LEVELS}

    def smoothed(self, signal: str, window: int) -> float:
        """Mean of the finite values of ``signal`` over the last ``window`` steps (NaN if it
        has none there: a signal that stopped being logged, e.g. the behaviour log-ratio
        after a switch to the behaviour objective, stops holding once its window passes)."""
        recent = list(self.values.get(signal, ()))[-window:]
        values = [v for _, v in recent if math.isfinite(v)]
        return sum(values) / len(values) if values else math.nan

    def signal_began(self, rule: GuardRule, window: int, step: int) -> int:
        """The learner step at which ``rule``'s signal began, seen from ``step``, the first
        step of its streak: the earliest step of the trailing window whose own value is past
        the threshold (one is, when the window's mean is; ``step`` if none)."""
        recent = list(self.values.get(rule.signal, ()))[-window:]
        return next((s for s, v in recent if rule_holds(rule, v)), step)

    def _update(self, step: int, record: Mapping[str, Any], rules: list[GuardRule]) -> None:
        """One entry per step for every rule signal: its value, NaN where not logged."""
        for signal in {r.signal for r in rules}:
            value = record.get(signal)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            self.values.setdefault(signal, deque(maxlen=WINDOW_KEPT)).append(
                (step, float(value) if number else math.nan)
            )

    def observe(
        self,
        record: Mapping[str, Any],
        cfg: RunConfig,
        person_fields: Collection[str] = (),
        request: Callable[[dict[str, Any]], Any] | None = None,
        checkpoints: Callable[[], Collection[int]] | None = None,
    ) -> Decision:
        """Read one step record and decide (module docstring).

        Args:
            record: the step's ``steps.jsonl`` record (``step`` and the signals).
            cfg: the live run config (its ``guard`` section and the fields an action reads).
            person_fields: dotted fields a person changed live during the run (never touched).
            request: sends an action's nested change to the control plane
                (:meth:`services.control.ControlState.request_change`); a step it refuses
                (``ValueError``, e.g. :class:`services.config.ConfigError`) is skipped for
                the next one. None: decide only (the offline replay), as if every step of
                the ladder had been accepted.
            checkpoints: returns the learner steps of the complete checkpoints a rollback
                may go to (called only when an action is about to be taken). None: no
                rollback is considered (the offline replay).

        Returns:
            The :class:`Decision`; ``act`` only when an action was requested (or, with
            ``request`` None, would have been), or when the run stops (:data:`STOP`).
        """
        g = cfg.guard
        step = int(record.get("step", 0))
        self.steps_seen += 1
        self.act_rules = {r.name for r in g.rules if r.level == "act"}
        self._update(step, record, g.rules)
        signals = {r.signal: self.smoothed(r.signal, g.window) for r in g.rules}
        holding = [r for r in g.rules if rule_holds(r, signals[r.signal])]
        for r in g.rules:
            self.streaks[r.name] = self.streaks.get(r.name, 0) + 1 if r in holding else 0
            if self.streaks[r.name] == 1:
                self.began[r.name] = self.signal_began(r, g.window, step)
            elif self.streaks[r.name] == 0:
                self.began.pop(r.name, None)
        if g.mode == "off" or step < g.warmup_steps or not holding:
            decision = Decision(step, "ok", g.mode, signals=signals)
            self.decisions["ok"] += 1
            return decision
        ready = [r for r in holding if r.level == "act" and self.streaks[r.name] >= g.patience]
        decision = Decision(
            step, "warn", g.mode, rule=(ready or holding)[0].name, signals=signals,
            holding=[r.name for r in holding],
        )  # fmt: skip
        if ready:
            self._act(decision, ready[0], cfg, person_fields, request, checkpoints)
        self.decisions[decision.level] += 1
        return decision

    def _act(
        self,
        decision: Decision,
        rule: GuardRule,
        cfg: RunConfig,
        person_fields: Collection[str],
        request: Callable[[dict[str, Any]], Any] | None,
        checkpoints: Callable[[], Collection[int]] | None,
    ) -> None:
        """Take (or name) the next ladder step for a decision whose act rule is ready, with
        its rollback (or the stop, once the rollback budget is spent)."""
        g = cfg.guard
        decision.would_act = True
        if self.last_action_seen is not None and (
            self.steps_seen - self.last_action_seen < g.cooldown_steps
        ):
            decision.reason = "cooldown"
            return
        if len(self.actions) >= g.max_actions:
            decision.reason = "budget spent"
            return
        refused = []
        rollback: dict[str, Any] | None = None
        for action in g.ladder:
            plan = plan_action(action, cfg, g)
            if plan is None or touches(plan, person_fields):
                continue
            if g.mode != "act":
                decision.action, decision.before, decision.after = action, plan.before, plan.after
                decision.reason = f"mode {g.mode}"
                return
            if rollback is None and g.rollback and checkpoints is not None:
                began = self.began.get(rule.name, decision.step)
                rollback = plan_rollback(decision.step, began, checkpoints())
                if rollback["to_step"] is not None and len(self.rollbacks) >= g.max_rollbacks:
                    spent = f"rollback budget spent ({len(self.rollbacks)} of {g.max_rollbacks})"
                    rollback.update(to_step=None, checkpoint=None, reason=spent)
                    decision.level, decision.would_act, decision.action = "act", False, STOP
                    decision.reason, decision.rollback = spent, rollback
                    return
            if request is not None:
                try:
                    request(plan.changes)
                except ValueError as e:
                    refused.append(f"{action}: {e}")
                    continue
            decision.level, decision.would_act, decision.action = "act", False, action
            decision.before, decision.after = plan.before, plan.after
            decision.reason = "; ".join(refused)
            decision.rollback = rollback
            self.actions.append(decision)
            if rollback is not None and rollback["to_step"] is not None:
                self.rollbacks.append(dict(rollback))
            self.last_action_step = decision.step
            self.last_action_seen = self.steps_seen
            return
        decision.reason = "; ".join(["ladder spent", *refused])
