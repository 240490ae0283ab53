"""The off-policy arena's leaderboards: one per staleness, methods ranked failures first.

An arena is an experiment grid (:mod:`experiments.grid`) over ``method`` (named bundles
of overrides: a variant, an objective, a correction) and ``buffer.max_staleness``, with an
on-policy reference point; ``deploy/configs/experiments/arena.toml`` is the shipped one. For
every (method, staleness) cell, over its seeds (:class:`LeaderboardRow`):

- final greedy validation success: IQM with a 95% percentile-bootstrap interval (scipy),
  and the mean;
- gain over the start (the same questions before RL), mean with a bootstrap interval;
- collapse rate (:func:`experiments.collapse.run_collapsed`) with a Wilson interval, and the
  share of runs that *ended low*: final success more than :data:`LOW_MARGIN` below the
  median of the on-policy reference's runs, with a Wilson interval. On the synthetic task a
  run that loses the task usually does so late, after the collapse rule's window, and the
  runs that keep it end within a question or two of each other at the task's ceiling: how
  often a method ends low is what separates methods there;
- the share of runs *degrading at the end* (:data:`DEGRADING_MALFORMED`): training rollouts
  malformed in more than 10% over the last :data:`END_STEPS` steps, with a Wilson interval
  (a run can still answer well greedily while its sampled rollouts break);
- probability of improvement over the baseline method at the same staleness (ties half),
  with a stratified-bootstrap interval, and the mean difference to the on-policy reference;
- what each mechanism did: the share of policy tokens clipped (PPO clip and dual clip;
  CISPO's truncated weights), held by the token bound, truncated by TIS, masked by the
  rollout correction (MIS, Geo-RS, IcePop) and by M2PO, mean over steps and seeds; the
  scale ``s`` (minimum, and the share of steps below 1);
- learner step time relative to the baseline's at the same staleness (mean ``step_s`` over
  steps after the first, per run, then the mean over the seeds both cells ran: a seed's
  runs share a sitting and a machine; runs share the machine two at a time, so this ratio
  is indicative to ~10%);
- the log-linear proximal approximation's mean error where the proximal is recomputed.

Ranking (:func:`rank_key`): within each staleness, the cell with fewer runs that *ended
low* first, then the higher mean final success (a user choosing a correction needs the
failures first; the IQM drops each cell's lowest quarter of runs, where its falls are), then
the method's name. The IQM and its interval stay as columns, and bold rows still mark the
intervals that overlap the highest IQM's.

And over every step of every run: ``||C|| / tau`` with the default ``tau`` (0.01), the
quantity the ST-PPO scale acts on (``s < 1`` iff it exceeds 1): its quantiles per method and
staleness, the share of steps with ``||C|| = 0`` (nothing clipped) and above 1
(:class:`BiasNormDistribution`), and its empirical distribution (figure).

Outputs (:func:`write_leaderboards`): ``leaderboard.json``, ``leaderboard.md``,
``leaderboard_summary.md`` (the short tables of the results page),
``leaderboard_intervals.png``, ``leaderboard_curves.png`` (training success per step, mean
and a band of +-1 sd over seeds, clipped to the seeds' range; a row of panels per method
family and a column per staleness, so that a panel holds a few lines),
``leaderboard_curves_malformed.png`` and ``leaderboard_curves_kl.png`` (the malformed share
and the KL to the reference, the same way) and ``leaderboard_bias_norm.png``. Under each leaderboard, its power (:func:`board_power`): the
pooled sd over seeds and the smallest difference between two cells that 5 and 10 seeds per
cell detect.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments import archive as run_archive
from experiments.collapse import CollapseRule, run_collapsed
from experiments.stability import (
    _mean,
    _series,
    iqm,
    iqm_ci,
    mean_ci,
    mean_difference,
    mean_difference_ci,
    poi_ci,
    probability_of_improvement,
    wilson_ci,
)
from services.run_records import read_records
from services.stabilisers import MECHANISMS, stabiliser_activity

LOW_MARGIN = 0.05
"""How far below the on-policy reference's median final success a run ends to count as
*ended low* (0.05: about six questions of 128; the on-policy runs of the arena spread over
three, 0.273-0.297)."""

END_STEPS = 5
"""The last learner steps of a run over which its training rollouts' malformed share is
averaged (:attr:`ArenaRun.malformed_end`)."""

DEGRADING_MALFORMED = 0.1
"""A run whose training rollouts were malformed (no parseable answer) in more than this
share over its last :data:`END_STEPS` steps is *degrading at the end*: at staleness 16 the
runs that fall do so after step 30 of 40, and the greedy final evaluation can still read
well while the sampled rollouts already break."""

DEFAULT_TAU = 0.01
"""The default ``algorithm.tau`` (:data:`learner.losses.DEFAULT_TAU`, mirrored: no torch)."""


@dataclass
class ArenaRun:
    """What one run contributes (values from its ``config.json``, ``steps.jsonl`` and
    ``eval.jsonl``)."""

    method: str
    staleness: int
    seed: int
    val_success: float
    val_start: float
    collapsed: bool | None
    finished: bool
    """The final evaluation ran after every planned learner step (a run the time cap
    stopped early evaluated too, with fewer updates: not finished)."""
    steps: int
    shares: dict[str, float]
    scale_min: float
    scale_below_one: float
    step_s: float
    proximal_error: float
    bias_norm_ratio: list[float]
    success_curve: list[float]
    malformed_curve: list[float]
    kl_curve: list[float]
    wall_s: float = math.nan
    """From the run's ``config.json`` (written at its start) to its last ``eval.jsonl``
    record (the final evaluation), by file modification times."""
    malformed_end: float = math.nan
    """Mean malformed share of the training rollouts over the last :data:`END_STEPS`
    learner steps."""
    family: str = ""
    """The method's family (:func:`method_family`), from its ``config.json``: the panels of
    the curves figure."""


FAMILIES = (
    "ratio against the behaviour policy",
    "decoupled PPO, token weights",
    "decoupled PPO, masks",
    "decoupled, turn and sequence ratios",
)
"""The method families of the curves figure, one row of panels each (:func:`method_family`)."""


def method_family(algorithm: dict[str, Any]) -> str:
    """The family of a run's ``algorithm`` config (a :data:`FAMILIES` entry): the behaviour
    objective; the decoupled objective with token ratios (``ppo``), with a mask (MIS,
    Geo-RS, IcePop) or M2PO, or without; the decoupled objective with turn or sequence
    ratios (every other variant)."""
    if algorithm.get("off_policy") == "behavior":
        return FAMILIES[0]
    if algorithm.get("variant") != "ppo":
        return FAMILIES[3]
    correction = algorithm.get("rollout_correction") or {}
    if (
        algorithm.get("m2po_threshold") is not None
        or correction.get("mask_level", "none") != "none"
    ):
        return FAMILIES[2]
    return FAMILIES[1]


@dataclass
class CurvePanel:
    """One panel of the curves figure: the methods of one family at one staleness, drawn
    against the references."""

    family: str
    staleness: int
    methods: list[str]
    references: list[tuple[str, int]]
    """(method, staleness) drawn dashed in the panel: the on-policy runs (staleness 0) and
    the baseline at the panel's staleness, where they are not among ``methods``."""


