"""Did the stabilisers act? One line per run, from its ``steps.jsonl`` records.

Every off-policy mechanism of the learner leaves a per-step share of policy tokens in the
step record: the PPO clip (``clip_ratio``, with the dual clip; CISPO's truncated weights),
the turn-level token bound (``token_bound_ratio``), the rollout correction's truncation (TIS,
``behavior_weight_capped``) and mask (MIS / Geo-RS / IcePop, ``behavior_masked``), M2PO's
mask (``m2po_masked``), and the clipping-triggered scale ``s`` (``clip_bias_scale``). A run
whose every share is 0 and whose ``s`` never left 1 trained with none of them acting: every
variant trained with its plain objective. The driver prints this line at the end of a run and
``stppo show`` prints it for a run directory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mechanism:
    """A token-level stabiliser as the step records log it.

    Attributes:
        field: the step-record field, the share of policy tokens it acted on (ratio 0..1).
        label: what it did to a token, in the run-end line and the leaderboard columns.
        short: its name in a few words (the arena summary's "acted on" column).
    """

    field: str
    label: str
    short: str


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism("clip_ratio", "clipped", "clipped"),
    Mechanism("token_bound_ratio", "token-bounded", "token bound"),
    Mechanism("behavior_weight_capped", "truncated (TIS)", "TIS"),
    Mechanism("behavior_masked", "masked (MIS)", "MIS"),
    Mechanism("m2po_masked", "masked (M2PO)", "M2PO"),
)
"""Every token-level mechanism, in the order the run-end line and the leaderboards list them."""


@dataclass(frozen=True)
class StabiliserActivity:
    """What the stabilisers did over a run's steps.

    Attributes:
        steps: steps read.
        shares: per mechanism field (:data:`MECHANISMS`), the mean over steps of the share
            of policy tokens it acted on (ratio 0..1); NaN where no step logged it.
        steps_acting: per mechanism field, the steps in which it acted on some token.
        scale_min, scale_max: range of the clipping-bias scale ``s`` over the steps (1.0
            when no step logged it).
        scale_steps: steps that logged ``s``.
        scale_steps_below_one: steps in which ``s < 1``.
    """

    steps: int
    shares: dict[str, float]
    steps_acting: dict[str, int]
    scale_min: float
    scale_max: float
    scale_steps: int
    scale_steps_below_one: int

    @property
    def any_acted(self) -> bool:
        """Some mechanism acted on some token, or ``s`` left 1, in some step."""
        return any(self.steps_acting.values()) or self.scale_steps_below_one > 0


def _finite(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    out = []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def stabiliser_activity(steps: Sequence[Mapping[str, Any]]) -> StabiliserActivity:
    """:class:`StabiliserActivity` of a run's step records (``steps.jsonl`` lines)."""
    shares, acting = {}, {}
    for m in MECHANISMS:
        values = _finite(steps, m.field)
        shares[m.field] = sum(values) / len(values) if values else math.nan
        acting[m.field] = sum(v > 0 for v in values)
    scales = _finite(steps, "clip_bias_scale")
    return StabiliserActivity(
        steps=len(steps),
        shares=shares,
        steps_acting=acting,
        scale_min=min(scales, default=1.0),
        scale_max=max(scales, default=1.0),
        scale_steps=len(scales),
        scale_steps_below_one=sum(s < 1.0 for s in scales),
    )


def activity_line(activity: StabiliserActivity) -> str:
    """One line: each mechanism's mean share of policy tokens (and in how many steps it
    acted), then the range of ``s``. Mechanisms no step logged are left out.

    Example: ``stabilisers over 10 steps: clipped 0.12% of tokens (7 steps), truncated
    (TIS) 0.00% (0 steps), masked (MIS) 0.00% (0 steps); scale s 1.000-1.000 (< 1 in 0
    steps)``.
    """
    parts = []
    for m in MECHANISMS:
        share = activity.shares[m.field]
        if math.isnan(share):
            continue
        unit = " of tokens" if not parts else ""
        parts.append(f"{m.label} {100 * share:.2f}%{unit} ({activity.steps_acting[m.field]} steps)")
    verdict = "" if activity.any_acted else " -- none acted"
    return (
        f"stabilisers over {activity.steps} steps: {', '.join(parts) or 'none logged'}; "
        f"scale s {activity.scale_min:.3f}-{activity.scale_max:.3f} "
        f"(< 1 in {activity.scale_steps_below_one} steps){verdict}"
    )
