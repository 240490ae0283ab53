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
that still applies (:func:`plan_action`): lower ``buffer.max_staleness`` (again, until
``guard.min_staleness``), switch to the behaviour objective, lower the learning rate. Its
change is requested from the control plane like a person's
(:meth:`services.control.ControlState.request_change`, applied at the next step boundary),
and a step that would change a field a person changed live during the run is skipped: a
person's change is never undone. ``guard.max_actions`` bounds the actions of a run.

Not built: rolling back to the last good checkpoint (the ladder only tightens).

Pure (no Ray, no torch, no I/O): :mod:`services.loop.autopilot` runs it in the driver's
loop and writes what it decides; ``experiments/guard_replay.py`` replays archived runs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from services.config import GuardConfig, GuardRule, RunConfig

Level = Literal["ok", "warn", "act"]

LEVELS: tuple[str, ...] = ("ok", "warn", "act")
"""Decision levels, in order (the ``stppo_guard_level`` gauge is the index)."""

ACTIONS: tuple[str, ...] = ("lower_staleness", "behavior_objective", "lower_lr")
"""The ladder's steps (:func:`plan_action`)."""


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

    def record(self) -> dict[str, Any]:
        """The ``guard.jsonl`` line (NaN signals as None)."""
        signals = {k: (None if math.isnan(v) else round(v, 6)) for k, v in self.signals.items()}
        return {
            "step": self.step, "level": self.level, "mode": self.mode, "rule": self.rule,
            "holding": self.holding, "signals": signals, "action": self.action,
            "would_act": self.would_act, "reason": self.reason,
            "before": self.before, "after": self.after,
        }  # fmt: skip


@dataclass
class Plan:
    """An action's config change: the nested partial change for the control plane and the
    dotted fields it changes, before and after."""

    changes: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]


def plan_action(action: str, cfg: RunConfig, guard: GuardConfig) -> Plan | None:
    """The config change of one ladder step on ``cfg``; None where it does not apply.

    - ``lower_staleness``: ``buffer.max_staleness`` to ``max(min_staleness,
      floor(s * staleness_factor))`` (None if that is not lower), with ``sync.every_k_steps``
      lowered to the new bound + 1 where it exceeds it;
    - ``behavior_objective``: ``algorithm.off_policy`` to ``behavior`` (the rollout
      correction, M2PO and the log-linear proximal, which need ``decoupled``, unset; None
      if already ``behavior``);
    - ``lower_lr``: ``learner.actor_lr`` times ``lr_factor``.

    Raises:
        ValueError: an unknown action.
    """
    if action == "lower_staleness":
        old = cfg.buffer.max_staleness
        new = max(guard.min_staleness, math.floor(old * guard.staleness_factor))
        if new >= old:
            return None
        changes: dict[str, Any] = {"buffer": {"max_staleness": new}}
        before, after = {"buffer.max_staleness": old}, {"buffer.max_staleness": new}
        if cfg.sync.every_k_steps > new + 1:
            changes["sync"] = {"every_k_steps": new + 1}
            before["sync.every_k_steps"] = cfg.sync.every_k_steps
            after["sync.every_k_steps"] = new + 1
        return Plan(changes, before, after)
    if action == "behavior_objective":
        algo = cfg.algorithm
        if algo.off_policy == "behavior":
            return None
        changes = {"algorithm": {"off_policy": "behavior", "rollout_correction": None,
                                 "m2po_threshold": None, "proximal": "recompute"}}  # fmt: skip
        before = {"algorithm.off_policy": algo.off_policy}
        if algo.rollout_correction is not None:
            before["algorithm.rollout_correction"] = algo.rollout_correction.model_dump()
        if algo.m2po_threshold is not None:
            before["algorithm.m2po_threshold"] = algo.m2po_threshold
        if algo.proximal != "recompute":
            before["algorithm.proximal"] = algo.proximal
        after = {k: ("behavior" if k == "algorithm.off_policy" else
                     "recompute" if k == "algorithm.proximal" else None) for k in before}  # fmt: skip
        return Plan(changes, before, after)
    if action == "lower_lr":
        old_lr = cfg.learner.actor_lr
        new_lr = old_lr * guard.lr_factor
        return Plan({"learner": {"actor_lr": new_lr}}, {"learner.actor_lr": old_lr},
                    {"learner.actor_lr": new_lr})  # fmt: skip
    raise ValueError(f"unknown guard action {action!r} (known: {', '.join(ACTIONS)})")


