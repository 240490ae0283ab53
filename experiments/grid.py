"""``stppo experiment NAME``: a named grid of training runs, then one summary and one figure.

A grid is a TOML file ``deploy/configs/experiments/<NAME>.toml`` (:class:`ExperimentSpec`):
a base run config, overrides applied to every run, the grid axes (dotted config keys, each
with a list of values), the seeds and the step budget. Every combination x seed is one
``services.driver.run_training`` call with its own run name, one after the other, under
``<output_dir>/<NAME>/``. With ``shared_warm_start``, the warm-start SFT runs once first
(run ``warm_start``: 0 learner steps, no evaluation) and every grid run starts from its
exported policy with SFT off, so all runs share one identical warm start. Then:

- ``summary.json`` and ``summary.md``: one row per run (:class:`RunSummary`): final and
  best validation success, training success, collapse yes/no (:func:`experiments.collapse.run_collapsed`),
  mean clip ratio, mean approx KL, mean clipping-bias norm, mean staleness, wall time;
- ``curves.png``: every run overlaid (:func:`services.plots.plot_runs`).

Collapse: :mod:`experiments.collapse` (the rule, :class:`CollapseRule`, and its detection).
"""

from __future__ import annotations

import importlib.resources
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from experiments import archive as run_archive
from experiments.collapse import CollapseRule, run_collapsed
from experiments.stability import write_cells
from learner.config import StrictModel
from services.config import ConfigError, RunConfig, _format_validation_error, load_config, read_toml
from services.run_records import clear_run_records

SOURCE_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "configs"
"""``deploy/configs`` of a source checkout."""


def _configs_dir() -> Path:
    """``deploy/configs`` as installed: the package data ``services/configs`` (a wheel, the
    container image; a link to ``deploy/configs`` in the source tree), else the source tree."""
    packaged = Path(str(importlib.resources.files("services") / "configs"))
    return packaged if (packaged / "experiments").is_dir() else SOURCE_CONFIGS_DIR


CONFIGS_DIR = _configs_dir()
"""The run configs shipped with the package (``deploy/configs``)."""

EXPERIMENTS_DIR = CONFIGS_DIR / "experiments"
"""Where named grids live (``<name>.toml``)."""


def resolve_base_config(path: Path | None) -> Path | None:
    """``base_config`` as written (relative to the working directory) if it exists there,
    else a ``deploy/configs/...`` path looked up in :data:`CONFIGS_DIR` (an installed package
    has no source tree)."""
    if path is None or path.exists() or path.parts[:2] != ("deploy", "configs"):
        return path
    return CONFIGS_DIR.joinpath(*path.parts[2:])


METHOD_AXIS = "method"
"""The grid axis whose values name :attr:`ExperimentSpec.methods` (read back from
``run.label``)."""


class MoreSeeds(StrictModel):
    """More seeds for the cells whose result is not yet told apart from the best.

    When every run of a leaderboard (the cells sharing a value of ``group_by``) has
    finished with the experiment's ``seeds``, its best cell is the one with the highest IQM
    of final greedy validation success; every cell whose 95% bootstrap interval overlaps the
    best cell's (the best included) gets ``seeds`` too (:func:`more_seed_points`), unless it
    matches an ``exclude`` entry.
    """

    seeds: list[int] = Field(min_length=1)
    """The additional ``run.seed`` values."""

    group_by: str = "buffer.max_staleness"
    """The grid axis that separates leaderboards (one best cell per value)."""

    exclude: list[dict[str, Any]] = Field(default_factory=list)
    """Grid points that get no more seeds even where their interval overlaps the best's: a
    point whose values match every ``dotted.key = value`` of any one entry (every key a grid
    axis). For a cell whose runs repeat another cell's: in the arena ``turn_ppo`` trains
    exactly as ``st_ppo`` while ST-PPO's scale stays 1 (``deploy/configs/experiments/arena.toml``).
    The excluded cell still counts when the best cell is chosen."""