def curve_panels(runs: Sequence[ArenaRun], baseline: str | None) -> list[list[CurvePanel]]:
    """The curves figure's grid: a row per family present, a column per staleness above 0
    (the staleness-0 runs are the on-policy reference in every panel). A panel holds its
    family's methods at its staleness (at most five in the arena) and the references."""
    on_policy = sorted({r.method for r in runs if r.staleness == 0})
    levels = sorted({r.staleness for r in runs if r.staleness > 0})
    if not levels:  # on-policy runs alone: they are the panels
        levels, on_policy = [0], []
    families = [f for f in (*FAMILIES, "") if any(r.family == f and r.staleness in levels
                                                  for r in runs)]  # fmt: skip
    grid = []
    for family in families:
        row = []
        for staleness in levels:
            methods = sorted({r.method for r in runs
                              if r.family == family and r.staleness == staleness})  # fmt: skip
            refs = [(m, 0) for m in on_policy]
            has_baseline = any(r.method == baseline and r.staleness == staleness for r in runs)
            if baseline is not None and baseline not in methods and has_baseline:
                refs.append((baseline, staleness))
            row.append(CurvePanel(family, staleness, methods, refs))
        grid.append(row)
    return grid


CURVE_METRICS = {
    "success_curve": "training success",
    "malformed_curve": "malformed share",
    "kl_curve": "KL to reference (nats/token)",
}
"""The per-step series :func:`plot_curves` draws, with their axis labels."""


def read_run(run_dir: Path, rule: CollapseRule, tau: float = DEFAULT_TAU) -> ArenaRun:
    """One run directory as an :class:`ArenaRun`; ``method`` is ``run.label`` (the variant
    when unlabelled).

    Raises:
        FileNotFoundError: no ``config.json``.
    """
    cfg = json.loads((run_dir / "config.json").read_text())
    steps = read_records(run_dir / "steps.jsonl", "step")
    evals = read_records(run_dir / "eval.jsonl")
    end = [e for e in evals if e.get("tag") == "end"]
    start = [e for e in evals if e.get("tag") == "start"]
    activity = stabiliser_activity(steps)
    norms = _series(steps, "clip_bias_norm")
    malformed = _series(steps, "malformed_rate")
    return ArenaRun(
        method=cfg["run"].get("label") or cfg["algorithm"]["variant"],
        staleness=int(cfg["buffer"]["max_staleness"]),
        seed=int(cfg["run"]["seed"]),
        val_success=float(end[-1]["success_rate"]) if end else math.nan,
        val_start=float(start[0]["success_rate"]) if start else math.nan,
        collapsed=run_collapsed(steps, rule),
        finished=run_archive.is_complete(run_dir),
        steps=len(steps),
        shares=activity.shares,
        scale_min=activity.scale_min,
        scale_below_one=activity.scale_steps_below_one / activity.scale_steps
        if activity.scale_steps
        else 0.0,
        step_s=_mean(_series(steps[1:], "step_s")),
        proximal_error=_mean(_series(steps, "proximal_approx_abs_error")),
        bias_norm_ratio=[n / tau for n in norms if not math.isnan(n)],
        success_curve=_series(steps, "success_rate"),
        malformed_curve=malformed,
        kl_curve=_series(steps, "kl_ref"),
        wall_s=_run_wall_s(run_dir),
        malformed_end=_mean(malformed[-END_STEPS:]),
        family=method_family(cfg["algorithm"]),
    )