def rule_holds(rule: GuardRule, value: float) -> bool:
    """Whether ``value`` (the rule's smoothed signal) is past its threshold (False for NaN)."""
    if math.isnan(value):
        return False
    if rule.above is not None:
        return value > rule.above
    return value < rule.below  # type: ignore[operator]


def _touches(plan: Plan, person_fields: Collection[str]) -> bool:
    """Whether ``plan`` changes a field a person changed (or one inside / above it)."""
    return any(
        f == p or f.startswith(f"{p}.") or p.startswith(f"{f}.")
        for f in plan.after for p in person_fields
    )  # fmt: skip


class Guard:
    """The per-run guard state: each signal's recent values, each rule's streak, the actions
    taken (module docstring). One instance per run; not saved in checkpoints (a resumed run
    starts with empty windows and its full action budget).

    :meth:`observe` reads the ``guard`` section of the config it is given each step, so a
    live change of the rules or the mode applies at once.
    """

    def __init__(self) -> None:
        self.values: dict[str, deque[float]] = {}
        self.streaks: dict[str, int] = {}
        self.actions: list[Decision] = []
        self.last_action_step: int | None = None
        self.decisions: dict[str, int] = {level: 0 for level in LEVELS}

    def smoothed(self, signal: str, window: int) -> float:
        """Mean of the finite values of ``signal`` over the last ``window`` steps (NaN if it
        has none there: a signal that stopped being logged, e.g. the behaviour log-ratio
        after a switch to the behaviour objective, stops holding once its window passes)."""
        values = [v for v in list(self.values.get(signal, ()))[-window:] if math.isfinite(v)]
        return sum(values) / len(values) if values else math.nan

    def _update(self, record: Mapping[str, Any], rules: list[GuardRule]) -> None:
        """One entry per step for every rule signal: its value, NaN where not logged."""
        for signal in {r.signal for r in rules}:
            value = record.get(signal)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            self.values.setdefault(signal, deque(maxlen=1000)).append(
                float(value) if number else math.nan
            )

    def observe(
        self,
        record: Mapping[str, Any],
        cfg: RunConfig,
        person_fields: Collection[str] = (),
        request: Callable[[dict[str, Any]], Any] | None = None,
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

        Returns:
            The :class:`Decision`; ``act`` only when an action was requested (or, with
            ``request`` None, would have been).
        """
        g = cfg.guard
        step = int(record.get("step", 0))
        self._update(record, g.rules)
        signals = {r.signal: self.smoothed(r.signal, g.window) for r in g.rules}
        holding = [r for r in g.rules if rule_holds(r, signals[r.signal])]
        for r in g.rules:
            self.streaks[r.name] = self.streaks.get(r.name, 0) + 1 if r in holding else 0
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
            self._act(decision, cfg, person_fields, request)
        self.decisions[decision.level] += 1
        return decision

    def _act(
        self,
        decision: Decision,
        cfg: RunConfig,
        person_fields: Collection[str],
        request: Callable[[dict[str, Any]], Any] | None,
    ) -> None:
        """Take (or name) the next ladder step for a decision whose act rule is ready."""
        g = cfg.guard
        decision.would_act = True
        if self.last_action_step is not None and (
            decision.step - self.last_action_step < g.cooldown_steps
        ):
            decision.reason = "cooldown"
            return
        if len(self.actions) >= g.max_actions:
            decision.reason = "budget spent"
            return
        refused = []
        for action in g.ladder:
            plan = plan_action(action, cfg, g)
            if plan is None or _touches(plan, person_fields):
                continue
            if g.mode != "act":
                decision.action, decision.before, decision.after = action, plan.before, plan.after
                decision.reason = f"mode {g.mode}"
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
            self.actions.append(decision)
            self.last_action_step = decision.step
            return
        decision.reason = "; ".join(["ladder spent", *refused])