class ExperimentSpec(StrictModel):
    """A named grid of runs (one TOML file under ``deploy/configs/experiments/``)."""

    description: str = ""
    """What the grid compares, for the summary."""

    base_config: Path | None = None
    """Run config every run starts from (relative to the working directory); None = defaults."""

    overrides: dict[str, Any] = Field(default_factory=dict)
    """``dotted.key -> value`` applied to every run after ``base_config``."""

    grid: dict[str, list[Any]] = Field(min_length=1)
    """``dotted.key -> values``; the runs are the cartesian product, in file order. The axis
    ``method`` takes names of :attr:`methods`."""

    methods: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Named bundles of overrides (``[methods.<name>]``, ``dotted.key -> value``): a run at
    ``method = <name>`` gets them after the grid's other values, and ``run.label = <name>``
    (the cell's name in the summaries). An off-policy correction is several keys at once
    (variant, objective, correction options): a method names the combination."""

    extra_points: list[dict[str, Any]] = Field(default_factory=list)
    """Grid points planned besides the cartesian product (after it), each giving a value
    for every axis, e.g. the on-policy reference ``{method = "ppo", "buffer.max_staleness"
    = 0}`` beside a product over stale levels."""

    more_seeds: MoreSeeds | None = None
    """Seeds added to the cells that need them once the first ``seeds`` have finished
    (:class:`MoreSeeds`)."""

    leaderboard: bool = False
    """Also write the per-staleness leaderboards of a ``method`` grid
    (:mod:`experiments.arena`): ``leaderboard.{json,md}`` and three figures."""

    baseline_method: str | None = None
    """The method the summaries compare every cell with at the same staleness
    (probability of improvement, relative step time); ``None``: ``algorithm.variant =
    ppo`` of the same cell otherwise."""

    exclude: list[dict[str, Any]] = Field(default_factory=list)
    """Grid points left out: a point whose values match every ``dotted.key = value`` of any
    one entry is not planned (e.g. ``{"algorithm.off_policy" = "behavior",
    "buffer.max_staleness" = 0}``, a cell the grid's other cells already cover). Every key
    must be a grid axis."""

    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """``run.seed`` of each repetition (the same seeds for every grid point)."""

    num_steps: int = Field(10, ge=1)
    """Learner steps of every run (the step budget)."""

    collapse: CollapseRule = CollapseRule()
    """The collapse rule of the summary."""

    max_run_s: float = Field(0.0, ge=0.0)
    """Wall-clock cap on each grid run's training loop in seconds (0 = none), counted from
    the first learner step's start of collection (after startup and the ``start``
    evaluation): after it the run starts no new learner step (the one in progress
    finishes), then checkpoints and evaluates as usual. A safety net for shared machines;
    a capped run logs fewer than ``num_steps`` steps and is not a finished grid run: it is
    not archived, the leaderboards leave it out, and the grid's next call runs it again."""

    shared_warm_start: bool = False
    """Run the warm start (the ``sft`` section, forced on) once, as run ``warm_start`` with 0
    learner steps and no evaluation, and start every grid run from its exported policy
    (``model.path`` = its ``hf_policy/``, ``sft.enabled = false``). The warm start uses the
    first seed. Grid runs then take that policy as their reference (KL) and critic backbone."""

    parallel_runs: int = Field(1, ge=1, le=16)
    """Grid runs at a time, each in a fresh process with its own local Ray cluster (its
    console output goes to ``<run_dir>/console.log``). With ``sync.fixed_lag`` a run's
    rollout and learner alternate, so one run keeps about one core busy: on the 2-core
    machine two at a time took 1.0 s per learner step each where one alone took 0.85 s
    (1.7x the grid's throughput). Runs start in plan order."""

    warm_start_overrides: dict[str, Any] = Field(default_factory=dict)
    """``dotted.key -> value`` for the shared warm start only (after ``overrides``), e.g. both
    cores for its learner, which runs alone: ``ray.num_cpus = 3`` and ``ray.learner_cpus =
    2`` (Ray gives an actor as many BLAS threads as CPUs; the idle rollout actor keeps 1)."""

    archive_dir: Path | None = None
    """Keep every finished run (and the shared warm start) in this directory, relative to
    the working directory, as one file per run meant to be committed with the source
    (:mod:`experiments.archive`): at the start of a sitting the archived runs are written
    back under the output directory and skipped, so the grid resumes on any machine with
    the checkout. None: the grid lives in its output directory alone."""

    seed_major: bool = False
    """Run order: every grid point's first seed, then every grid point's second seed...
    (True), instead of all seeds of one grid point before the next (False). A grid cut
    short then still covers every grid point."""

    cells: bool = False
    """Also summarise per grid point (the grid's keys name a cell) over its seeds
    (:mod:`experiments.stability`): ``cells.json``, ``cells.md`` (IQM of final validation and
    training success with bootstrap intervals, validation gain over the start, probability
    of improvement over ppo, collapse rate with a Wilson interval, clip ratio, approx KL,
    clip-bias scale, realised staleness), ``cells.png`` (success curves, mean and band over
    seeds, one panel per staleness) and ``cells_intervals.png`` (the intervals per cell)."""

    @model_validator(mode="after")
    def _check_methods(self) -> ExperimentSpec:
        named = [*self.grid.get(METHOD_AXIS, []), *(p.get(METHOD_AXIS) for p in self.extra_points)]
        if self.methods and METHOD_AXIS not in self.grid:
            raise ValueError(f"methods are given but the grid has no {METHOD_AXIS!r} axis")
        unknown = sorted({str(m) for m in named if m not in self.methods})
        if METHOD_AXIS in self.grid and unknown:
            raise ValueError(f"method(s) {unknown} have no [methods.<name>] table")
        if self.baseline_method is not None and self.baseline_method not in self.methods:
            raise ValueError(f"baseline_method {self.baseline_method!r} is not a method")
        for point in self.extra_points:
            if set(point) != set(self.grid):
                raise ValueError(
                    f"extra point {point} must give exactly the grid's axes {sorted(self.grid)}"
                )
        for method, overrides in self.methods.items():
            fixed = sorted(set(overrides) & {"run.label", *self.grid})
            if fixed:
                raise ValueError(f"method {method!r} sets {fixed}, which the grid sets")
        return self

    @field_validator("grid")
    @classmethod
    def _check_grid(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid axis {key!r} has no values")
            if key in ("run.seed", "run.num_steps", "run.name", "run.output_dir"):
                raise ValueError(f"grid axis {key!r} is set by the experiment itself")
        return grid

    @model_validator(mode="after")
    def _check_exclude(self) -> ExperimentSpec:
        more = self.more_seeds.exclude if self.more_seeds else []
        for where, entries in (("exclude", self.exclude), ("more_seeds.exclude", more)):
            for entry in entries:
                unknown = sorted(set(entry) - set(self.grid))
                if not entry or unknown:
                    raise ValueError(
                        f"{where} entry {entry} names no grid axis or not only: {unknown}"
                    )
        return self

    def excluded(self, point: dict[str, Any]) -> bool:
        """Whether the grid point ``point`` (``dotted.key -> value``) matches an ``exclude``
        entry."""
        return _matches(point, self.exclude)


def _matches(point: dict[str, Any], entries: list[dict[str, Any]]) -> bool:
    """Whether ``point`` has every ``key = value`` of some entry of ``entries``."""
    return any(all(point.get(k) == v for k, v in e.items()) for e in entries)


@dataclass
class PlannedRun:
    """One run of a grid: its name and its validated config."""

    name: str
    grid_values: dict[str, Any]
    seed: int
    config: RunConfig


@dataclass
class RunSummary:
    """One row of the experiment summary.

    Attributes:
        run: Run name.
        variant: ``algorithm.variant`` of the last step (the configured one if no step ran).
        max_staleness: ``buffer.max_staleness`` of the run.
        seed: ``run.seed``.
        num_steps: Learner steps logged in ``steps.jsonl``.
        val_success_start: Validation success after the warm start, before RL (NaN if absent).
        val_success_final: Validation success at the end (NaN if absent).
        val_success_best: Best validation success from the RL start on (NaN if none).
        train_success_first: Training-batch success of step 1.
        train_success_last: Training-batch success of the last step.
        train_success_best: Best training-batch success of any step.
        collapsed: :func:`run_collapsed` (None = too short to judge).
        clip_ratio_mean: Mean over steps of ``clip_ratio`` (fraction of masked tokens clipped).
        approx_kl_mean: Mean over steps of ``approx_kl`` (nats/token).
        clip_bias_norm_mean: Mean over steps of ``clip_bias_norm`` (NaN when not logged).
        staleness_mean: Mean over steps of ``staleness_mean`` (learner steps).
        wall_s: ``elapsed_s`` of the last step (seconds since the driver started).
    """

    run: str
    variant: str
    max_staleness: int
    seed: int
    num_steps: int
    val_success_start: float
    val_success_final: float
    val_success_best: float
    train_success_first: float
    train_success_last: float
    train_success_best: float
    collapsed: bool | None
    clip_ratio_mean: float
    approx_kl_mean: float
    clip_bias_norm_mean: float
    staleness_mean: float
    wall_s: float


# --------------------------------------------------------------------------- the grid


def experiment_path(name: str, experiments_dir: Path = EXPERIMENTS_DIR) -> Path:
    """``<experiments_dir>/<name>.toml``.

    Raises:
        ConfigError: no such file (the message lists the known names).
    """
    path = experiments_dir / f"{name}.toml"
    if not path.exists():
        known = sorted(p.stem for p in experiments_dir.glob("*.toml"))
        raise ConfigError(f"no experiment {name!r} in {experiments_dir}; known: {known}")
    return path


def load_experiment(path: Path) -> ExperimentSpec:
    """Read and validate an experiment TOML.

    Raises:
        ConfigError: missing file, bad TOML or an invalid field (named).
    """
    from pydantic import ValidationError

    try:
        return ExperimentSpec.model_validate(read_toml(path))
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, str(path))) from None