def _run_wall_s(run_dir: Path) -> float:
    first, last = run_dir / "config.json", run_dir / "eval.jsonl"
    if not last.exists():
        return math.nan
    return last.stat().st_mtime - first.stat().st_mtime


@dataclass
class LeaderboardRow:
    """One (method, staleness) cell over its seeds (``*_ci``: 95% interval (low, high);
    NaN = missing)."""

    method: str
    staleness: int
    runs: int
    seeds: list[int]
    val_success_per_seed: list[float]
    val_success_iqm: float
    val_success_iqm_ci: tuple[float, float]
    gain_mean: float
    gain_ci: tuple[float, float]
    collapsed: int
    judged: int
    collapse_ci: tuple[float, float]
    ended_low: int
    """Runs whose final success ended more than :data:`LOW_MARGIN` below the on-policy
    median (of :attr:`runs`; 0 with no on-policy reference, see :attr:`ended_low_ci`)."""
    ended_low_ci: tuple[float, float]
    """Wilson interval of ``ended_low / runs``; NaN without an on-policy reference."""
    poi_vs_baseline: float
    poi_vs_baseline_ci: tuple[float, float]
    vs_on_policy: float
    vs_on_policy_ci: tuple[float, float]
    shares: dict[str, float]
    scale_min: float
    scale_steps_below_one: float
    step_time_vs_baseline: float
    proximal_error: float
    malformed_end_per_seed: list[float] = field(default_factory=list)
    """Each run's :attr:`ArenaRun.malformed_end`, in :attr:`seeds` order."""
    degrading: int = 0
    """Runs degrading at the end: ``malformed_end`` above :data:`DEGRADING_MALFORMED`."""
    degrading_ci: tuple[float, float] = (math.nan, math.nan)
    """Wilson interval of ``degrading / runs``."""
    val_success_mean: float = math.nan
    """Mean final success over the runs (the ranking's second key, :func:`rank_key`)."""
    overlaps_best: bool = False


@dataclass
class BiasNormDistribution:
    """``||C|| / tau`` over every step of a (method, staleness) cell's runs."""

    method: str
    staleness: int
    steps: int
    share_zero: float
    share_above_one: float
    quantiles: dict[str, float] = field(default_factory=dict)


def low_threshold(runs: Sequence[ArenaRun], on_policy_staleness: int = 0) -> float:
    """The final success below which a run *ended low*: the median of the finished
    on-policy runs' final success minus :data:`LOW_MARGIN`; NaN without on-policy runs."""
    import statistics

    on_policy = [r.val_success for r in runs
                 if r.staleness == on_policy_staleness and not math.isnan(r.val_success)]  # fmt: skip
    return statistics.median(on_policy) - LOW_MARGIN if on_policy else math.nan


def leaderboard(
    runs: Sequence[ArenaRun], baseline: str | None, on_policy_staleness: int = 0
) -> list[LeaderboardRow]:
    """Rows of every (method, staleness) cell, ranked within each staleness by
    :func:`rank_key` (fewest ended low, then the highest mean; the on-policy cells get their
    own board). ``baseline``: the method the probability of improvement and the step time
    compare with (None: not compared)."""
    cells: dict[tuple[str, int], list[ArenaRun]] = {}
    for r in runs:
        cells.setdefault((r.method, r.staleness), []).append(r)
    on_policy = [r.val_success for (m, s), rs in cells.items() if s == on_policy_staleness
                 for r in rs]  # fmt: skip
    low = low_threshold(runs, on_policy_staleness)
    rows = []
    for (method, staleness), rs in cells.items():
        val = [r.val_success for r in rs]
        base = cells.get((baseline, staleness), []) if baseline else []
        base_val = [r.val_success for r in base]
        judged = [r.collapsed for r in rs if r.collapsed is not None]
        compare = bool(base) and method != baseline
        step_ratio = step_time_ratio(rs, base) if compare else math.nan
        degrading = sum(r.malformed_end > DEGRADING_MALFORMED for r in rs)
        stale = staleness != on_policy_staleness
        rows.append(
            LeaderboardRow(
                method=method,
                staleness=staleness,
                runs=len(rs),
                seeds=[r.seed for r in rs],
                val_success_per_seed=val,
                val_success_iqm=iqm(val),
                val_success_iqm_ci=iqm_ci(val),
                gain_mean=_mean([r.val_success - r.val_start for r in rs]),
                gain_ci=mean_ci([r.val_success - r.val_start for r in rs]),
                collapsed=sum(bool(c) for c in judged),
                judged=len(judged),
                collapse_ci=wilson_ci(sum(bool(c) for c in judged), len(judged)),
                ended_low=sum(v < low for v in val),
                ended_low_ci=wilson_ci(sum(v < low for v in val), len(val))
                if not math.isnan(low)
                else (math.nan, math.nan),
                poi_vs_baseline=probability_of_improvement(val, base_val) if compare else math.nan,
                poi_vs_baseline_ci=poi_ci(val, base_val) if compare else (math.nan, math.nan),
                vs_on_policy=mean_difference(val, on_policy) if stale else math.nan,
                vs_on_policy_ci=mean_difference_ci(val, on_policy)
                if stale
                else (math.nan, math.nan),
                shares={m.field: _mean([r.shares[m.field] for r in rs]) for m in MECHANISMS},
                scale_min=min(r.scale_min for r in rs),
                scale_steps_below_one=_mean([r.scale_below_one for r in rs]),
                step_time_vs_baseline=step_ratio,
                proximal_error=_mean([r.proximal_error for r in rs]),
                malformed_end_per_seed=[r.malformed_end for r in rs],
                degrading=degrading,
                degrading_ci=wilson_ci(degrading, len(rs)),
                val_success_mean=_mean(val),
            )
        )
    rows.sort(key=rank_key)
    _mark_overlaps(rows)
    return rows


