"""Per-cell statistics and figures of a multi-seed grid (``stppo experiment stability_answer``).

A cell is one grid point (by default the values of ``algorithm.variant``,
``algorithm.off_policy`` and ``buffer.max_staleness``; :data:`CELL_KEYS`); its runs are
the seeds. For each cell (:class:`CellSummary`) over its runs:

- final validation success: greedy success on the held-out questions at the end of each run
  (``eval.jsonl``, tag ``end``); its interquartile mean (IQM, the mean of the middle 50% of
  runs, ``scipy.stats.trim_mean(x, 0.25)``) with a 95% percentile-bootstrap interval over
  seeds (:func:`iqm_ci`; with one task, rliable's stratified bootstrap is the bootstrap over
  runs), and the mean and sd;
- validation gain: end minus start (tag ``start``, the same questions before RL), mean with
  a 95% bootstrap interval: does RL improve on its starting point;
- the same two for the sampling policy where the runs measured it (``run.eval_sampled``:
  tags ``start_sampled`` and ``end_sampled``, the questions at the rollout temperature);
- final training success: ``success_rate`` of ``steps.jsonl`` averaged over each run's last
  ``final_window`` steps, IQM and interval likewise;
- against staleness 0 (for a cell with ``buffer.max_staleness > 0``): the mean final
  validation success minus that of the same cell at staleness 0 (:func:`on_policy_reference`),
  with a 95% stratified-bootstrap interval (:func:`mean_difference_ci`), and the probability
  of improvement over it: does training at that staleness reach what on-policy training
  reaches;
- probability of improvement over ``ppo`` in the same cell otherwise (same objective and
  staleness): P(X > Y) + P(X = Y) / 2 for X a run of this variant and Y one of ppo, on the
  final validation success (:func:`probability_of_improvement`, the Mann-Whitney U statistic
  over n*m, as rliable defines it), with a 95% stratified-bootstrap interval (each side
  resampled on its own, :func:`poi_ci`);
- collapsed: runs for which :func:`experiments.collapse.run_collapsed` fires (smoothed
  success at least ``drop`` below its best on each of the last ``last_k`` steps, or smoothed
  malformed share at least ``malformed``), as ``k/n`` with a 95% Wilson interval
  (:func:`wilson_ci`, ``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")``);
- clip ratio and approx KL (nats/token): mean over steps, then over runs;
- which other stabiliser acted: the share of tokens the turn-level token bound held
  (``token_bound_ratio``) and the share whose behaviour weight exceeded its cap
  (``behavior_weight_capped``), mean over steps, then over runs;
- largest token ``|log ratio|`` (``token_log_ratio_abs_max``, nats): max over steps,
  mean over runs;
- clip-bias scale ``s`` (``clip_bias_scale``; 1 for variants without it): mean over steps
  and runs, and its minimum anywhere;
- realised staleness (``consumed.jsonl``): the share of consumed trajectories whose
  staleness is exactly ``min(step - 1, max_staleness)``, which ``sync.fixed_lag`` promises
  (1.0 expected).

Sources: Agarwal et al., "Deep RL at the Edge of the Statistical Precipice" (NeurIPS 2021)
for IQM, stratified bootstrap and probability of improvement (rliable); Wilson (1927) for the
binomial interval. Every interval is computed by scipy (``scipy.stats.bootstrap``, percentile
method, 2,000 resamples, a fixed generator seed so the summary is reproducible).

The figures (:func:`plot_cells`, :func:`plot_intervals`): success curves per step (mean and
±1 sd band over seeds); and per cell the IQM with its interval, the probability of
improvement with its interval and the collapse rate with its Wilson interval.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments.collapse import CollapseRule, run_collapsed
from services.run_records import read_records as read_jsonl

CELL_KEYS: tuple[str, ...] = ("algorithm.variant", "algorithm.off_policy", "buffer.max_staleness")
"""Dotted config keys whose values name a cell (a missing key reads as ``None``)."""

CONFIDENCE = 0.95
"""Coverage of every interval."""

N_RESAMPLES = 2000
"""Bootstrap resamples per interval."""

BOOTSTRAP_SEED = 0
"""Seed of the bootstrap's generator (a summary is the same every time it is written)."""


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