def run_name(grid_values: dict[str, Any], seed: int) -> str:
    """``<last key part>-<value>`` per axis, then ``seed-<seed>``, joined by ``_``.

    Example: ``run_name({"algorithm.variant": "ppo", "buffer.max_staleness": 4}, 0)
    == "variant-ppo_max_staleness-4_seed-0"``.
    """
    parts = [f"{key.rsplit('.', 1)[-1]}-{value}" for key, value in grid_values.items()]
    return "_".join([*parts, f"seed-{seed}"])


WARM_START_RUN = "warm_start"
"""Run name of the shared warm start (:attr:`ExperimentSpec.shared_warm_start`)."""


def warm_start_policy_dir(spec: ExperimentSpec, name: str, output_dir: Path) -> Path:
    """Where the shared warm start's policy is exported: its only checkpoint (step 0)."""
    return output_dir / name / WARM_START_RUN / "checkpoints" / "step_000000" / "hf_policy"


def plan_warm_start(
    spec: ExperimentSpec, name: str, output_dir: Path, extra_overrides: list[str] | None = None
) -> PlannedRun | None:
    """The shared warm-start run (None unless ``spec.shared_warm_start``): the grid's common
    overrides, then ``spec.warm_start_overrides``, SFT on, 0 learner steps, no evaluation,
    the first seed.

    Raises:
        ConfigError: the config does not validate.
    """
    if not spec.shared_warm_start:
        return None
    seed = spec.seeds[0]
    fixed = {
        "run.name": WARM_START_RUN,
        "run.output_dir": str(output_dir / name),
        "run.seed": seed,
        "run.num_steps": 0,
        "run.eval_questions": 0,
        "sft.enabled": True,
    }
    cfg = _load_run_config(spec, WARM_START_RUN, spec.warm_start_overrides, extra_overrides, fixed)
    return PlannedRun(WARM_START_RUN, {}, seed, cfg)