def rank_key(row: LeaderboardRow) -> tuple[int, int, float, str]:
    """Sort key of a board's rows: staleness, then runs that ended low (fewest first), then
    the mean final success (highest first; NaN last), then the method's name.

    Example: at one staleness, a cell with 0 of 10 ended low and mean 0.27 ranks above one
    with 2 of 10 ended low and mean 0.29 (and IQM 0.29: its falls are in the trimmed
    quarter)."""
    return (row.staleness, row.ended_low, -_nan_low(row.val_success_mean), row.method)


def step_time_ratio(runs: Sequence[ArenaRun], base: Sequence[ArenaRun]) -> float:
    """Mean learner step time of ``runs`` over that of ``base``, both over the seeds they
    share: the grid runs seed by seed, so a seed's runs share a sitting and a machine, and
    a cell with more seeds than the other (or run on another CPU) is not compared across
    machines. NaN when they share no seed."""
    shared = {r.seed for r in runs} & {r.seed for r in base}
    if not shared:
        return math.nan
    return _mean([r.step_s for r in runs if r.seed in shared]) / _mean(
        [r.step_s for r in base if r.seed in shared]
    )


def _nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def _mark_overlaps(rows: list[LeaderboardRow]) -> None:
    """Flag, per staleness, the rows whose interval overlaps the best row's (the best too)."""
    for staleness in {r.staleness for r in rows}:
        board = [r for r in rows if r.staleness == staleness]
        best = max(board, key=lambda r: _nan_low(r.val_success_iqm))
        low, high = best.val_success_iqm_ci
        for r in board:
            a, b = r.val_success_iqm_ci
            r.overlaps_best = r is best or (
                not math.isnan(a) and not math.isnan(low) and b >= low and a <= high
            )


def bias_norm_distributions(runs: Sequence[ArenaRun]) -> list[BiasNormDistribution]:
    """:class:`BiasNormDistribution` per (method, staleness), quantiles 0.5, 0.9, 0.99, max."""
    import numpy as np

    cells: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        cells.setdefault((r.method, r.staleness), []).extend(r.bias_norm_ratio)
    out = []
    for (method, staleness), values in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        v = np.asarray(values, dtype=float)
        if not len(v):
            continue
        out.append(
            BiasNormDistribution(
                method=method,
                staleness=staleness,
                steps=len(v),
                share_zero=float((v == 0).mean()),
                share_above_one=float((v > 1).mean()),
                quantiles={q: float(np.quantile(v, float(q))) for q in ("0.5", "0.9", "0.99")}
                | {"max": float(v.max())},
            )
        )
    return out


@dataclass
class BoardPower:
    """What one leaderboard's seeds can tell apart: the pooled within-cell sd of final
    validation success over its runs that did not collapse, and the smallest difference of
    two cell means a test detects at that sd (:func:`detectable_difference`) for a few
    numbers of seeds per cell."""

    staleness: int
    cells: int
    runs: int
    pooled_sd: float
    detectable: dict[str, float] = field(default_factory=dict)
    """``str(seeds per cell) -> difference`` (success, 0-1)."""


POWER_SEEDS: tuple[int, ...] = (5, 10)
"""Seeds per cell at which :func:`board_power` states the detectable difference (the
arena's first stage and its ``more_seeds`` target)."""


