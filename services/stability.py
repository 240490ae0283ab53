"""Per-cell statistics and figure of a multi-seed grid (``stppo experiment stability``).

A cell is one (``algorithm.variant``, ``buffer.max_staleness``) point of the grid; its runs
are the seeds. For each cell (:class:`CellSummary`) over its runs:

- final success: the training success (``success_rate`` of ``steps.jsonl``, 8 trajectories
  per step in the default grid) averaged over each run's last ``final_window`` steps, then
  mean, standard deviation (``ddof = 1``) and 95% t-interval half-width over seeds; the
  validation success at the end (``eval.jsonl``, tag ``end``) likewise;
- collapsed: runs for which :func:`services.experiment.run_collapsed` fires (the spec's
  rule: smoothed success at least ``drop`` below its best on each of the last ``last_k``
  steps, or smoothed malformed share at least ``malformed``), as ``k/n``;
- clip ratio and approx KL (nats/token): mean over steps, then over runs;
- largest token ``|log ratio|`` (``token_log_ratio_abs_max``, nats): max over steps,
  mean over runs;
- clip-bias scale ``s`` (``clip_bias_scale``; 1 for variants without it): mean over steps
  and runs, and its minimum anywhere;
- realised staleness (``consumed.jsonl``): the share of consumed trajectories whose
  staleness is exactly ``min(step - 1, max_staleness)``, which ``sync.fixed_lag`` promises
  (1.0 expected).

Welch's t-test of each cell's final success against ``ppo`` at the same staleness gives a
p-value (two-sided; NaN with fewer than 2 runs on either side). With 3 seeds this only
separates large effects; the table says so.

The figure (:func:`plot_cells`): one panel per staleness, one line per variant: the mean
over seeds of the smoothed training success per step, with a band of +- one standard
deviation over seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.experiment import CollapseRule, read_jsonl, run_collapsed


@dataclass
class CellSummary:
    """One row of the per-cell table (fields as in the module docstring; NaN = missing)."""

    variant: str
    max_staleness: int
    runs: int
    steps_mean: float
    final_success_mean: float
    final_success_sd: float
    final_success_ci95: float
    val_success_mean: float
    val_success_sd: float
    collapsed: int
    judged: int
    clip_ratio: float
    approx_kl: float
    token_log_ratio_max: float
    clip_bias_scale_mean: float
    clip_bias_scale_min: float
    exact_staleness_share: float
    p_vs_ppo: float


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if isinstance(v, int | float) and not math.isnan(v)]


def _mean(values: list[float]) -> float:
    v = _finite(values)
    return sum(v) / len(v) if v else math.nan


def _sd(values: list[float]) -> float:
    v = _finite(values)
    if len(v) < 2:
        return math.nan
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def _ci95(values: list[float]) -> float:
    """Half-width of the 95% t-interval of the mean (NaN below 2 values)."""
    from scipy import stats

    v = _finite(values)
    if len(v) < 2:
        return math.nan
    return float(stats.t.ppf(0.975, len(v) - 1)) * _sd(v) / math.sqrt(len(v))


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided Welch t-test p-value of ``mean(a) != mean(b)`` (NaN with < 2 values on a
    side; 1.0 when both sides are constant and equal)."""
    from scipy import stats

    a, b = _finite(a), _finite(b)
    if len(a) < 2 or len(b) < 2:
        return math.nan
    if _sd(a) == 0 and _sd(b) == 0:
        return 1.0 if _mean(a) == _mean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), int | float) else math.nan for r in records]


@dataclass
class RunStats:
    """What one run contributes to its cell."""

    variant: str
    max_staleness: int
    steps: int
    final_success: float
    val_success: float
    collapsed: bool | None
    clip_ratio: float
    approx_kl: float
    token_log_ratio_max: float
    clip_bias_scale_mean: float
    clip_bias_scale_min: float
    exact_staleness: int
    consumed: int
    success_curve: list[float]
    malformed_curve: list[float]