def _load_run_config(
    spec: ExperimentSpec,
    rname: str,
    grid_values: dict[str, Any],
    extra_overrides: list[str] | None,
    fixed: dict[str, Any],
) -> RunConfig:
    """``spec.base_config`` with, later layers winning: ``spec.overrides``, the grid point,
    ``extra_overrides`` (``dotted.key=value`` strings), then ``fixed``.

    Raises:
        ConfigError: the config does not validate (the message names the run).
    """
    overrides = [f"{k}={_toml_value(v)}" for k, v in spec.overrides.items()]
    overrides += [f"{k}={_toml_value(v)}" for k, v in _point_overrides(spec, grid_values).items()]
    overrides += list(extra_overrides or [])
    overrides += [f"{k}={_toml_value(v)}" for k, v in fixed.items()]
    try:
        return load_config(resolve_base_config(spec.base_config), overrides)
    except ConfigError as e:
        raise ConfigError(f"run {rname}: {e}") from None


def _point_overrides(spec: ExperimentSpec, point: dict[str, Any]) -> dict[str, Any]:
    """A grid point's ``dotted.key -> value`` overrides: its values, with a ``method``
    replaced by ``run.label = <method>`` and the method's own overrides after them."""
    out = {k: v for k, v in point.items() if k != METHOD_AXIS}
    if METHOD_AXIS in point:
        out["run.label"] = point[METHOD_AXIS]
        out.update(spec.methods[point[METHOD_AXIS]])
    return out


def grid_points(spec: ExperimentSpec) -> list[dict[str, Any]]:
    """The grid's points in plan order: the cartesian product (file order) without the
    ``exclude`` matches, then ``extra_points``."""
    keys = list(spec.grid)
    points = [dict(zip(keys, v, strict=True)) for v in itertools.product(*spec.grid.values())]
    points = [p for p in points if not spec.excluded(p)]
    return points + [p for p in spec.extra_points if p not in points]


def plan_runs(
    spec: ExperimentSpec,
    name: str,
    output_dir: Path,
    extra_overrides: list[str] | None = None,
    *,
    more_seeds: bool = True,
) -> list[PlannedRun]:
    """Every grid point x seed as a validated config (nothing runs yet).

    Grid points matching an ``exclude`` entry are left out, ``extra_points`` added. Each run
    gets ``run.name`` from :func:`run_name`, ``run.output_dir = output_dir/name``,
    ``run.seed`` and ``run.num_steps = spec.num_steps`` (and, with ``shared_warm_start``,
    ``model.path`` = :func:`warm_start_policy_dir` and ``sft.enabled = false``);
    ``extra_overrides`` (``dotted.key=value`` strings) come last, before those. With
    ``more_seeds`` and :attr:`ExperimentSpec.more_seeds`, the runs of the additional seeds
    follow for the cells that need them (:func:`more_seed_points`, decided from the
    finished runs on disk; none while a leaderboard's first seeds are unfinished).

    Raises:
        ConfigError: a combination does not validate (the message names the run).
    """
    points = grid_points(spec)
    if spec.seed_major:
        order = [(point, seed) for seed in spec.seeds for point in points]
    else:
        order = [(point, seed) for point in points for seed in spec.seeds]
    planned = _planned(spec, name, output_dir, extra_overrides, order)
    if more_seeds and spec.more_seeds is not None:
        extra = more_seed_points(spec, planned)
        order = [(point, seed) for seed in spec.more_seeds.seeds for point in extra]
        planned += _planned(spec, name, output_dir, extra_overrides, order)
    return planned


def parse_only(spec: ExperimentSpec, only: list[str]) -> dict[str, list[Any]]:
    """``["method=ppo", "method=gspo", "seed=0"]`` -> ``{"method": ["ppo", "gspo"], "seed":
    [0]}`` (values parsed as TOML, else kept as strings): a run is selected when, for every
    key, its value is one of the listed ones.

    Raises:
        ConfigError: an item without ``=`` or whose key is neither a grid axis nor ``seed``.
    """
    import tomllib

    selection: dict[str, list[Any]] = {}
    for item in only:
        key, sep, raw = item.partition("=")
        if not sep or (key not in spec.grid and key != "seed"):
            raise ConfigError(
                f"--only {item!r}: expected AXIS=VALUE with AXIS one of {[*spec.grid, 'seed']}"
            )
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        selection.setdefault(key, []).append(value)
    return selection


def select_runs(planned: list[PlannedRun], only: dict[str, list[Any]]) -> list[PlannedRun]:
    """The planned runs whose grid values (and ``seed``) are, for every key of ``only``,
    one of its values."""
    return [
        r
        for r in planned
        if all({**r.grid_values, "seed": r.seed}.get(k) in v for k, v in only.items())
    ]


def final_val_success(run_dir: Path) -> float | None:
    """Greedy validation success of a run's final evaluation (``eval.jsonl`` tag ``end``);
    None while the run has not finished."""
    end = [e for e in read_jsonl(run_dir / "eval.jsonl") if e.get("tag") == "end"]
    return float(end[-1]["success_rate"]) if end else None