def detectable_difference(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest difference of two means of ``n`` runs each, with a common sd ``sd``, that a
    two-sided level-``alpha`` z-test detects with probability ``power``:
    ``(z_{1 - alpha/2} + z_{power}) * sd * sqrt(2 / n)``: the normal-approximation sample
    size of a two-sample test for equality, ``n = 2 (z_{1-alpha/2} + z_power)^2 sd^2 / d^2``
    (Chow, Shao & Wang, *Sample Size Calculations in Clinical Research*, section 3.2),
    solved for ``d``. NaN for ``n < 2`` or a NaN ``sd``.

    Raises:
        ValueError: ``alpha`` or ``power`` outside (0, 1).
    """
    from scipy.stats import norm

    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha {alpha} and power {power} must lie in (0, 1)")
    if n < 2 or math.isnan(sd):
        return math.nan
    return float((norm.ppf(1 - alpha / 2) + norm.ppf(power)) * sd * math.sqrt(2 / n))


def board_power(runs: Sequence[ArenaRun], seeds: Sequence[int] = POWER_SEEDS) -> list[BoardPower]:
    """:class:`BoardPower` per staleness over the finished runs that neither collapsed nor
    ended low (:func:`low_threshold`), pooling the variance of every cell with at least two
    of them: ``sum((n_i - 1) s_i^2) / sum(n_i - 1)``. A run that loses the task moves by far
    more than a question; the collapse and ended-low counts tell those cells apart, this
    tells the rest."""
    import statistics

    low = low_threshold(runs)
    cells: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        if not r.finished or r.collapsed is True or math.isnan(r.val_success):
            continue
        if r.val_success >= low or math.isnan(low):
            cells.setdefault((r.method, r.staleness), []).append(r.val_success)
    out = []
    for staleness in sorted({s for _, s in cells}):
        groups = [v for (_, s), v in cells.items() if s == staleness and len(v) >= 2]
        dof = sum(len(v) - 1 for v in groups)
        sd = (
            math.sqrt(sum((len(v) - 1) * statistics.variance(v) for v in groups) / dof)
            if dof
            else math.nan
        )
        out.append(
            BoardPower(
                staleness=staleness,
                cells=len(groups),
                runs=sum(len(v) for v in groups),
                pooled_sd=sd,
                detectable={str(n): detectable_difference(sd, n) for n in seeds},
            )
        )
    return out


def _power_line(power: BoardPower) -> str:
    if math.isnan(power.pooled_sd):
        return "Power: no cell has two runs that neither collapsed nor ended low."
    at = ", ".join(f"{_f(d)} with {n} seeds per cell" for n, d in power.detectable.items())
    return (
        f"Power: pooled sd {_f(power.pooled_sd)} of final success over {power.runs} runs in "
        f"{power.cells} cells (runs that neither collapsed nor ended low); a two-sided 5% "
        f"test detects a difference of two cell means at 80% power of {at}."
    )


# --------------------------------------------------------------------------- outputs


def _f(v: float, digits: int = 3) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def _ci(ci: tuple[float, float], digits: int = 2) -> str:
    return "" if any(math.isnan(v) for v in ci) else f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{100 * v:.2f}%"


def _ended_low(row: LeaderboardRow) -> str:
    if math.isnan(row.ended_low_ci[0]):
        return "-"
    return f"{row.ended_low}/{row.runs}{_ci(row.ended_low_ci)}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def leaderboard_header(
    rows: Sequence[LeaderboardRow], runs_wall_s: float, extra: dict[str, Any] | None
) -> str:
    """The leaderboards' title and provenance, from the records alone: the experiment, the
    finished runs and how many seeds each cell has, the days and CPUs they ran on (where
    they came from the grid's archive, :func:`experiments.archive.provenance`), and their
    run time (summed over runs; the machine time is that over ``parallel_runs``)."""
    extra = extra or {}
    name = extra.get("experiment")
    title = f"# Leaderboards: `stppo experiment {name}`" if name else "# Leaderboards"
    runs = sum(r.runs for r in rows)
    cells = sorted(Counter(r.runs for r in rows).items(), reverse=True)  # (seeds, cells)
    seeds = ", ".join(f"{_plural(k, 'seed')} in {_plural(n, 'cell')}" for k, n in cells)
    text = f"{_plural(runs, 'finished run')}, {_plural(len(rows), 'cell')} ({seeds})"
    if extra.get("only"):
        slice_ = "; ".join(f"{k} in {v}" for k, v in extra["only"].items())
        text += f", the slice {slice_}"
    archived = extra.get("archived")
    if archived:
        days = archived["first_day"]
        if archived["last_day"] != days:
            days += f" to {archived['last_day']}"
        machines = ", ".join(f"{cpu} ({n} runs)" for cpu, n in archived["cpus"].items())
        text += (
            f"; {archived['runs']} of them from the archive `{extra.get('archive_dir')}`, "
            f"final evaluations {days} (UTC) on {machines}"
        )
    parallel = extra.get("parallel_runs") or 1
    if not math.isnan(runs_wall_s) and runs_wall_s > 0:
        text += f"; {runs_wall_s / 3600:.1f} h of run time"
        if parallel > 1:
            machine_h = runs_wall_s / 3600 / parallel
            text += f" ({parallel} runs at a time: about {machine_h:.1f} h of machine time)"
    return f"{title}\n\n{text}.\n\n"


def leaderboard_markdown(
    rows: list[LeaderboardRow],
    norms: list[BiasNormDistribution],
    baseline: str | None,
    power: Sequence[BoardPower] = (),
) -> str:
    """One table per staleness (ranked by :func:`rank_key`: fewest ended low, then the
    highest mean; a row in bold overlaps the interval of the highest IQM) with its power
    line (:func:`board_power`), the ``||C|| / tau`` table, and how to read them."""
    powers = {p.staleness: p for p in power}
    out = []
    for staleness in sorted({r.staleness for r in rows}):
        out.append(f"### Staleness {staleness}\n")
        out.append(
            "| method | runs | ended low [Wilson] | val success mean | val success IQM "
            "[95% CI] | gain over start | collapsed [Wilson] | degrading at the end [Wilson] | "
            "P(improve over baseline) | vs on-policy | "
            + " | ".join(m.label for m in MECHANISMS)
            + " | s min (steps < 1) | step time vs baseline | proximal approx error |"
        )
        out.append(
            "|---|---:|---|---:|---|---|---|---|---|---|"
            + "---:|" * len(MECHANISMS)
            + "---|---:|---:|"
        )
        for r in (r for r in rows if r.staleness == staleness):
            name = f"**{r.method}**" if r.overlaps_best else r.method
            out.append(
                f"| {name} | {r.runs} | {_ended_low(r)} | {_f(r.val_success_mean)} | "
                f"{_f(r.val_success_iqm)}{_ci(r.val_success_iqm_ci)} | "
                f"{_f(r.gain_mean)}{_ci(r.gain_ci)} | {r.collapsed}/{r.judged}"
                f"{_ci(r.collapse_ci)} | {r.degrading}/{r.runs}{_ci(r.degrading_ci)} | "
                f"{_f(r.poi_vs_baseline, 2)}{_ci(r.poi_vs_baseline_ci)} | "
                f"{_f(r.vs_on_policy)}{_ci(r.vs_on_policy_ci)} | "
                + " | ".join(_pct(r.shares[m.field]) for m in MECHANISMS)
                + f" | {_f(r.scale_min)} ({_pct(r.scale_steps_below_one)}) | "
                f"{_f(r.step_time_vs_baseline, 2)} | {_f(r.proximal_error, 4)} |"
            )
        out.append("")
        if staleness in powers:
            out.extend([_power_line(powers[staleness]), ""])
    out.append(f"### ||C|| / tau per step (tau = {DEFAULT_TAU})\n")
    out.append(
        "| method | staleness | steps | ||C|| = 0 | > 1 (s < 1) | median | p90 | p99 | max |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in norms:
        q = n.quantiles
        out.append(
            f"| {n.method} | {n.staleness} | {n.steps} | {_pct(n.share_zero)} | "
            f"{_pct(n.share_above_one)} | {q['0.5']:.3g} | {q['0.9']:.3g} | {q['0.99']:.3g} | "
            f"{q['max']:.3g} |"
        )
    out.append("")
    out.append(
        "Rows are ranked by the runs that ended low (fewest first), then by the mean final "
        "success. Val success: greedy success on the held-out questions at the end of each "
        "run; its mean over seeds, and its IQM (mean of the middle 50% of seeds) with a 95% "
        "percentile-bootstrap interval over seeds; bold rows overlap the interval of the "
        "highest IQM. Gain: end minus start of the same "
        "evaluation, mean and bootstrap interval. Collapsed: the experiment's collapse rule, "
        f"Wilson interval. Ended low: final success more than {LOW_MARGIN} below the median "
        "of the on-policy runs, Wilson interval. Degrading at the end: the training "
        f"rollouts' malformed share over the last {END_STEPS} steps above "
        f"{DEGRADING_MALFORMED}, Wilson interval. P(improve over baseline): probability that "
        "a run of the row ends "
        f"above a run of `{baseline}` at the same staleness (ties count half), stratified "
        "bootstrap. Vs on-policy: mean difference to the staleness-0 runs. Token shares: "
        "mean over steps and seeds of the share of policy tokens each mechanism acted on "
        "(clipped: the PPO clip and dual clip, CISPO's truncated weights). s min: the "
        "smallest clipping-bias scale of any step, and the share of steps with s < 1. Step "
        "time: mean learner step time over the baseline's, over the seeds both ran (one "
        "sitting, one machine; two runs share the 2-core machine at a time: ~10% noise). "
        "Proximal approx error: mean |log pi_prox - log-linear approximation| (nats per "
        "token) where the proximal log-probs are recomputed. ||C|| / tau: the clipping-bias "
        "norm of every step over the default tau; the triggered scale acts only above 1."
    )
    return "\n".join(out) + "\n"


ACTED_MIN = 5e-5
"""The smallest token share the summary names (0.005%; smaller reads "0.00%")."""


def acted_on(row: LeaderboardRow) -> str:
    """What the stabilisers of a cell did, in a few words: each mechanism's mean share of
    policy tokens where it is at least :data:`ACTED_MIN`, and ST-PPO's scale where it fell
    below 1 (its minimum, and the share of steps below 1); ``"nothing"`` otherwise."""
    shares = [(m.short, row.shares[m.field]) for m in MECHANISMS]
    parts = [f"{short} {_pct(v)}" for short, v in shares if not math.isnan(v) and v >= ACTED_MIN]
    if not math.isnan(row.scale_min) and row.scale_min < 1.0:
        parts.append(f"s >= {row.scale_min:.2f} ({_pct(row.scale_steps_below_one)} of steps < 1)")
    return ", ".join(parts) or "nothing"


def summary_markdown(rows: list[LeaderboardRow], baseline: str | None) -> str:
    """The leaderboards in the short form the results page shows, ranked by
    :func:`rank_key`: per staleness, each cell's runs, ended-low count, mean, IQM with its
    interval, gain, collapsed and degrading counts, probability of improvement over
    ``baseline``, difference to on-policy, every seed's final success (sorted, ascending)
    and what acted (:func:`acted_on`). Bold rows overlap the interval of the highest IQM."""
    out = []
    for staleness in sorted({r.staleness for r in rows}):
        out.append(f"**Staleness {staleness}**\n")
        out.append(
            "| method | runs | ended low | val success mean | val success IQM [95% CI] | "
            "gain over start | collapsed | degrading at the end | "
            f"P(improve over {baseline or 'baseline'}) | "
            "vs on-policy | "
            "final success per seed (sorted) | acted on (share of tokens) |"
        )
        out.append("|---|---:|---|---:|---|---|---|---|---|---|---|---|")
        for r in (r for r in rows if r.staleness == staleness):
            name = f"**{r.method}**" if r.overlaps_best else r.method
            low = "-" if math.isnan(r.ended_low_ci[0]) else f"{r.ended_low}/{r.runs}"
            gain = "-" if math.isnan(r.gain_mean) else f"{r.gain_mean:+.3f}{_ci(r.gain_ci)}"
            vs = "-" if math.isnan(r.vs_on_policy) else f"{r.vs_on_policy:+.3f}"
            finals = " ".join(f"{v:.3f}" for v in sorted(r.val_success_per_seed))
            out.append(
                f"| {name} | {r.runs} | {low} | {_f(r.val_success_mean)} | "
                f"{_f(r.val_success_iqm)}{_ci(r.val_success_iqm_ci)} | "
                f"{gain} | {r.collapsed}/{r.judged} | {r.degrading}/{r.runs} | "
                f"{_f(r.poi_vs_baseline, 2)}{_ci(r.poi_vs_baseline_ci)} | "
                f"{vs}{_ci(r.vs_on_policy_ci)} | {finals} | {acted_on(r)} |"
            )
        out.append("")
    return "\n".join(out)


def plot_intervals(rows: list[LeaderboardRow], path: Path) -> Path:
    """One panel per staleness: each method's IQM with its 95% interval, in the board's
    order (:func:`rank_key`) from the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r.staleness for r in rows})
    height = max(len([r for r in rows if r.staleness == s]) for s in levels)
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 0.35 * height + 1.5),
                             squeeze=False)  # fmt: skip
    for ax, staleness in zip(axes[0], levels, strict=True):
        board = [r for r in rows if r.staleness == staleness][::-1]
        for y, r in enumerate(board):
            low, high = r.val_success_iqm_ci
            color = "tab:blue" if r.overlaps_best else "tab:gray"
            if not math.isnan(low):
                ax.plot([low, high], [y, y], color=color, lw=2)
            ax.plot(r.val_success_iqm, y, "o", color=color)
        ax.set_yticks(range(len(board)), [f"{r.method} (n={r.runs})" for r in board])
        ax.set_title(f"staleness {staleness}")
        ax.set_xlabel("final greedy val success (IQM, 95% CI)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def seed_band(curves: Any) -> tuple[Any, Any, Any]:
    """Mean over seeds and a band of +-1 sd clipped to the seeds' range, per step.

    ``curves``: array ``[seeds, steps]``. Returns three arrays ``[steps]``: mean, low, high.
    The clip keeps the band inside what some seed reached: a share or a KL never reads
    below 0, and a cell whose runs split (some fall, some hold) shows no values none had.
    """
    import numpy as np

    mean, sd = curves.mean(0), curves.std(0)
    return mean, np.maximum(mean - sd, curves.min(0)), np.minimum(mean + sd, curves.max(0))


def moving_average(curve: Sequence[float], window: int) -> Any:
    """The mean of each ``window`` consecutive values of ``curve`` (NaN read as 0), as a
    numpy array of ``len(curve) - window + 1`` values; ``curve`` itself (NaN as 0) when it
    is shorter than ``window``."""
    import numpy as np

    c = np.nan_to_num(np.asarray(curve, dtype=float))
    return np.convolve(c, np.ones(window) / window, "valid") if len(c) >= window else c


def plot_curves(
    runs: Sequence[ArenaRun],
    path: Path,
    metric: str = "success_curve",
    baseline: str | None = None,
    window: int = 5,
) -> Path:
    """One per-step series (:data:`CURVE_METRICS`; moving average over ``window`` steps,
    mean and a band of +-1 sd over seeds clipped to the seeds' range) in a grid of panels
    (:func:`curve_panels`): a row per method family, a column per staleness, each panel
    with its family's methods, the on-policy runs and the baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    label = CURVE_METRICS[metric]
    grid = curve_panels(runs, baseline)
    rows, cols = len(grid), max((len(row) for row in grid), default=1)
    colors = plt.get_cmap("tab10")

    def draw(ax: Any, method: str, staleness: int, **style: Any) -> None:
        curves = [getattr(r, metric) for r in runs
                  if r.method == method and r.staleness == staleness]  # fmt: skip
        n = min((len(c) for c in curves), default=0)
        if n < window:
            return
        smooth = np.array([moving_average(c[:n], window) for c in curves])
        x = np.arange(window, n + 1)
        mean, low, high = seed_band(smooth)
        ax.plot(x, mean, **style)
        if style.get("ls", "-") == "-":
            ax.fill_between(x, low, high, color=style["color"], alpha=0.15)

    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols, 3.0 * rows), squeeze=False, sharex=True, sharey=True
    )
    for r, row in enumerate(grid):
        family_methods = sorted({m for panel in row for m in panel.methods})
        for c, panel in enumerate(row):
            ax = axes[r][c]
            for method, staleness in panel.references:
                name = "on-policy" if staleness == 0 else "baseline"
                draw(ax, method, staleness, color="black" if staleness == 0 else "gray",
                     ls=":" if staleness == 0 else "--", lw=1.3,
                     label=f"{method}, {name}")  # fmt: skip
            for method in panel.methods:
                color = colors(family_methods.index(method) % 10)
                draw(ax, method, panel.staleness, color=color, lw=1.6, label=method)
            if not panel.methods:
                ax.text(0.5, 0.5, "not run at this staleness", transform=ax.transAxes,
                        ha="center", va="center", color="gray", fontsize=10)  # fmt: skip
            title = f"staleness {panel.staleness}"
            ax.set_title(f"{panel.family}, {title}" if panel.family else title, fontsize=10)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=9)
            if r == rows - 1:
                ax.set_xlabel("learner step", fontsize=9)
            if c == 0:
                ax.set_ylabel(label, fontsize=9)
        # one legend per row, every line of the row once, in the panel that draws the most
        handles: dict[str, Any] = {}
        for c in range(len(row)):
            for handle, name in zip(*axes[r][c].get_legend_handles_labels(), strict=True):
                handles.setdefault(name, handle)
        if handles:
            fullest = max(range(len(row)), key=lambda i: len(axes[r][i].get_lines()))
            axes[r][fullest].legend(handles.values(), handles.keys(), fontsize=8, loc="best")
    for r, row in enumerate(grid):
        for c in range(len(row), cols):
            axes[r][c].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_bias_norms(runs: Sequence[ArenaRun], path: Path) -> Path:
    """Empirical distribution (1 - CDF, log x) of ``||C|| / tau`` per method, one panel per
    staleness; the vertical line at 1 is where the triggered scale starts acting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    levels = sorted({r.staleness for r in runs})
    methods = sorted({r.method for r in runs})
    colors = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4), squeeze=False)
    for ax, staleness in zip(axes[0], levels, strict=True):
        for i, method in enumerate(methods):
            v = np.sort([x for r in runs if r.method == method and r.staleness == staleness
                         for x in r.bias_norm_ratio])  # fmt: skip
            if not len(v):
                continue
            positive = v[v > 0]
            if not len(positive):
                continue
            survival = 1.0 - np.arange(len(v) - len(positive), len(v)) / len(v)
            ax.step(positive, survival, where="post", color=colors(i), label=method, lw=1)
        ax.axvline(1.0, color="black", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(f"||C|| / tau (tau = {DEFAULT_TAU})")
        ax.set_ylabel("share of steps above")
        ax.set_title(f"staleness {staleness}")
        ax.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def json_safe(value: Any) -> Any:
    """``value`` with every NaN float (nested in dicts, lists and tuples) as None, for JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_leaderboards(
    run_dirs: Sequence[Path],
    rule: CollapseRule,
    out_dir: Path,
    *,
    baseline: str | None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Read the runs, write ``leaderboard.{json,md}``, ``leaderboard_summary.md`` and the
    three figures into ``out_dir``; returns the markdown's path. Unfinished runs (also
    those the time cap stopped early) are left out of the boards (their count is in the
    JSON)."""
    runs = [read_run(d, rule) for d in run_dirs if (d / "config.json").exists()]
    finished = [r for r in runs if r.finished]
    rows = leaderboard(finished, baseline)
    norms = bias_norm_distributions(finished)
    power = board_power(finished)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "leaderboard.md"
    runs_wall_s = sum(r.wall_s for r in finished if not math.isnan(r.wall_s))
    header = leaderboard_header(rows, runs_wall_s, extra)
    md.write_text(header + leaderboard_markdown(rows, norms, baseline, power))
    (out_dir / "leaderboard_summary.md").write_text(summary_markdown(rows, baseline))
    payload = {
        **(extra or {}),
        "baseline": baseline,
        "unfinished_runs": len(runs) - len(finished),
        "runs_wall_s": runs_wall_s,
        "rows": [asdict(r) for r in rows],
        "bias_norm_over_tau": [asdict(n) for n in norms],
        "power": [asdict(p) for p in power],
    }
    (out_dir / "leaderboard.json").write_text(json.dumps(json_safe(payload), indent=1) + "\n")
    if finished:
        plot_intervals(rows, out_dir / "leaderboard_intervals.png")
        for metric, suffix in (("success_curve", ""), ("malformed_curve", "_malformed"),
                               ("kl_curve", "_kl")):  # fmt: skip
            plot_curves(finished, out_dir / f"leaderboard_curves{suffix}.png", metric, baseline)
        plot_bias_norms(finished, out_dir / "leaderboard_bias_norm.png")
    return md