def run_stats(run_dir: Path, rule: CollapseRule, final_window: int = 10) -> RunStats:
    """Read one run directory (``config.json``, ``steps.jsonl``, ``eval.jsonl``,
    ``consumed.jsonl``).

    Raises:
        FileNotFoundError: no ``config.json``.
    """
    cfg = json.loads((run_dir / "config.json").read_text())
    steps = read_jsonl(run_dir / "steps.jsonl", "step")
    end = [e for e in read_jsonl(run_dir / "eval.jsonl") if e.get("tag") == "end"]
    success = _series(steps, "success_rate")
    scale = _finite(_series(steps, "clip_bias_scale"))
    lag = int(cfg["buffer"]["max_staleness"])
    exact = consumed = 0
    for rec in read_jsonl(run_dir / "consumed.jsonl", "step"):
        want = min(int(rec["step"]) - 1, lag)
        for s in rec.get("staleness", []):
            consumed += 1
            exact += int(s == want)
    return RunStats(
        variant=str(cfg["algorithm"]["variant"]),
        max_staleness=lag,
        steps=len(steps),
        final_success=_mean(success[-final_window:]),
        val_success=float(end[-1]["success_rate"]) if end else math.nan,
        collapsed=run_collapsed(steps, rule),
        clip_ratio=_mean(_series(steps, "clip_ratio")),
        approx_kl=_mean(_series(steps, "approx_kl")),
        token_log_ratio_max=max(
            _finite(_series(steps, "token_log_ratio_abs_max")), default=math.nan
        ),
        clip_bias_scale_mean=_mean(scale) if scale else 1.0,
        clip_bias_scale_min=min(scale) if scale else 1.0,
        exact_staleness=exact,
        consumed=consumed,
        success_curve=success,
        malformed_curve=_series(steps, "malformed_rate"),
    )


def cell_summaries(runs: list[RunStats]) -> list[CellSummary]:
    """Group runs by (variant, max_staleness) in first-seen order and summarise each."""
    cells: dict[tuple[str, int], list[RunStats]] = {}
    for r in runs:
        cells.setdefault((r.variant, r.max_staleness), []).append(r)
    out = []
    for (variant, lag), rs in cells.items():
        finals = [r.final_success for r in rs]
        ppo = cells.get(("ppo", lag), [])
        judged = [r.collapsed for r in rs if r.collapsed is not None]
        consumed = sum(r.consumed for r in rs)
        out.append(
            CellSummary(
                variant=variant,
                max_staleness=lag,
                runs=len(rs),
                steps_mean=_mean([float(r.steps) for r in rs]),
                final_success_mean=_mean(finals),
                final_success_sd=_sd(finals),
                final_success_ci95=_ci95(finals),
                val_success_mean=_mean([r.val_success for r in rs]),
                val_success_sd=_sd([r.val_success for r in rs]),
                collapsed=sum(bool(c) for c in judged),
                judged=len(judged),
                clip_ratio=_mean([r.clip_ratio for r in rs]),
                approx_kl=_mean([r.approx_kl for r in rs]),
                token_log_ratio_max=_mean([r.token_log_ratio_max for r in rs]),
                clip_bias_scale_mean=_mean([r.clip_bias_scale_mean for r in rs]),
                clip_bias_scale_min=min(r.clip_bias_scale_min for r in rs),
                exact_staleness_share=sum(r.exact_staleness for r in rs) / consumed
                if consumed
                else math.nan,
                p_vs_ppo=welch_p(finals, [r.final_success for r in ppo])
                if variant != "ppo"
                else math.nan,
            )
        )
    return out