def iqm(values: list[float]) -> float:
    """Interquartile mean: the mean of the middle 50% of the finite values
    (``scipy.stats.trim_mean(x, 0.25)``: ``floor(0.25 n)`` values cut from each end).
    NaN when there are none.

    Example: ``iqm([0, 1, 2, 3, 4, 5, 6, 7]) == 3.5`` (the mean of 2, 3, 4, 5).
    """
    from scipy import stats

    v = _finite(values)
    return float(stats.trim_mean(v, 0.25)) if v else math.nan


def _iqm_axis(x, axis=-1):
    from scipy import stats

    return stats.trim_mean(x, 0.25, axis=axis)


def _bootstrap(samples: tuple[list[float], ...], statistic) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``statistic`` over ``samples``, each resampled
    on its own (independent strata); (NaN, NaN) when a sample has fewer than 2 values."""
    import numpy as np
    from scipy import stats

    if any(len(s) < 2 for s in samples):
        return math.nan, math.nan
    arrays = tuple(np.asarray(s, dtype=float) for s in samples)
    if all(np.ptp(a) == 0 for a in arrays):  # every resample gives the same value
        value = float(statistic(*arrays, axis=-1))
        return value, value
    result = stats.bootstrap(
        arrays,
        statistic,
        confidence_level=CONFIDENCE,
        n_resamples=N_RESAMPLES,
        method="percentile",
        paired=False,
        vectorized=True,
        rng=np.random.default_rng(BOOTSTRAP_SEED),
    )
    ci = result.confidence_interval
    return float(ci.low), float(ci.high)


def iqm_ci(values: list[float]) -> tuple[float, float]:
    """95% percentile-bootstrap interval (over runs) of :func:`iqm` of the finite values:
    (low, high), (NaN, NaN) below 2 values, (v, v) when all values are v."""
    return _bootstrap((_finite(values),), _iqm_axis)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """95% percentile-bootstrap interval (over runs) of the mean of the finite values, as
    :func:`iqm_ci`."""
    import numpy as np

    return _bootstrap((_finite(values),), lambda x, axis=-1: np.mean(x, axis=axis))


def _mean_diff_axis(x, y, axis=-1):
    import numpy as np

    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def mean_difference(x: list[float], y: list[float]) -> float:
    """mean(x) - mean(y) of the finite values; NaN if either side is empty."""
    x, y = _finite(x), _finite(y)
    return sum(x) / len(x) - sum(y) / len(y) if x and y else math.nan


def mean_difference_ci(x: list[float], y: list[float]) -> tuple[float, float]:
    """95% stratified-bootstrap interval of :func:`mean_difference`, x and y each resampled
    on their own (two independent groups of seeds); (NaN, NaN) when either side has fewer
    than 2 values."""
    return _bootstrap((_finite(x), _finite(y)), _mean_diff_axis)


def _poi_axis(x, y, axis=-1):
    """P(X > Y) + P(X = Y) / 2 over all pairs, along ``axis`` of x and y (vectorised)."""
    import numpy as np

    x = np.moveaxis(np.asarray(x), axis, -1)[..., :, None]
    y = np.moveaxis(np.asarray(y), axis, -1)[..., None, :]
    return ((x > y).astype(float) + 0.5 * (x == y)).mean(axis=(-2, -1))


def probability_of_improvement(x: list[float], y: list[float]) -> float:
    """P(X > Y) + P(X = Y) / 2 for X drawn from ``x`` and Y from ``y`` (finite values):
    the Mann-Whitney U statistic of x over ``len(x) * len(y)``
    (``scipy.stats.mannwhitneyu(x, y).statistic``). 0.5 = no difference. NaN if either
    side is empty.

    Example: ``probability_of_improvement([1, 2, 3], [0, 2, 5]) == 4.5 / 9`` (x wins 4 of
    the 9 pairs, ties 1).
    """
    from scipy import stats

    x, y = _finite(x), _finite(y)
    if not x or not y:
        return math.nan
    return float(stats.mannwhitneyu(x, y).statistic) / (len(x) * len(y))


def poi_ci(x: list[float], y: list[float]) -> tuple[float, float]:
    """95% stratified-bootstrap interval of :func:`probability_of_improvement`: x and y each
    resampled on their own (rliable's stratified bootstrap with one task); (NaN, NaN) when
    either side has fewer than 2 values."""
    return _bootstrap((_finite(x), _finite(y)), _poi_axis)


def wilson_ci(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n, no continuity correction
    (``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")``); (NaN, NaN) for n = 0.

    Example: ``wilson_ci(5, 10) ~= (0.2366, 0.7634)``.

    Raises:
        ValueError: k < 0 or k > n.
    """
    from scipy import stats

    if n == 0:
        return math.nan, math.nan
    if not 0 <= k <= n:
        raise ValueError(f"k = {k} successes out of n = {n}")
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=CONFIDENCE, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass
class CellSummary:
    """One row of the per-cell table (fields as in the module docstring; NaN = missing;
    ``*_ci`` = (low, high) of a 95% interval)."""

    cell: dict[str, Any]
    variant: str
    off_policy: str
    max_staleness: int
    optimizer_steps_per_batch: int
    runs: int
    seeds: list[int]
    val_success_per_seed: list[float]
    final_success_per_seed: list[float]
    steps_mean: float
    val_success_iqm: float
    val_success_iqm_ci: tuple[float, float]
    val_success_mean: float
    val_success_sd: float
    val_start_mean: float
    val_gain_mean: float
    val_gain_ci: tuple[float, float]
    val_sampled_iqm: float
    val_sampled_iqm_ci: tuple[float, float]
    val_sampled_gain_mean: float
    val_sampled_gain_ci: tuple[float, float]
    final_success_iqm: float
    final_success_iqm_ci: tuple[float, float]
    poi_vs_ppo: float
    poi_vs_ppo_ci: tuple[float, float]
    on_policy_cell: str
    vs_on_policy: float
    vs_on_policy_ci: tuple[float, float]
    poi_vs_on_policy: float
    poi_vs_on_policy_ci: tuple[float, float]
    collapsed: int
    judged: int
    collapse_ci: tuple[float, float]
    clip_ratio: float
    approx_kl: float
    token_log_ratio_max: float
    clip_bias_scale_mean: float
    clip_bias_scale_min: float
    exact_staleness_share: float
    token_bound_ratio: float = math.nan
    behavior_weight_capped: float = math.nan


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), int | float) else math.nan for r in records]