def more_seed_points(spec: ExperimentSpec, planned: list[PlannedRun]) -> list[dict[str, Any]]:
    """The grid points that get :attr:`ExperimentSpec.more_seeds`: per value of its
    ``group_by`` axis (a leaderboard) whose planned runs have all finished, every point
    whose 95% bootstrap interval of the IQM of final validation success overlaps the best
    point's (the highest IQM; the best included). In plan order."""
    from experiments.stability import iqm, iqm_ci

    rule = spec.more_seeds
    if rule is None:
        return []
    values: dict[str, list[float | None]] = {}
    points: dict[str, dict[str, Any]] = {}
    for run in planned:
        key = json.dumps(run.grid_values, sort_keys=True)
        points[key] = run.grid_values
        values.setdefault(key, []).append(final_val_success(run.config.run_dir))
    chosen: set[str] = set()
    groups = {json.dumps(p.get(rule.group_by)) for p in points.values()}
    for group in groups:
        keys = [k for k, p in points.items() if json.dumps(p.get(rule.group_by)) == group]
        if any(v is None for k in keys for v in values[k]):
            continue  # a leaderboard is judged once all its first seeds have finished
        stats = {k: (iqm(values[k]), iqm_ci(values[k])) for k in keys}  # type: ignore[arg-type]
        best = max(keys, key=lambda k: stats[k][0])
        best_low, best_high = stats[best][1]
        for k in keys:
            low, high = stats[k][1]
            if high >= best_low and low <= best_high:
                chosen.add(k)
    return [p for k, p in points.items() if k in chosen and not _matches(p, rule.exclude)]


def _planned(
    spec: ExperimentSpec,
    name: str,
    output_dir: Path,
    extra_overrides: list[str] | None,
    order: list[tuple[dict[str, Any], int]],
) -> list[PlannedRun]:
    planned = []
    shared: dict[str, Any] = {}
    if spec.shared_warm_start:
        shared = {
            "model.path": str(warm_start_policy_dir(spec, name, output_dir)),
            "sft.enabled": False,
        }
    for grid_values, seed in order:
        rname = run_name(grid_values, seed)
        fixed = {
            "run.name": rname,
            "run.output_dir": str(output_dir / name),
            "run.seed": seed,
            "run.num_steps": spec.num_steps,
            **shared,
        }
        cfg = _load_run_config(spec, rname, grid_values, extra_overrides, fixed)
        planned.append(PlannedRun(rname, grid_values, seed, cfg))
    return planned


def _toml_value(value: Any) -> str:
    """A value as TOML source for a ``key=value`` override (JSON is valid TOML for these)."""
    return json.dumps(value)


# --------------------------------------------------------------------------- summary


def read_jsonl(path: Path, step_key: str | None = None) -> list[dict[str, Any]]:
    """Records of a run's JSONL file ([] when the file does not exist), checked to hold one
    run and, with ``step_key``, each step once (:func:`services.run_records.read_records`).

    Raises:
        ValueError: the file mixes runs or repeats a step.
    """
    from services.run_records import read_records

    return read_records(path, step_key)


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) if isinstance(r.get(key), int | float) else math.nan for r in records]


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _max(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def summarize_run(run_dir: Path, rule: CollapseRule, seed: int = 0) -> RunSummary:
    """Summarise one finished (or partial) run from its ``steps.jsonl``, ``eval.jsonl`` and
    ``config.json``.

    Validation success: ``eval.jsonl`` records tagged ``start`` (after any warm start,
    before RL) and ``end``; "best" is over every record except ``before_warm_start``.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``config.json`` (not a run directory).
    """
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: is {run_dir} a run directory?")
    cfg = json.loads(config_path.read_text())
    steps = read_jsonl(run_dir / "steps.jsonl", "step")
    evals = read_jsonl(run_dir / "eval.jsonl")
    by_tag = {e.get("tag"): e for e in evals}
    rl_evals = [e for e in evals if e.get("tag") != "before_warm_start"]
    train = _series(steps, "success_rate")
    return RunSummary(
        run=run_dir.name,
        variant=str(steps[-1]["variant"]) if steps else str(cfg["algorithm"]["variant"]),
        max_staleness=int(cfg["buffer"]["max_staleness"]),
        seed=int(cfg["run"].get("seed", seed)),
        num_steps=len(steps),
        val_success_start=float(by_tag.get("start", {}).get("success_rate", math.nan)),
        val_success_final=float(by_tag.get("end", {}).get("success_rate", math.nan)),
        val_success_best=_max(_series(rl_evals, "success_rate")),
        train_success_first=train[0] if train else math.nan,
        train_success_last=train[-1] if train else math.nan,
        train_success_best=_max(train),
        collapsed=run_collapsed(steps, rule),
        clip_ratio_mean=_mean(_series(steps, "clip_ratio")),
        approx_kl_mean=_mean(_series(steps, "approx_kl")),
        clip_bias_norm_mean=_mean(_series(steps, "clip_bias_norm")),
        staleness_mean=_mean(_series(steps, "staleness_mean")),
        wall_s=float(steps[-1].get("elapsed_s", math.nan)) if steps else math.nan,
    )


SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("run", "run"),
    ("variant", "variant"),
    ("max_staleness", "max staleness"),
    ("seed", "seed"),
    ("num_steps", "steps"),
    ("val_success_start", "val success (RL start)"),
    ("val_success_final", "val success (final)"),
    ("val_success_best", "val success (best)"),
    ("train_success_first", "train success (step 1)"),
    ("train_success_last", "train success (last)"),
    ("collapsed", "collapse"),
    ("clip_ratio_mean", "clip ratio (mean)"),
    ("approx_kl_mean", "approx KL (mean)"),
    ("clip_bias_norm_mean", "||C|| (mean)"),
    ("staleness_mean", "staleness (mean)"),
    ("wall_s", "wall s"),
)
"""(RunSummary field, markdown header), in table order."""


