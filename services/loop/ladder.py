"""What the stability guard's actions do: each step of its ladder (:data:`ACTIONS`) as a
change of the live config (:func:`plan_action`), requested from the control plane by
:meth:`services.loop.guard.Guard.observe`, and the checkpoint a rollback goes back to
(:func:`plan_rollback`). Pure (no Ray, no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from services.config import GuardConfig, RunConfig
from services.loop.checkpoint import checkpoint_name

ACTIONS: tuple[str, ...] = ("lower_staleness", "behavior_objective", "lower_lr")
"""The ladder's steps (:func:`plan_action`)."""


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


def touches(plan: Plan, person_fields: Collection[str]) -> bool:
    """Whether ``plan`` changes a field a person changed (or one inside / above it)."""
    return any(
        f == p or f.startswith(f"{p}.") or p.startswith(f"{f}.")
        for f in plan.after for p in person_fields
    )  # fmt: skip


def last_good(checkpoint_steps: Iterable[int], began: int) -> int | None:
    """The checkpoint a rollback goes to: the newest of ``checkpoint_steps`` (learner steps
    of complete checkpoints) before ``began`` (the learner step at which the signal began);
    None when every checkpoint is at or after it."""
    before = [s for s in checkpoint_steps if s < began]
    return max(before) if before else None


def plan_rollback(step: int, began: int, checkpoint_steps: Iterable[int]) -> dict[str, Any]:
    """The ``rollback`` of an act decision at ``step`` whose signal began at ``began``: to
    the :func:`last_good` of ``checkpoint_steps``, or none with the reason."""
    to = last_good(checkpoint_steps, began)
    return {
        "from_step": step, "signal_began": began, "to_step": to,
        "checkpoint": None if to is None else checkpoint_name(to),
        "reason": "" if to is not None else f"no checkpoint before step {began}",
    }  # fmt: skip