def _dotted(cfg: dict[str, Any], key: str) -> Any:
    """``cfg["a"]["b"]`` for ``key = "a.b"``; None where a part is missing."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@dataclass
class RunStats:
    """What one run contributes to its cell (successes are shares in [0, 1])."""

    variant: str
    max_staleness: int
    steps: int
    final_success: float
    val_success: float
    val_start: float
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
    cell: dict[str, Any] = field(default_factory=dict)
    finished: bool = True
    """The run wrote its final evaluation (``eval.jsonl`` tag ``end``)."""
    seed: int = 0
    """``run.seed``."""
    off_policy: str = "decoupled"
    """``algorithm.off_policy`` (the objective)."""
    optimizer_steps_per_batch: int = 1
    """``ppo_epochs * ceil(train_batch_size / mini_batch_size)``."""
    val_sampled: float = math.nan
    """Sampled validation success at the end (tag ``end_sampled``, ``run.eval_sampled``)."""
    val_sampled_start: float = math.nan
    """Sampled validation success before RL (tag ``start_sampled``)."""
    token_bound_ratio: float = math.nan
    """Share of policy tokens the turn-level token bound held, mean over steps (turn-level
    variants; 0 for token-level ones)."""
    behavior_weight_capped: float = math.nan
    """Share of policy tokens whose behaviour weight was above its cap, mean over steps
    (``off_policy = "decoupled"``; NaN for ``behavior``)."""


def run_stats(
    run_dir: Path,
    rule: CollapseRule,
    final_window: int = 10,
    cell_keys: tuple[str, ...] = CELL_KEYS,
) -> RunStats:
    """Read one run directory (``config.json``, ``steps.jsonl``, ``eval.jsonl``,
    ``consumed.jsonl``); ``cell_keys`` (dotted config keys) name its cell.

    Raises:
        FileNotFoundError: no ``config.json``.
    """
    cfg = json.loads((run_dir / "config.json").read_text())
    steps = read_jsonl(run_dir / "steps.jsonl", "step")
    evals = read_jsonl(run_dir / "eval.jsonl")
    end = [e for e in evals if e.get("tag") == "end"]
    begin = [e for e in evals if e.get("tag") == "start"]
    end_sampled = [e for e in evals if e.get("tag") == "end_sampled"]
    begin_sampled = [e for e in evals if e.get("tag") == "start_sampled"]
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
        val_start=float(begin[0]["success_rate"]) if begin else math.nan,
        collapsed=run_collapsed(steps, rule),
        clip_ratio=_mean(_series(steps, "clip_ratio")),
        approx_kl=_mean(_series(steps, "approx_kl")),
        token_log_ratio_max=max(
            _finite(_series(steps, "token_log_ratio_abs_max")), default=math.nan
        ),
        clip_bias_scale_mean=_mean(scale) if scale else 1.0,
        clip_bias_scale_min=min(scale) if scale else 1.0,
        token_bound_ratio=_mean(_series(steps, "token_bound_ratio")),
        behavior_weight_capped=_mean(_series(steps, "behavior_weight_capped")),
        exact_staleness=exact,
        consumed=consumed,
        success_curve=success,
        malformed_curve=_series(steps, "malformed_rate"),
        cell={k: _dotted(cfg, "run.label" if k == "method" else k) for k in cell_keys},
        finished=bool(end),
        seed=int(cfg["run"]["seed"]),
        off_policy=str(cfg["algorithm"].get("off_policy", "decoupled")),
        optimizer_steps_per_batch=optimizer_steps_per_batch(cfg["learner"]),
        val_sampled=float(end_sampled[-1]["success_rate"]) if end_sampled else math.nan,
        val_sampled_start=float(begin_sampled[0]["success_rate"]) if begin_sampled else math.nan,
    )


def optimizer_steps_per_batch(learner: dict[str, Any]) -> int:
    """Optimizer steps of one learner step: ``ppo_epochs`` passes of
    ``ceil(train_batch_size / mini_batch_size)`` mini-batches (``learner`` section of a
    ``config.json``)."""
    minis = math.ceil(int(learner["train_batch_size"]) / int(learner["mini_batch_size"]))
    return int(learner.get("ppo_epochs", 1)) * minis


def on_policy_reference(cell: dict[str, Any], cells: dict[tuple, list[RunStats]]) -> dict | None:
    """The staleness-0 cell a stale cell is compared with: the same cell at
    ``buffer.max_staleness = 0``, else (a grid that leaves the paper's objective out at
    staleness 0, where it is the same update) that cell with ``algorithm.off_policy =
    "decoupled"``, else (a grid that runs only ppo on-policy) that cell with
    ``algorithm.variant = "ppo"`` too. None for a staleness-0 cell, or when none ran."""
    if not cell.get("buffer.max_staleness"):
        return None
    for candidate in (
        {**cell, "buffer.max_staleness": 0},
        {**cell, "buffer.max_staleness": 0, "algorithm.off_policy": "decoupled"},
        {
            **cell,
            "buffer.max_staleness": 0,
            "algorithm.off_policy": "decoupled",
            "algorithm.variant": "ppo",
        },
    ):
        if _key(candidate) in cells:
            return candidate
    return None


def _key(cell: dict[str, Any]) -> tuple:
    return tuple(sorted((k, json.dumps(v)) for k, v in cell.items()))


def cell_summaries(runs: list[RunStats]) -> list[CellSummary]:
    """Group runs by their cell (in first-seen order) and summarise each.

    The probability of improvement compares a cell with the cell equal to it except
    ``algorithm.variant = "ppo"`` (NaN for ppo itself, or without such a cell or key).
    """
    cells: dict[tuple, list[RunStats]] = {}
    for r in runs:
        cells.setdefault(_key(r.cell), []).append(r)
    out = []
    for rs in cells.values():
        cell = rs[0].cell
        val = [r.val_success for r in rs]
        gain = [r.val_success - r.val_start for r in rs]
        sampled = [r.val_sampled for r in rs]
        sampled_gain = [r.val_sampled - r.val_sampled_start for r in rs]
        finals = [r.final_success for r in rs]
        is_ppo = cell.get("algorithm.variant") in ("ppo", None)
        ppo_runs = [] if is_ppo else cells.get(_key({**cell, "algorithm.variant": "ppo"}), [])
        ppo_val = [r.val_success for r in ppo_runs]
        reference = on_policy_reference(cell, cells)
        ref_val = [r.val_success for r in cells[_key(reference)]] if reference else []
        judged = [r.collapsed for r in rs if r.collapsed is not None]
        collapsed = sum(bool(c) for c in judged)
        consumed = sum(r.consumed for r in rs)
        out.append(
            CellSummary(
                cell=cell,
                variant=rs[0].variant,
                off_policy=rs[0].off_policy,
                max_staleness=rs[0].max_staleness,
                optimizer_steps_per_batch=rs[0].optimizer_steps_per_batch,
                runs=len(rs),
                seeds=[r.seed for r in rs],
                val_success_per_seed=val,
                final_success_per_seed=finals,
                steps_mean=_mean([float(r.steps) for r in rs]),
                val_success_iqm=iqm(val),
                val_success_iqm_ci=iqm_ci(val),
                val_success_mean=_mean(val),
                val_success_sd=_sd(val),
                val_start_mean=_mean([r.val_start for r in rs]),
                val_gain_mean=_mean(gain),
                val_gain_ci=mean_ci(gain),
                val_sampled_iqm=iqm(sampled),
                val_sampled_iqm_ci=iqm_ci(sampled),
                val_sampled_gain_mean=_mean(sampled_gain),
                val_sampled_gain_ci=mean_ci(sampled_gain),
                final_success_iqm=iqm(finals),
                final_success_iqm_ci=iqm_ci(finals),
                poi_vs_ppo=probability_of_improvement(val, ppo_val) if ppo_runs else math.nan,
                poi_vs_ppo_ci=poi_ci(val, ppo_val) if ppo_runs else (math.nan, math.nan),
                on_policy_cell=cell_label(reference) if reference else "",
                vs_on_policy=mean_difference(val, ref_val),
                vs_on_policy_ci=mean_difference_ci(val, ref_val),
                poi_vs_on_policy=probability_of_improvement(val, ref_val),
                poi_vs_on_policy_ci=poi_ci(val, ref_val),
                collapsed=collapsed,
                judged=len(judged),
                collapse_ci=wilson_ci(collapsed, len(judged)),
                clip_ratio=_mean([r.clip_ratio for r in rs]),
                approx_kl=_mean([r.approx_kl for r in rs]),
                token_log_ratio_max=_mean([r.token_log_ratio_max for r in rs]),
                clip_bias_scale_mean=_mean([r.clip_bias_scale_mean for r in rs]),
                clip_bias_scale_min=min(r.clip_bias_scale_min for r in rs),
                exact_staleness_share=sum(r.exact_staleness for r in rs) / consumed
                if consumed
                else math.nan,
                token_bound_ratio=_mean([r.token_bound_ratio for r in rs]),
                behavior_weight_capped=_mean([r.behavior_weight_capped for r in rs]),
            )
        )
    return out


def _f(v: float, digits: int = 3) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _ci(ci: tuple[float, float], digits: int = 2) -> str:
    return "" if any(math.isnan(v) for v in ci) else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def cell_label(cell: dict[str, Any]) -> str:
    """``variant / off_policy / staleness`` style label: the cell's values joined by ``/``."""
    return " / ".join(str(v) for v in cell.values())