def format_cell(value: Any) -> str:
    """Markdown cell text: ``yes``/``no``/``n/a`` for collapse, 3 decimals for floats,
    ``-`` for NaN."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def summary_markdown(summaries: list[RunSummary], rule: CollapseRule) -> str:
    """The summary as a markdown table, with the collapse rule stated under it."""
    header = [title for _, title in SUMMARY_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        lines.append(
            "| " + " | ".join(format_cell(getattr(s, f)) for f, _ in SUMMARY_COLUMNS) + " |"
        )
    lines.append("")
    lines.append(
        f"Collapse: the last {rule.last_k} steps of {' or '.join(rule.metrics)} (moving average "
        f"of {rule.window}) all more than {rule.drop} below the best earlier value; "
        f"n/a = fewer than {rule.last_k + 1} steps."
    )
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def write_summary(
    summaries: list[RunSummary], rule: CollapseRule, out_dir: Path, extra: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``summary.json`` (NaN as null) and ``summary.md`` under ``out_dir``; returns
    their paths ``(json, markdown)``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{k: _json_safe(v) for k, v in asdict(s).items()} for s in summaries]
    payload = {**extra, "collapse_rule": rule.model_dump(), "runs": rows}
    json_path = out_dir / "summary.json"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path = out_dir / "summary.md"
    md_path.write_text(summary_markdown(summaries, rule))
    return json_path, md_path


# --------------------------------------------------------------------------- running


@dataclass
class ExperimentResult:
    """What :func:`run_experiment` produced."""

    summaries: list[RunSummary]
    summary_json: Path
    summary_md: Path
    figure: Path | None
    wall_s: float
    cells_md: Path | None = None


def run_experiment(
    name: str,
    output_dir: Path = Path("runs/experiments"),
    extra_overrides: list[str] | None = None,
    experiments_dir: Path = EXPERIMENTS_DIR,
    skip_finished: bool = True,
    max_run_s: float | None = None,
    only: dict[str, list[Any]] | None = None,
    use_archive: bool = True,
) -> ExperimentResult:
    """Run every planned run of experiment ``name`` in turn, then summarise and plot.

    A run whose directory already holds a final ``eval.jsonl`` record (tag ``end``) is not
    run again when ``skip_finished`` (so an interrupted grid continues where it stopped).
    ``max_run_s`` replaces the spec's :attr:`ExperimentSpec.max_run_s` when given. ``only``
    (:func:`parse_only`) runs the matching planned runs alone; the summary covers every run
    started so far. With the spec's :attr:`ExperimentSpec.archive_dir` (and ``use_archive``)
    the archived runs are restored first and every run is archived as it finishes; an
    archived run is never replaced, so ``skip_finished=False`` reruns archived runs without
    archiving the reruns (pass ``use_archive=False`` for a grid of one's own).

    Raises:
        ConfigError: unknown experiment or invalid config.
    """
    spec = load_experiment(experiment_path(name, experiments_dir))
    cap_s = spec.max_run_s if max_run_s is None else max_run_s
    warm = plan_warm_start(spec, name, output_dir, extra_overrides)
    start = time.perf_counter()
    archive = _Archive(spec, name, output_dir, warm) if spec.archive_dir and use_archive else None
    if warm is not None:
        if archive is not None:
            archive.restore_warm_start()
        _run_warm_start(warm, warm_start_policy_dir(spec, name, output_dir), skip_finished)
    done: set[str] = set()
    # round 1: the first seeds (and more_seeds already decided by an earlier sitting);
    # round 2: more_seeds for the cells the finished first seeds leave undecided
    for _ in range(2 if spec.more_seeds else 1):
        if archive is not None:
            archive.sync(plan_runs(spec, name, output_dir, extra_overrides))
        planned = select_runs(plan_runs(spec, name, output_dir, extra_overrides), only or {})
        todo = _unfinished(planned, name, skip_finished, done)
        if not todo:
            break
        done.update(run.name for _, run in todo)
        on_finished = archive.add if archive is not None else None
        _run_all(todo, cap_s, spec.parallel_runs, start, on_finished)
    result = summarize_experiment(
        name, output_dir, extra_overrides, experiments_dir, cap_s, use_archive=use_archive
    )
    result.wall_s = time.perf_counter() - start
    return result


def _unfinished(
    planned: list[PlannedRun], name: str, skip_finished: bool, done: set[str]
) -> list[tuple[str, PlannedRun]]:
    """The planned runs still to run, labelled for the console: not run in this call
    (``done``), and not complete before (with ``skip_finished``;
    :func:`experiments.archive.is_complete`). A partial run's records are cleared (it
    restarts from scratch), and so are those of a run the time cap stopped early."""
    todo = []
    for i, run in enumerate(planned, 1):
        run_dir = run.config.run_dir
        label = f"[experiment {name}] {i}/{len(planned)} {run.name}"
        if run.name in done:
            continue
        if skip_finished and run_archive.is_complete(run_dir):
            print(f"{label}: finished before, skipped")
            continue
        if skip_finished and final_val_success(run_dir) is not None:
            steps, of = run_archive.steps_done(run_dir)
            print(f"{label}: stopped by the time cap at step {steps} of {of}: runs again")
        if run_dir.exists():
            clear_run_records(run_dir)
        todo.append((label, run))
    return todo


def _run_all(
    todo: list[tuple[str, PlannedRun]],
    cap_s: float,
    parallel_runs: int,
    start: float,
    on_finished: Callable[[PlannedRun], None] | None = None,
) -> None:
    """Run ``todo`` one after the other in this process, or ``parallel_runs`` at a time in
    child processes (:func:`_run_in_processes`); ``on_finished`` is called with each run
    that finished without error, as it finishes."""
    if parallel_runs == 1:
        for label, run in todo:
            print(f"{label}: {run.grid_values} seed {run.seed}")
            try:
                train_with_time_cap(run.config, cap_s)
            finally:
                _detach_run_log(run.config.run_dir)
            if on_finished is not None:
                on_finished(run)
    else:
        _run_in_processes(todo, cap_s, parallel_runs, start, on_finished)


def summarize_experiment(
    name: str,
    output_dir: Path = Path("runs/experiments"),
    extra_overrides: list[str] | None = None,
    experiments_dir: Path = EXPERIMENTS_DIR,
    max_run_s: float | None = None,
    use_archive: bool = True,
    only: dict[str, list[Any]] | None = None,
) -> ExperimentResult:
    """Write ``summary.json``, ``summary.md`` and ``curves.png`` of experiment ``name`` from
    the run directories as they are now (runs not started yet are left out; a run in
    progress is summarised up to its last logged step), after restoring the archived runs
    (:attr:`ExperimentSpec.archive_dir`, unless ``use_archive`` is False). ``only``
    (:func:`parse_only`) summarises a slice of the planned runs, e.g. the first stage's
    seeds of a grid whose ten-seed stage is under way.

    Raises:
        ConfigError: unknown experiment or invalid config.
    """
    from services.plots import plot_runs

    spec = load_experiment(experiment_path(name, experiments_dir))
    warm = plan_warm_start(spec, name, output_dir, extra_overrides)
    planned = plan_runs(spec, name, output_dir, extra_overrides)
    archive = _Archive(spec, name, output_dir, warm) if spec.archive_dir and use_archive else None
    if archive is not None:
        archive.restore_warm_start()
        # the second stage (more_seeds) is planned from the first stage's restored results
        for _ in range(2 if spec.more_seeds else 1):
            archive.sync(planned)
            planned = plan_runs(spec, name, output_dir, extra_overrides)
    if only:
        planned = select_runs(planned, only)
    provenance = run_archive.provenance(archive.dir, (r.name for r in planned)) if archive else None
    started = [r for r in planned if (r.config.run_dir / "config.json").exists()]
    summaries = [summarize_run(r.config.run_dir, spec.collapse, r.seed) for r in started]
    extra = {
        "experiment": name,
        "description": spec.description,
        "num_steps": spec.num_steps,
        "seeds": spec.seeds,
        "more_seeds": spec.more_seeds.model_dump() if spec.more_seeds else None,
        "grid": spec.grid,
        "methods": spec.methods,
        "extra_points": spec.extra_points,
        "max_run_s": spec.max_run_s if max_run_s is None else max_run_s,
        "parallel_runs": spec.parallel_runs,
        "only": only or None,
        "archive_dir": str(spec.archive_dir) if provenance else None,
        "archived": asdict(provenance) if provenance else None,
        "runs_planned": [r.name for r in planned],
        "warm_start": read_jsonl(warm.config.run_dir / "sft.jsonl") if warm else None,
    }
    out_dir = output_dir / name
    json_path, md_path = write_summary(summaries, spec.collapse, out_dir, extra)
    with_steps = [r.config.run_dir for r, s in zip(started, summaries, strict=True) if s.num_steps]
    figure = plot_runs(with_steps, out_dir / "curves.png") if with_steps else None
    cells_md = None
    if spec.cells:
        run_dirs = [r.config.run_dir for r in started]
        _, cells_md, _ = write_cells(run_dirs, spec.collapse, out_dir, cell_keys=tuple(spec.grid))
    if spec.leaderboard:
        from experiments.arena import write_leaderboards

        run_dirs = [r.config.run_dir for r in started]
        write_leaderboards(
            run_dirs, spec.collapse, out_dir, baseline=spec.baseline_method, extra=extra
        )
    return ExperimentResult(summaries, json_path, md_path, figure, 0.0, cells_md)


class _Archive:
    """A grid's :attr:`ExperimentSpec.archive_dir` (:mod:`experiments.archive`), bound to
    its output directory and warm start."""

    def __init__(
        self, spec: ExperimentSpec, name: str, output_dir: Path, warm: PlannedRun | None
    ) -> None:
        assert spec.archive_dir is not None
        self.dir = spec.archive_dir
        self.warm = warm
        self.policy_dir = warm_start_policy_dir(spec, name, output_dir) if warm else None
        self._sha256: str | None = None  # of the local warm start, once it is archived

    def restore_warm_start(self) -> None:
        """Write the archived warm start back unless this machine has it (it then skips
        the SFT); nothing without a shared warm start."""
        if self.warm is None or self.policy_dir is None:
            return
        if run_archive.restore_warm_start(self.dir, self.warm.config.run_dir, self.policy_dir):
            print(f"[experiment] shared warm start restored from {self.dir}", flush=True)

    def _digest(self) -> str | None:
        """The grid's warm start digest, archiving the warm start first if it is new (the
        archived one's while this machine has none; None without a shared warm start).
        Computed once the local warm start exists: it does not change within a grid."""
        if self.warm is None or self.policy_dir is None:
            return None
        if self._sha256 is not None:
            return self._sha256
        if not (self.policy_dir / "config.json").exists():
            return run_archive.archived_warm_start_digest(self.dir)
        run_archive.archive_warm_start(self.warm.config.run_dir, self.policy_dir, self.dir)
        self._sha256 = run_archive.policy_digest(self.policy_dir)
        return self._sha256

    def sync(self, planned: list[PlannedRun]) -> None:
        """Archive the planned runs finished here and not archived yet, then restore the
        archived ones not finished here."""
        digest = self._digest()
        run_dirs = [run.config.run_dir for run in planned]
        run_archive.archive_finished(self.dir, run_dirs, digest)
        restored = run_archive.restore_runs(self.dir, run_dirs, digest)
        if restored:
            print(f"[experiment] {len(restored)} finished run(s) restored from {self.dir}")

    def add(self, run: PlannedRun) -> None:
        """Archive ``run``, which has just finished (not when the time cap stopped it early:
        the grid's next call runs it again)."""
        done, planned = run_archive.steps_done(run.config.run_dir)
        if done < planned:
            print(f"[experiment] {run.name} not archived: the time cap stopped it at step "
                  f"{done} of {planned}", flush=True)  # fmt: skip
            return
        path = run_archive.archive_run(run.config.run_dir, self.dir, self._digest())
        print(f"[experiment] {run.name} archived in {path}", flush=True)


def train_with_time_cap(cfg: RunConfig, max_run_s: float) -> Any:
    """``services.driver.Driver(cfg, max_train_s=max_run_s).run()``: a cap on the training
    loop (0 = none), counted from the loop's start (after startup, warm start and the
    ``start`` evaluation); the step in progress finishes and the run checkpoints and
    evaluates as usual. Returns the driver's final state.
    """
    from services.driver import Driver

    return Driver(cfg, max_train_s=max_run_s).run()


def _train_in_child(config: dict[str, Any], max_run_s: float, console_log: str) -> None:
    """One grid run in a pool process: its stdout and stderr (and those of the processes it
    starts) go to ``console_log``, then :func:`train_with_time_cap`.

    Raises:
        RuntimeError: the run failed; the message is the original error's type and text,
            its traceback is in ``console_log`` (Ray's exceptions, e.g. ``RayTaskError(
            OSError)``, are classes made at run time that do not pickle back to the parent).
    """
    import os
    import sys
    import traceback

    fd = os.open(console_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        train_with_time_cap(RunConfig.model_validate(config), max_run_s)
    except BaseException as e:
        traceback.print_exc()
        sys.stderr.flush()
        first = str(e).strip().splitlines()[:1]
        raise RuntimeError(f"{type(e).__name__}: {first[0] if first else ''}") from None


def _run_in_processes(
    todo: list[tuple[str, PlannedRun]],
    max_run_s: float,
    workers: int,
    start: float,
    on_finished: Callable[[PlannedRun], None] | None = None,
) -> None:
    """Run ``todo`` ``workers`` at a time, each in a fresh spawned process
    (:func:`_train_in_child`), starting them in order; ``on_finished`` is called (in this
    process) with each run that finished without error.

    Raises:
        RuntimeError: a run failed (the runs already started finish first; none starts
            after), naming the run and its ``console.log``.
    """
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1) as pool:
        pending: dict[Any, tuple[str, PlannedRun]] = {}
        queue = list(todo)
        failed: list[str] = []
        while queue or pending:
            while queue and len(pending) < workers and not failed:
                label, run = queue.pop(0)
                run.config.run_dir.mkdir(parents=True, exist_ok=True)
                log = run.config.run_dir / "console.log"
                print(f"{label}: {run.grid_values} seed {run.seed} (output: {log})", flush=True)
                config = run.config.model_dump(mode="json")
                pending[pool.submit(_train_in_child, config, max_run_s, str(log))] = (label, run)
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                label, run = pending.pop(future)
                error = future.exception()
                elapsed = time.perf_counter() - start
                if error is None:
                    print(f"{label}: finished ({elapsed / 60:.1f} min into the grid)", flush=True)
                    if on_finished is not None:
                        on_finished(run)
                else:
                    failed.append(f"{label}: {type(error).__name__}: {error} "
                                  f"(see {run.config.run_dir / 'console.log'})")  # fmt: skip
                    print(failed[-1], flush=True)
    if failed:
        raise RuntimeError("grid run(s) failed: " + "; ".join(failed))


def _run_warm_start(warm: PlannedRun, policy_dir: Path, skip_finished: bool) -> None:
    """Run the shared warm start unless its policy export exists (and ``skip_finished``).

    Raises:
        RuntimeError: the run finished without exporting ``policy_dir``.
    """
    from services.driver import run_training

    if skip_finished and (policy_dir / "config.json").exists():
        print(f"[experiment] shared warm start exported before: {policy_dir}")
        return
    if warm.config.run_dir.exists():
        clear_run_records(warm.config.run_dir)
    print(f"[experiment] shared warm start -> {policy_dir}")
    try:
        run_training(warm.config)
    finally:
        _detach_run_log(warm.config.run_dir)
    if not (policy_dir / "config.json").exists():
        raise RuntimeError(f"the warm start did not export its policy to {policy_dir}")


def _detach_run_log(run_dir: Path) -> None:
    """Close the driver's ``driver.log`` handler of ``run_dir``, so the next run of the grid
    (same process) does not also write into this run's log."""
    import logging

    logger = logging.getLogger("stppo")
    for handler in list(logger.handlers):
        path = getattr(handler, "baseFilename", None)
        if path is not None and Path(path).parent == run_dir.resolve():
            logger.removeHandler(handler)
            handler.close()