def _f(v: float, digits: int = 3) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def cells_markdown(cells: list[CellSummary], rule: CollapseRule, final_window: int) -> str:
    """The per-cell table as markdown, with how to read it underneath."""
    head = (
        "| variant | staleness | runs | steps | final success (mean ± sd) | 95% CI ± | "
        "p vs ppo | val success (end) | collapsed | clip ratio | max token \\|log ratio\\| | "
        "approx KL | scale s (mean / min) | exact lag |"
    )
    lines = [head, "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    for c in sorted(cells, key=lambda c: (c.max_staleness, c.variant)):
        lines.append(
            f"| {c.variant} | {c.max_staleness} | {c.runs} | {c.steps_mean:.0f} | "
            f"{_f(c.final_success_mean)} ± {_f(c.final_success_sd)} | {_f(c.final_success_ci95)} | "
            f"{_f(c.p_vs_ppo, 2)} | {_f(c.val_success_mean)} ± {_f(c.val_success_sd)} | "
            f"{c.collapsed}/{c.judged} | {_f(c.clip_ratio)} | {_f(c.token_log_ratio_max, 2)} | "
            f"{_f(c.approx_kl, 4)} | {_f(c.clip_bias_scale_mean)} / {_f(c.clip_bias_scale_min)} | "
            f"{_f(c.exact_staleness_share, 2)} |"
        )
    lines += [
        "",
        f"Final success: training success over each run's last {final_window} steps, mean ± sd "
        "over seeds; p: Welch's t-test against ppo at the same staleness. Collapsed: "
        f"smoothed ({rule.window} steps) success at least {rule.drop} below its best on each "
        f"of the last {rule.last_k} steps, or smoothed malformed share >= {rule.malformed}. "
        "Max token |log ratio|: largest over steps (nats), mean over seeds. Exact lag: share "
        "of consumed trajectories at staleness min(step - 1, max_staleness).",
    ]
    return "\n".join(lines) + "\n"


ROWS: tuple[tuple[str, str], ...] = (
    ("success_curve", "training success"),
    ("malformed_curve", "malformed answers (share)"),
)
"""(RunStats curve, axis title): the figure's rows."""


def plot_cells(runs: list[RunStats], path: Path, window: int = 10) -> Path:
    """Success (top row) and malformed-answer share (bottom row) per learner step, smoothed
    over ``window`` steps: mean and ±1 sd band over seeds per variant, one column per
    staleness (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({r.max_staleness for r in runs})
    variants = list(dict.fromkeys(r.variant for r in runs))
    fig, axes = plt.subplots(
        len(ROWS), len(lags), figsize=(5 * len(lags), 3.6 * len(ROWS)), sharey="row", squeeze=False
    )
    for (row, title), ax_row in zip(ROWS, axes, strict=True):
        for ax, lag in zip(ax_row, lags, strict=True):
            _plot_panel(ax, runs, row, lag, variants, window)
            ax.set_title(f"staleness {lag}")
        ax_row[0].set_ylabel(f"{title} ({window}-step mean)")
    for ax in axes[-1]:
        ax.set_xlabel("learner step")
    axes[0][-1].legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_panel(ax, runs: list[RunStats], row: str, lag: int, variants: list[str], window: int):
    """One panel: ``row`` curves of the runs at staleness ``lag``, mean and ±1 sd per variant."""
    import numpy as np

    from services.plots import smooth

    for i, variant in enumerate(variants):
        curves = [smooth(getattr(r, row), window) for r in runs
                  if r.variant == variant and r.max_staleness == lag and getattr(r, row)]  # fmt: skip
        if not curves:
            continue
        n = min(len(c) for c in curves)
        arr = np.array([c[:n] for c in curves], dtype=float)
        mean = np.nanmean(arr, axis=0)
        sd = np.nanstd(arr, axis=0, ddof=1) if len(curves) > 1 else np.zeros(n)
        x = np.arange(1, n + 1)
        color = f"C{i}"
        # earlier variants drawn wider, so identical curves (st_ppo = turn_ppo while s = 1)
        # still show both; shares stay in [0, 1], so the band is cut there
        width = max(2.6 - 0.5 * i, 1.0)
        ax.plot(x, mean, color=color, linewidth=width, label=f"{variant} (n={len(curves)})")
        low, high = np.clip(mean - sd, 0.0, 1.0), np.clip(mean + sd, 0.0, 1.0)
        ax.fill_between(x, low, high, color=color, alpha=0.2)
    ax.grid(alpha=0.3)


def write_cells(
    run_dirs: list[Path], rule: CollapseRule, out_dir: Path, final_window: int = 10
) -> tuple[Path, Path, Path | None]:
    """``cells.json``, ``cells.md`` and ``cells.png`` under ``out_dir`` from the runs that
    have a ``config.json``; returns their paths (figure None when no run has a step)."""
    runs = [run_stats(d, rule, final_window) for d in run_dirs if (d / "config.json").exists()]
    cells = cell_summaries(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    safe = [{k: (None if isinstance(v, float) and math.isnan(v) else v)
             for k, v in asdict(c).items()} for c in cells]  # fmt: skip
    json_path = out_dir / "cells.json"
    json_path.write_text(json.dumps({"final_window": final_window, "cells": safe}, indent=2) + "\n")
    md_path = out_dir / "cells.md"
    md_path.write_text(cells_markdown(cells, rule, final_window))
    with_steps = [r for r in runs if r.success_curve]
    figure = plot_cells(with_steps, out_dir / "cells.png") if with_steps else None
    return json_path, md_path, figure