def _sort_key(c: CellSummary) -> tuple:
    """Cells with the same values apart from the variant together, ppo first."""
    rest = [str(v) if not isinstance(v, int | float) else f"{v:012.6f}"
            for k, v in c.cell.items() if k != "algorithm.variant"]  # fmt: skip
    return (*rest, c.variant != "ppo", c.variant)


def cells_markdown(cells: list[CellSummary], rule: CollapseRule, final_window: int) -> str:
    """The per-cell table as markdown, with how to read it underneath."""
    keys = list(cells[0].cell) if cells else []
    head = (
        "| " + " | ".join(k.rsplit(".", 1)[-1] for k in keys) + " | runs | steps | opt steps "
        "per batch | val success IQM [95% CI] | val gain (end - start) mean [95% CI] | "
        "sampled val success IQM [95% CI] | sampled val gain mean [95% CI] | "
        "train success IQM [95% CI] | P(improve over ppo) [95% CI] | val vs staleness 0: "
        "mean diff [95% CI] | collapsed [Wilson 95%] | clip ratio | token bound | "
        "b capped | approx KL | scale s (mean / min) | exact lag |"
    )
    lines = [
        head,
        "|"
        + "---|" * len(keys)
        + "---:|---:|---:|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for c in sorted(cells, key=_sort_key):
        lines.append(
            "| " + " | ".join(str(v) for v in c.cell.values()) + f" | {c.runs} | "
            f"{c.steps_mean:.0f} | {c.optimizer_steps_per_batch} | "
            f"{_f(c.val_success_iqm)} {_ci(c.val_success_iqm_ci)} | "
            f"{_f(c.val_gain_mean)} {_ci(c.val_gain_ci)} | "
            f"{_f(c.val_sampled_iqm)} {_ci(c.val_sampled_iqm_ci)} | "
            f"{_f(c.val_sampled_gain_mean)} {_ci(c.val_sampled_gain_ci)} | "
            f"{_f(c.final_success_iqm)} {_ci(c.final_success_iqm_ci)} | "
            f"{_f(c.poi_vs_ppo, 2)} {_ci(c.poi_vs_ppo_ci)} | "
            f"{_f(c.vs_on_policy)} {_ci(c.vs_on_policy_ci)} | "
            f"{c.collapsed}/{c.judged} {_ci(c.collapse_ci)} | {_f(c.clip_ratio, 4)} | "
            f"{_f(c.token_bound_ratio, 4)} | {_f(c.behavior_weight_capped, 4)} | "
            f"{_f(c.approx_kl, 4)} | {_f(c.clip_bias_scale_mean)} / {_f(c.clip_bias_scale_min)} | "
            f"{_f(c.exact_staleness_share, 2)} |"
        )
    lines += [
        "",
        "Val success: greedy success on the held-out questions at the end of each run; IQM "
        "(mean of the middle 50% of seeds) with a 95% percentile-bootstrap interval over seeds. "
        "Val gain: end minus start of the same evaluation, mean over seeds, bootstrap interval. "
        "Sampled val: the same questions at the rollout temperature (run.eval_sampled; "
        "'-' where not measured), IQM and gain likewise. "
        f"Train success: training success over each run's last {final_window} steps, IQM. "
        "P(improve over ppo): probability that a run of this variant ends with higher val "
        "success than a ppo run of the same cell otherwise (ties count half), with a 95% "
        "stratified-bootstrap interval. Val vs staleness 0: mean val success of this cell minus "
        "that of the same cell at staleness 0 (with the decoupled objective where the grid "
        "leaves the paper's out at 0), with a 95% stratified-bootstrap interval. Collapsed: "
        f"smoothed ({rule.window} steps) success at least {rule.drop} below its best on each "
        f"of the last {rule.last_k} steps, or smoothed malformed share >= {rule.malformed}; "
        "Wilson interval. Clip ratio: fraction of tokens whose clip acted, mean over steps and "
        "seeds. Token bound: fraction of policy tokens the turn-level token bound held (turn "
        "variants). b capped: fraction of tokens whose behaviour weight exceeded its cap "
        "(decoupled objective). Exact lag: share of consumed trajectories at staleness min(step - 1, "
        "max_staleness).",
    ]
    return "\n".join(lines) + "\n"


def plot_intervals(cells: list[CellSummary], path: Path) -> Path:
    """Three panels, one row per cell: val-success IQM, probability of improvement over ppo
    and collapse rate, each a point with its 95% interval as an error bar (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(cells, key=_sort_key)
    labels = [cell_label(c.cell) for c in ordered]
    panels = (
        ("final val success (IQM)", "val_success_iqm", "val_success_iqm_ci", None),
        ("P(improvement over ppo)", "poi_vs_ppo", "poi_vs_ppo_ci", 0.5),
        ("collapse rate (Wilson)", None, "collapse_ci", None),
    )
    fig, axes = plt.subplots(1, 3, figsize=(14, 0.45 * len(ordered) + 1.6), sharey=True)
    y = list(range(len(ordered)))[::-1]
    for ax, (title, attr, ci_attr, ref) in zip(axes, panels, strict=True):
        for yi, c in zip(y, ordered, strict=True):
            value = (
                (c.collapsed / c.judged if c.judged else math.nan)
                if attr is None
                else getattr(c, attr)
            )
            low, high = getattr(c, ci_attr)
            if math.isnan(value):
                continue
            color = f"C{sorted({x.variant for x in ordered}).index(c.variant)}"
            err = [[value - low], [high - value]] if not math.isnan(low) else None
            ax.errorbar(value, yi, xerr=err, fmt="o", color=color, capsize=3)
        if ref is not None:
            ax.axvline(ref, color="grey", linestyle="--", linewidth=1)
        ax.set_xlim(-0.02, 1.02)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yticks(y, labels, fontsize=8)
    fig.suptitle("per cell, 95% intervals over seeds (bootstrap; Wilson for collapse)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ROWS: tuple[tuple[str, str], ...] = (
    ("success_curve", "training success"),
    ("malformed_curve", "malformed answers (share)"),
)
"""(RunStats curve, axis title): the figure's rows."""


def plot_cells(runs: list[RunStats], path: Path, window: int = 10) -> Path:
    """Success (top row) and malformed-answer share (bottom row) per learner step, smoothed
    over ``window`` steps: mean and ±1 sd band over seeds per line (the cell without its
    staleness: variant / objective), one column per staleness (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({r.max_staleness for r in runs})
    variants = list(dict.fromkeys(_line_label(r) for r in runs))
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


def _line_label(run: RunStats) -> str:
    """A run's line in the curve figure: its cell without the staleness (one panel each)."""
    rest = {k: v for k, v in run.cell.items() if k != "buffer.max_staleness"}
    return cell_label(rest) if rest else run.variant


def _plot_panel(ax, runs: list[RunStats], row: str, lag: int, variants: list[str], window: int):
    """One panel: ``row`` curves of the runs at staleness ``lag``, mean and ±1 sd per variant."""
    import numpy as np

    from services.plots import smooth

    for i, variant in enumerate(variants):
        curves = [smooth(getattr(r, row), window) for r in runs
                  if _line_label(r) == variant and r.max_staleness == lag and getattr(r, row)]  # fmt: skip
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
    run_dirs: list[Path],
    rule: CollapseRule,
    out_dir: Path,
    final_window: int = 10,
    cell_keys: tuple[str, ...] = CELL_KEYS,
) -> tuple[Path, Path, Path | None]:
    """``cells.json``, ``cells.md``, ``cells.png`` (curves) and ``cells_intervals.png``
    under ``out_dir`` from the finished runs (a ``config.json`` and a final evaluation; a
    run still in progress or stopped early would bias its cell and is only listed, as
    ``unfinished`` in ``cells.json``); returns the paths of the first three (figure None
    when no run has a step)."""
    started = [d for d in run_dirs if (d / "config.json").exists()]
    stats = [run_stats(d, rule, final_window, cell_keys) for d in started]
    runs = [r for r in stats if r.finished]
    unfinished = [d.name for d, r in zip(started, stats, strict=True) if not r.finished]
    cells = cell_summaries(runs)
    out_dir.mkdir(parents=True, exist_ok=True)

    def safe(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, tuple | list):
            return [safe(x) for x in v]
        return v

    rows = [{k: safe(v) for k, v in asdict(c).items()} for c in cells]
    json_path = out_dir / "cells.json"
    meta = {"final_window": final_window, "confidence": CONFIDENCE,
            "bootstrap": {"method": "percentile", "n_resamples": N_RESAMPLES, "seed": BOOTSTRAP_SEED},
            "collapse_rule": rule.model_dump()}  # fmt: skip
    meta["unfinished"] = unfinished
    json_path.write_text(json.dumps({**meta, "cells": rows}, indent=2) + "\n")
    md_path = out_dir / "cells.md"
    md_path.write_text(cells_markdown(cells, rule, final_window))
    with_steps = [r for r in runs if r.success_curve]
    figure = plot_cells(with_steps, out_dir / "cells.png") if with_steps else None
    if cells:
        plot_intervals(cells, out_dir / "cells_intervals.png")
    return json_path, md_path, figure
