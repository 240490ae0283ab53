"""When a training run counts as collapsed: the rule and its detection.

Collapse rule (:class:`CollapseRule`, defaults in brackets): on the per-step training
success rate (``success_rate`` in ``steps.jsonl``), smoothed by a trailing moving average
of ``window`` [3] steps, a run has collapsed when each of its last ``last_k`` [3] steps is
more than ``drop`` [0.2] (absolute success) below the best smoothed value reached before
those steps. A run with fewer than ``last_k + 1`` steps cannot be judged (``None``, shown
as ``n/a``). The same rule is applied to ``reward_mean``; either one triggering counts. A
format collapse counts too: the smoothed share of malformed answers among the consumed
trajectories (``malformed_rate``) at or above ``malformed`` [0.5] on each of the last
``last_k`` steps.
The paper's collapse is a sharp, lasting fall of success after a good phase; this rule asks
for exactly that and ignores a single bad batch.

Used by the experiment summaries (:mod:`experiments.grid`) and the per-cell statistics
(:mod:`experiments.stability`), which both import it; neither imports the other's module
for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from learner.config import StrictModel


class CollapseRule(StrictModel):
    """When a run counts as collapsed (see the module docstring)."""

    drop: float = Field(0.2, gt=0.0, le=1.0)
    """Fall below the best smoothed value, in absolute success (0..1), that counts."""

    last_k: int = Field(3, ge=1)
    """Steps at the end of the run that must all be below ``best - drop``."""

    window: int = Field(3, ge=1)
    """Trailing moving-average window (steps) applied before the rule."""

    metrics: list[str] = Field(default_factory=lambda: ["success_rate", "reward_mean"])
    """``steps.jsonl`` series the rule is applied to; any one triggering is a collapse."""

    malformed: float | None = Field(0.5, gt=0.0, le=1.0)
    """Format collapse: smoothed ``malformed_rate`` at or above this on each of the last
    ``last_k`` steps; ``None`` disables the clause."""


@dataclass
class CollapseCheck:
    """Result of :func:`detect_collapse` on one series.

    Attributes:
        collapsed: True / False, or None when the run is too short to judge.
        best: Best smoothed value before the last ``last_k`` steps (NaN if none).
        last_max: Highest smoothed value among the last ``last_k`` steps (NaN if none).
    """

    collapsed: bool | None
    best: float
    last_max: float


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points, skipping NaN (NaN where all are NaN)."""
    from services.plots import smooth

    return smooth(values, window)


def detect_collapse(values: list[float], rule: CollapseRule) -> CollapseCheck:
    """Apply the collapse rule (module docstring) to one per-step series.

    Example (window 1, drop 0.2, last_k 2): ``[0.2, 0.6, 0.3, 0.35]`` -> best before the
    last 2 steps = 0.6, last two 0.3 and 0.35 are both < 0.6 - 0.2 = 0.4: collapsed.

    Returns:
        :class:`CollapseCheck`; ``collapsed`` None when fewer than ``last_k + 1`` finite
        values exist.
    """
    smoothed = [v for v in moving_average(values, rule.window) if not math.isnan(v)]
    if len(smoothed) < rule.last_k + 1:
        return CollapseCheck(None, math.nan, math.nan)
    before, last = smoothed[: -rule.last_k], smoothed[-rule.last_k :]
    best = max(before)
    return CollapseCheck(all(v < best - rule.drop for v in last), best, max(last))


def format_collapsed(malformed_rate: list[float], rule: CollapseRule) -> bool | None:
    """True when the smoothed malformed-answer share is at least ``rule.malformed`` on each
    of the last ``rule.last_k`` steps (None: too short, or no ``malformed_rate`` logged).

    Example (window 1, last_k 2, malformed 0.5): ``[0.1, 0.6, 0.8]`` -> collapsed.
    """
    smoothed = [v for v in moving_average(malformed_rate, rule.window) if not math.isnan(v)]
    if rule.malformed is None or len(smoothed) < rule.last_k:
        return None
    return all(v >= rule.malformed for v in smoothed[-rule.last_k :])


def run_collapsed(steps: list[dict[str, Any]], rule: CollapseRule) -> bool | None:
    """:func:`detect_collapse` on each of ``rule.metrics``: True if any collapsed, None if
    none could be judged, else False."""
    checks = [detect_collapse(_series(steps, m), rule).collapsed for m in rule.metrics]
    if rule.malformed is not None:
        checks.append(format_collapsed(_series(steps, "malformed_rate"), rule))
    if any(c is True for c in checks):
        return True
    if all(c is None for c in checks):
        return None
    return False


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), int | float) else math.nan for r in records]
