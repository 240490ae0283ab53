"""Re-run arena cells with the stability guard acting, and compare them with their archived runs.

The replay (:mod:`experiments.guard_replay`) shows when the guard would have acted on the
arena's archived runs; those runs went on unchanged. This module re-runs a cell (method x
staleness) of a grid with an archive (the off-policy arena, ``deploy/configs/experiments/
arena.toml``) with the same config and seeds as its archived runs, plus overrides
(:data:`ACT_OVERRIDES`: ``guard.mode = "act"``, and checkpoints every 5 steps, since the
arena's runs checkpoint only at their end and a rollback needs a checkpoint before the
signal began), then sets each re-run beside the archived run of its seed:

- the run: final greedy success, *ended low* / *degrading at the end* / *fell* by the
  arena's own definitions (as :mod:`experiments.guard_replay` applies them, with the
  threshold of the archive's on-policy runs), and whether the guard stopped it;
- the guard's actions (``guard.jsonl``: step, rule, ladder step, rollback from / to);
- time: the run's wall time (``config.json`` to the final evaluation, as the archive
  measures it), the learner steps a rollback threw away and their time, the time from
  the step that triggered a rollback to the start of the next step (the rollback itself
  and the checkpoint after it), and how much longer the first step after it took;
- whether the re-run repeated the archived run before its first rollback (the same
  sampled rollouts, :data:`COMPARED_KEYS`), i.e. whether the guard is the only difference;

and per cell the ended-low and fell counts with the guard and without it (the archived
runs of the seeds re-run; the whole cell's count beside them), with Fisher's exact test
(two-sided).

The runs use the grid's own planning (:func:`experiments.grid.plan_runs`: base config,
the grid's overrides, the method, the seed, the archived shared warm start restored into
the output directory), one at a time in this process, and are never archived. A run the
guard stops (:class:`services.run_records.GuardStopped`) ends like a finished one and is
kept as it is. ``stppo experiment arena --only ... guard.mode=act`` does not do this: it
skips the archived runs (``--rerun`` trains the shared warm start again, ``--no-archive``
does not restore it), counts a run the guard stopped as a failed one, and its summary
restores the archive over a run that ended before its last step.

Usage::

    python -m experiments.guard_act run --method ppo_decoupled --staleness 16 --seed 0 \\
        --output-dir /tmp/guard_act
    python -m experiments.guard_act report --output-dir /tmp/guard_act \\
        --json docs/results/guard_act.json --figure docs/results/guard_act.png

Longer runs than the grid's have no archived run to compare with: run the same cells
twice, once with the guard acting and once with it only warning, and compare the two::

    python -m experiments.guard_act run --method ppo_behavior --staleness 16 --seed 0 \\
        --num-steps 80 --output-dir /tmp/guard_80/act
    python -m experiments.guard_act run --method ppo_behavior --staleness 16 --seed 0 \\
        --num-steps 80 --set 'guard.mode="warn"' --output-dir /tmp/guard_80/warn
    python -m experiments.guard_act report --output-dir /tmp/guard_80/act \\
        --against /tmp/guard_80/warn --json docs/results/guard_act_80.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments import archive as run_archive
from experiments import arena
from experiments.collapse import CollapseRule
from experiments.grid import (
    ExperimentSpec,
    PlannedRun,
    experiment_path,
    load_experiment,
    plan_runs,
    plan_warm_start,
    select_runs,
    warm_start_policy_dir,
)
from experiments.guard_replay import (
    DEFAULT_ARCHIVE,
    ArchivedRun,
    _run_config,
    fall_step,
    read_archive,
    read_run_dir,
    replay_steps,
)
from services.run_records import SUPERSEDED_DIR, read_records

EXPERIMENT = "arena"
"""The grid whose cells are re-run (``deploy/configs/experiments/arena.toml``)."""

ACT_OVERRIDES: tuple[str, ...] = ('guard.mode="act"', "checkpoint.every_k_steps=5")
"""The changes to the archived runs' config: the guard acts (rollback on, the default
ladder and budgets), and a checkpoint every 5 learner steps (the arena's runs checkpoint
only at the end, ``checkpoint.every_k_steps = 0``: a rollback would have nowhere to go)."""

COMPARED_KEYS: tuple[str, ...] = (
    "success_rate", "malformed_rate", "response_tokens_mean", "num_turns_mean",
)  # fmt: skip
"""Step-record keys compared with the archived run (:func:`first_difference`): what the
sampled rollouts were. Losses are left out: on another CPU they differ in their last bits
from the first step (float32 summation order) while the rollouts stay the same."""

RUN_NOTE = "guard_act.json"
"""Written into each re-run's directory: the overrides, the wall time measured around the
run, and the step the guard stopped it at."""


# --------------------------------------------------------------------------- running


def plan_cell(
    method: str,
    staleness: int,
    seeds: Sequence[int],
    output_dir: Path,
    overrides: Sequence[str] = ACT_OVERRIDES,
    experiment: str = EXPERIMENT,
    num_steps: int | None = None,
) -> tuple[ExperimentSpec, list[PlannedRun]]:
    """The grid's runs of cell (``method``, ``buffer.max_staleness = staleness``) for
    ``seeds``, planned as the grid plans them (its base config, overrides, method and
    shared warm start) into ``output_dir``, with ``overrides`` last; ``num_steps``
    replaces the grid's learner steps (the grid sets ``run.num_steps`` itself, over any
    override).

    Raises:
        services.config.ConfigError: an override does not validate.
        ValueError: the grid has no such cell.
    """
    spec = load_experiment(experiment_path(experiment))
    update: dict[str, Any] = {"seeds": list(seeds), "more_seeds": None}
    if num_steps is not None:
        update["num_steps"] = num_steps
    spec = spec.model_copy(update=update)
    planned = plan_runs(spec, experiment, output_dir, list(overrides), more_seeds=False)
    chosen = select_runs(
        planned, {"method": [method], "buffer.max_staleness": [staleness], "seed": list(seeds)}
    )
    if not chosen:
        raise ValueError(f"{experiment} has no cell method={method} staleness={staleness}")
    return spec, sorted(chosen, key=lambda r: r.seed)


def restore_warm_start(
    spec: ExperimentSpec, output_dir: Path, experiment: str = EXPERIMENT
) -> Path:
    """Write the grid's archived shared warm start into ``output_dir`` (unless it is there);
    returns its policy directory.

    Raises:
        FileNotFoundError: the grid has no archived warm start and ``output_dir`` none.
    """
    warm = plan_warm_start(spec, experiment, output_dir)
    policy = warm_start_policy_dir(spec, experiment, output_dir)
    if warm is not None and spec.archive_dir is not None:
        run_archive.restore_warm_start(spec.archive_dir, warm.config.run_dir, policy)
    if not (policy / "config.json").exists():
        raise FileNotFoundError(f"no warm start at {policy} and none archived to restore")
    return policy


def run_one(run: PlannedRun, overrides: Sequence[str], max_run_s: float = 0.0) -> dict[str, Any]:
    """Train ``run`` (after clearing what a previous try left in its directory); a stop
    by the guard is an outcome, not an error. Writes and returns :data:`RUN_NOTE`."""
    from experiments.grid import _detach_run_log, train_with_time_cap
    from services.run_records import GuardStopped, clear_run_records

    run_dir = run.config.run_dir
    if run_dir.exists():
        clear_run_records(run_dir)
    stopped_at = None
    start = time.perf_counter()
    try:
        train_with_time_cap(run.config, max_run_s)
    except GuardStopped as e:
        stopped_at = e.step
    finally:
        _detach_run_log(run_dir)
    note = {
        "overrides": list(overrides),
        "process_wall_s": round(time.perf_counter() - start, 1),
        "guard_stopped_at": stopped_at,
    }
    (run_dir / RUN_NOTE).write_text(json.dumps(note, indent=1) + "\n")
    return note


# --------------------------------------------------------------------------- reading


def guard_actions(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``act`` decisions of a ``guard.jsonl`` (ladder steps and stops), each as
    ``{step, rule, action, before, after, rollback_from, signal_began, rollback_to,
    rollback_reason}`` (the rollback fields None where none was considered)."""
    out = []
    for r in records:
        if r.get("level") != "act":
            continue
        rollback = r.get("rollback") or {}
        out.append({
            "step": r.get("step"), "rule": r.get("rule"), "action": r.get("action"),
            "before": r.get("before") or {}, "after": r.get("after") or {},
            "rollback_from": rollback.get("from_step"),
            "signal_began": rollback.get("signal_began"),
            "rollback_to": rollback.get("to_step"),
            "rollback_reason": rollback.get("reason") or r.get("reason") or "",
        })  # fmt: skip
    return out


def chronological(
    steps: Sequence[dict[str, Any]], superseded: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every step record of a run, the kept ones and those a rollback moved aside, in the
    order they were made (by ``elapsed_s``, which a rollback does not reset)."""
    return sorted([*steps, *superseded], key=lambda r: float(r.get("elapsed_s", math.nan)))


def first_lineage(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chronological records up to the first rollback: while the step number rises."""
    out: list[dict[str, Any]] = []
    for r in records:
        if out and int(r["step"]) <= int(out[-1]["step"]):
            break
        out.append(r)
    return out


def _triggering(records: Sequence[dict[str, Any]], from_steps: Sequence[int]) -> list[int | None]:
    """The index in ``records`` (chronological) of each rollback's triggering step, matched
    in order; None where it has no next record (the run ended there)."""
    out: list[int | None] = []
    start = 0
    for from_step in from_steps:
        i = next((i for i in range(start, len(records)) if records[i]["step"] == from_step), None)
        out.append(i if i is not None and i + 1 < len(records) else None)
        start = len(records) if i is None else i + 1
    return out


def rollback_seconds(records: Sequence[dict[str, Any]], from_steps: Sequence[int]) -> list[float]:
    """For each rollback (in order, by the step that triggered it), the time from the end
    of that step to the start of the next one in ``records`` (chronological): the rollback,
    the change and the checkpoint after it. A step starts ``wall_s`` before its
    ``elapsed_s``. NaN where no step followed (the run ended there)."""
    out = []
    for i in _triggering(records, from_steps):
        if i is None:
            out.append(math.nan)
            continue
        nxt = records[i + 1]
        out.append(float(nxt["elapsed_s"]) - float(nxt["wall_s"]) - float(records[i]["elapsed_s"]))
    return out


def refill_seconds(records: Sequence[dict[str, Any]], from_steps: Sequence[int]) -> list[float]:
    """For each rollback (as :func:`rollback_seconds`), how much longer than the run's
    median step the first step after it took: the buffer was emptied, so that step waits
    for fresh rollouts. NaN where no step followed."""
    if not records:
        return [math.nan] * len(from_steps)
    median = statistics.median(float(r["wall_s"]) for r in records)
    return [
        math.nan if i is None else float(records[i + 1]["wall_s"]) - median
        for i in _triggering(records, from_steps)
    ]


def first_difference(
    a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]], keys: Sequence[str] = COMPARED_KEYS
) -> int | None:
    """The first step at which records ``a`` and ``b`` (paired in order) differ in any of
    ``keys`` (exact equality; a key missing from both is equal); None when they agree over
    their common length."""
    for ra, rb in zip(a, b, strict=False):
        if any(ra.get(k) != rb.get(k) for k in keys):
            return int(ra["step"])
    return None


def fisher(with_count: int, with_runs: int, without_count: int, without_runs: int) -> float:
    """Two-sided p of Fisher's exact test on the 2x2 table (count, runs - count) with the
    guard against without it (:func:`scipy.stats.fisher_exact`); NaN when a group is empty."""
    from scipy.stats import fisher_exact

    if with_runs == 0 or without_runs == 0:
        return math.nan
    table = [[with_count, with_runs - with_count], [without_count, without_runs - without_count]]
    return float(fisher_exact(table, alternative="two-sided").pvalue)


@dataclass
class ActRun:
    """One re-run with the guard acting, beside the archived run of its seed."""

    name: str
    method: str
    staleness: int
    seed: int
    val_success: float
    ended_low: bool
    degrading: bool
    steps: int
    """Learner steps of the kept lineage (fewer than planned when the guard stopped it)."""
    planned_steps: int
    stopped_at: int | None
    """The step at which the guard stopped the run (None: it ran every step)."""
    fall_step: int | None
    warnings: int
    actions: list[dict[str, Any]]
    """:func:`guard_actions`."""
    rollbacks: int
    redone_steps: int
    """Learner steps a rollback threw away (moved to ``superseded/``)."""
    redone_s: float
    """Their summed ``wall_s``."""
    rollback_s: float
    """:func:`rollback_seconds`, summed."""
    refill_s: float
    """:func:`refill_seconds`, summed."""
    wall_s: float
    """``config.json`` to the final evaluation (modification times), as the archive measures."""
    loop_s: float
    """The training loop's time at its last step (``elapsed_s``)."""
    same_as_archive_until: int | None
    """The steps before the first rollback repeat the archived run's records up to this
    step (its first step that differs minus 1; the last compared step when none
    differs)."""
    archived_val_success: float
    archived_ended_low: bool
    archived_degrading: bool
    archived_wall_s: float
    archived_loop_s: float
    replay_first_act: int | None
    """The offline replay's first act step on the archived run."""
    malformed_curve: list[float] = field(default_factory=list)
    """The kept lineage's training malformed share per step (the figure)."""
    archived_malformed_curve: list[float] = field(default_factory=list)
    """The same of the archived (or control) run; empty without one."""

    @property
    def fell(self) -> bool:
        """Ended low or degrading at the end."""
        return self.ended_low or self.degrading

    @property
    def archived_fell(self) -> bool:
        return self.archived_ended_low or self.archived_degrading


@dataclass
class ActCell:
    """One cell: its re-runs with the guard against the archived (or control) runs of the
    same seeds, and the count over every archived run of the cell."""

    method: str
    staleness: int
    runs: int
    ended_low: int
    fell: int
    archived_runs: int
    archived_ended_low: int
    archived_fell: int
    fisher_p_ended_low: float
    fisher_p_fell: float
    acted_on: int
    rollbacks: int
    stopped: int
    wall_s_mean: float
    archived_wall_s_mean: float
    """The archived runs of the same seeds (other machines and loads: not a paired
    control)."""
    extra_s_mean: float
    """Mean over the re-runs of ``redone_s + rollback_s + refill_s``: what the rollbacks
    cost."""
    seeds: list[int] = field(default_factory=list)
    val_success_mean: float = math.nan
    archived_val_success_mean: float = math.nan
    lower: list[LowerStaleness] = field(default_factory=list)
    """The archive's runs of the same method at each lower staleness (above 0): what
    running there from the start gave, to set beside the guard's tightening."""
    cell_runs: int = 0
    """Every run of the cell without the guard (archived or control), re-run or not."""
    cell_ended_low: int = 0
    """How many of them ended low."""


@dataclass
class LowerStaleness:
    """A method's archived runs at one staleness below the re-run cell's, against the
    re-runs with the guard (:attr:`ActCell.lower`)."""

    staleness: int
    runs: int
    ended_low: int
    val_success_mean: float
    fisher_p_ended_low: float
    """The re-runs' ended-low count against these runs'."""


def _sum(values: Sequence[float]) -> float:
    return float(sum(v for v in values if not math.isnan(v)))


def _mean(values: Sequence[float]) -> float:
    return float(statistics.mean(values)) if values else math.nan


def read_act_run(run_dir: Path, low: float, archived: ArchivedRun | None) -> ActRun:
    """One re-run directory as an :class:`ActRun`; ``low``: the ended-low threshold;
    ``archived``: the archived run of its cell and seed (None: not archived)."""
    run = arena.read_run(run_dir, CollapseRule())
    steps = read_records(run_dir / "steps.jsonl", "step")
    superseded = read_records(run_dir / SUPERSEDED_DIR / "steps.jsonl")
    records = chronological(steps, superseded)
    actions = guard_actions(read_records(run_dir / "guard.jsonl"))
    rolled = [a for a in actions if a["rollback_to"] is not None]
    note_path = run_dir / RUN_NOTE
    note = json.loads(note_path.read_text()) if note_path.exists() else {}
    planned = run_archive.steps_done(run_dir)[1]
    same_until = None
    if archived is not None:
        mine = first_lineage(records)
        diff = first_difference(mine, archived.steps)
        same_until = diff - 1 if diff is not None else min(len(mine), len(archived.steps))
    replay_act = None
    if archived is not None:
        replay_act, _, _ = replay_steps(archived.steps, _run_config(archived.config, {}))
    last = records[-1] if records else {}
    nan = math.nan
    return ActRun(
        name=run_dir.name, method=run.method, staleness=run.staleness, seed=run.seed,
        val_success=run.val_success, ended_low=bool(run.val_success < low),
        degrading=bool(run.malformed_end > arena.DEGRADING_MALFORMED),
        steps=len(steps), planned_steps=planned, stopped_at=note.get("guard_stopped_at"),
        fall_step=fall_step(run.malformed_curve),
        warnings=sum(r.get("level") == "warn" for r in read_records(run_dir / "guard.jsonl")),
        actions=actions, rollbacks=len(rolled), redone_steps=len(superseded),
        redone_s=_sum([float(r.get("wall_s", nan)) for r in superseded]),
        rollback_s=_sum(rollback_seconds(records, [a["rollback_from"] for a in rolled])),
        refill_s=_sum(refill_seconds(records, [a["rollback_from"] for a in rolled])),
        wall_s=run.wall_s, loop_s=float(last.get("elapsed_s", nan)),
        same_as_archive_until=same_until,
        archived_val_success=archived.run.val_success if archived else nan,
        archived_ended_low=bool(archived.run.val_success < low) if archived else False,
        archived_degrading=(
            bool(archived.run.malformed_end > arena.DEGRADING_MALFORMED) if archived else False
        ),
        archived_wall_s=archived.run.wall_s if archived else nan,
        archived_loop_s=float(archived.steps[-1].get("elapsed_s", nan)) if archived else nan,
        replay_first_act=replay_act, malformed_curve=list(run.malformed_curve),
        archived_malformed_curve=list(archived.run.malformed_curve) if archived else [],
    )  # fmt: skip


def summarize_cell(runs: Sequence[ActRun], whole: Sequence[ArchivedRun], low: float) -> ActCell:
    """:class:`ActCell` of one cell's re-runs against those of ``whole`` (every run of the
    cell without the guard) with the same seeds; ``whole`` also gives ``cell_runs`` and
    ``cell_ended_low``."""
    seeds = {r.seed for r in runs}
    archived = [a for a in whole if a.run.seed in seeds]
    a_low = sum(a.run.val_success < low for a in archived)
    a_fell = sum(
        a.run.val_success < low or a.run.malformed_end > arena.DEGRADING_MALFORMED for a in archived
    )
    low_n, fell_n = sum(r.ended_low for r in runs), sum(r.fell for r in runs)
    return ActCell(
        method=runs[0].method, staleness=runs[0].staleness, runs=len(runs),
        ended_low=low_n, fell=fell_n, archived_runs=len(archived),
        archived_ended_low=a_low, archived_fell=a_fell,
        fisher_p_ended_low=fisher(low_n, len(runs), a_low, len(archived)),
        fisher_p_fell=fisher(fell_n, len(runs), a_fell, len(archived)),
        acted_on=sum(bool(r.actions) for r in runs), rollbacks=sum(r.rollbacks for r in runs),
        stopped=sum(r.stopped_at is not None for r in runs),
        wall_s_mean=_mean([r.wall_s for r in runs]),
        archived_wall_s_mean=_mean([a.run.wall_s for a in archived]),
        extra_s_mean=_mean([r.redone_s + r.rollback_s + r.refill_s for r in runs]),
        seeds=[r.seed for r in runs], val_success_mean=_mean([r.val_success for r in runs]),
        archived_val_success_mean=_mean([a.run.val_success for a in archived]),
        cell_runs=len(whole), cell_ended_low=sum(a.run.val_success < low for a in whole),
    )  # fmt: skip


def lower_staleness(
    cell: ActCell, archived: Sequence[ArchivedRun], low: float, steps: int
) -> list[LowerStaleness]:
    """:attr:`ActCell.lower` of ``cell`` from the archived runs (``archived``) of ``steps``
    learner steps, the re-runs' (none for longer runs than the archive's)."""
    out = []
    same = [a for a in archived if a.run.method == cell.method and len(a.steps) == steps]
    for s in sorted({a.run.staleness for a in same if 0 < a.run.staleness < cell.staleness}):
        theirs = [a.run for a in same if a.run.staleness == s]
        n_low = sum(r.val_success < low for r in theirs)
        out.append(LowerStaleness(
            staleness=s, runs=len(theirs), ended_low=n_low,
            val_success_mean=_mean([r.val_success for r in theirs]),
            fisher_p_ended_low=fisher(cell.ended_low, cell.runs, n_low, len(theirs)),
        ))  # fmt: skip
    return out


def finished_runs(output_dir: Path, experiment: str = EXPERIMENT) -> list[Path]:
    """The finished runs ``guard_act run`` wrote under ``output_dir/<experiment>`` (those
    with :data:`RUN_NOTE`), by name; empty when there are none."""
    root = Path(output_dir) / experiment
    if not root.is_dir():
        return []
    return sorted(
        d for d in root.iterdir()
        if d.is_dir() and (d / RUN_NOTE).exists() and run_archive.is_finished(d)
    )  # fmt: skip


def read_control_runs(control_dir: Path, experiment: str = EXPERIMENT) -> list[ArchivedRun]:
    """The finished runs of ``control_dir`` (:func:`finished_runs`; the same cells and
    seeds run without the guard acting, ``--set 'guard.mode="warn"'``) read as
    :func:`experiments.guard_replay.read_archive` reads archived runs, to compare re-runs
    with where the archive has no such runs (longer runs than the grid's).

    Raises:
        FileNotFoundError: ``control_dir`` has no finished run.
    """
    dirs = finished_runs(control_dir, experiment)
    if not dirs:
        raise FileNotFoundError(f"{control_dir}/{experiment}: no finished run ({RUN_NOTE})")
    return [read_run_dir(d) for d in dirs]


def compare(
    output_dir: Path,
    archive_dir: Path = DEFAULT_ARCHIVE,
    experiment: str = EXPERIMENT,
    control_dir: Path | None = None,
) -> tuple[list[ActCell], list[ActRun], float]:
    """Every finished re-run under ``output_dir/<experiment>`` against the runs without the
    guard: ``archive_dir``'s, or ``control_dir``'s (:func:`read_control_runs`; the
    ``archived_*`` fields then hold those, and a re-run without a control run of its name
    is left out). A cell is compared with the runs of the seeds it re-ran (the re-runs
    are chosen, e.g. the seeds the replay acted on or that fell: the cell's other runs
    would not be a like comparison); ``cell_runs`` counts them all. The ended-low
    threshold always comes from the archive's on-policy runs.
    Returns the cells, the runs (by staleness, method, seed) and that threshold.

    Raises:
        FileNotFoundError: no finished re-run, no archived run, or no control run.
    """
    archive = archived = read_archive(archive_dir)
    low = arena.low_threshold([a.run for a in archived])
    if control_dir is not None:
        archived = read_control_runs(control_dir, experiment)
    by_name = {a.name: a for a in archived}
    dirs = finished_runs(output_dir, experiment)
    if control_dir is not None:  # only the re-runs that have their control run
        dirs = [d for d in dirs if d.name in by_name]
    if not dirs:
        raise FileNotFoundError(f"{output_dir}/{experiment}: no finished re-run ({RUN_NOTE})")
    runs = [read_act_run(d, low, by_name.get(d.name)) for d in dirs]
    runs.sort(key=lambda r: (r.staleness, r.method, r.seed))
    cells = []
    for key in dict.fromkeys((r.method, r.staleness) for r in runs):
        mine = [r for r in runs if (r.method, r.staleness) == key]
        whole = [a for a in archived if (a.run.method, a.run.staleness) == key]
        cell = summarize_cell(mine, whole, low)
        cell.lower = lower_staleness(cell, archive, low, mine[0].planned_steps)
        cells.append(cell)
    return cells, runs, low


# --------------------------------------------------------------------------- writing


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def action_text(a: dict[str, Any]) -> str:
    """``21 lower_staleness (16->4), back to 15`` / ``27 stop (rollback budget spent (2 of 2))``."""
    if a["action"] == "stop":
        return f"{a['step']} stop ({a['rollback_reason']})"
    change = ", ".join(f"{a['before'][k]}->{a['after'][k]}" for k in a["after"] if k in a["before"])
    text = f"{a['step']} {a['action']}" + (f" ({change})" if change else "")
    if a["rollback_to"] is not None:
        return text + f", back to {a['rollback_to']}"
    return text + (f", no rollback: {a['rollback_reason']}" if a["rollback_reason"] else "")


def markdown(
    cells: Sequence[ActCell], runs: Sequence[ActRun], low: float, without: str = "archived"
) -> str:
    """The per-run and per-cell tables (the page's words are written by hand around them);
    ``without`` names the runs without the guard in the headers (``"archived"``, or
    ``"without"`` for control runs)."""
    w = without
    lines = [
        f"| method | staleness | seed | final success ({w}) | ended low ({w}) | "
        f"degrading ({w}) | guard actions: step, action, rollback to | warnings | "
        f"stopped at | steps redone | rollback time (s) | wall (s) ({w}) | "
        f"same as {w} until step |",
        "|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        acts = "; ".join(action_text(a) for a in r.actions) or "none"
        lines.append(
            f"| {r.method} | {r.staleness} | {r.seed} | {_f(r.val_success)} "
            f"({_f(r.archived_val_success)}) | {_yes(r.ended_low)} ({_yes(r.archived_ended_low)}) "
            f"| {_yes(r.degrading)} ({_yes(r.archived_degrading)}) | {acts} | {r.warnings} | "
            f"{r.stopped_at if r.stopped_at is not None else '-'} | {r.redone_steps} | "
            f"{_f(r.rollback_s, 1)} | {_f(r.wall_s, 0)} ({_f(r.archived_wall_s, 0)}) | "
            f"{r.same_as_archive_until if r.same_as_archive_until is not None else '-'} |"
        )
    lines += [
        "",
        f"| method | staleness | seeds | runs with the guard | ended low | fell | {w} runs, "
        "same seeds | ended low | fell | Fisher p, ended low | Fisher p, fell | "
        f"{w}, whole cell: ended low of runs | acted on | rollbacks | "
        f"stopped | mean wall (s) | {w} mean wall (s) | mean rollback cost (s) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        lines.append(
            f"| {c.method} | {c.staleness} | {' '.join(map(str, c.seeds))} | {c.runs} | "
            f"{c.ended_low} | {c.fell} | "
            f"{c.archived_runs} | {c.archived_ended_low} | {c.archived_fell} | "
            f"{_f(c.fisher_p_ended_low, 3)} | {_f(c.fisher_p_fell, 3)} | "
            f"{c.cell_ended_low} of {c.cell_runs} | {c.acted_on} | "
            f"{c.rollbacks} | {c.stopped} | {_f(c.wall_s_mean, 0)} | "
            f"{_f(c.archived_wall_s_mean, 0)} | {_f(c.extra_s_mean, 0)} |"
        )
    lines += [
        "",
        "| method | staleness | with the guard: ended low of runs, mean final success | "
        "archived at a lower staleness from the start: staleness, ended low of runs, mean "
        "final success, Fisher p (ended low) |",
        "|---|---:|---|---|",
    ]
    for c in cells:
        lower = "; ".join(
            f"{x.staleness}: {x.ended_low} of {x.runs}, {_f(x.val_success_mean)}, "
            f"p = {_f(x.fisher_p_ended_low)}"
            for x in c.lower
        )
        lines.append(
            f"| {c.method} | {c.staleness} | {c.ended_low} of {c.runs}, "
            f"{_f(c.val_success_mean)} | {lower or '-'} |"
        )
    lines += [
        "",
        f"Ended low: final greedy success below {low:.3f} (the archive's on-policy median "
        f"minus {arena.LOW_MARGIN}); degrading: training rollouts more than "
        f"{arena.DEGRADING_MALFORMED:.0%} malformed over the last {arena.END_STEPS} kept "
        "steps; fell: either. Rollback cost: the summed wall time of the steps a rollback "
        "threw away, the time from the triggering step to the next step's start, and how much "
        "longer than the run's median step the first step after a rollback took (it waits "
        "for fresh rollouts).",
    ]
    return "\n".join(lines) + "\n"


def write_report(
    output_dir: Path,
    json_path: Path,
    archive_dir: Path = DEFAULT_ARCHIVE,
    control_dir: Path | None = None,
    figure: Path | None = None,
) -> tuple[Path, str]:
    """:func:`compare` (against ``control_dir``'s runs when given), written to
    ``json_path`` and, when ``figure`` is given, drawn there (:func:`plot_malformed`);
    returns the JSON's path and the tables (:func:`markdown`)."""
    cells, runs, low = compare(output_dir, archive_dir, control_dir=control_dir)
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    without = "archived" if control_dir is None else "without"
    if figure is not None:
        plot_malformed(runs, Path(figure), without)
    payload = {
        "experiment": EXPERIMENT,
        "archive_dir": str(archive_dir),
        "compared_with": "archive" if control_dir is None else str(control_dir),
        "overrides": list(ACT_OVERRIDES),
        "ended_low_below": low,
        "cells": [asdict(c) for c in cells],
        "runs": [{**asdict(r), "fell": r.fell, "archived_fell": r.archived_fell} for r in runs],
    }
    json_path.write_text(json.dumps(arena.json_safe(payload), indent=1) + "\n")
    return json_path, markdown(cells, runs, low, without)


def plot_malformed(runs: Sequence[ActRun], path: Path, without: str = "archived") -> Path:
    """One panel per cell: each seed's training malformed share per learner step (moving
    average over 3 steps, the guard's window) with the guard acting (solid, the kept
    lineage, an x at each action) and without it (dashed), and the act rule's bound (0.5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = list(dict.fromkeys((r.method, r.staleness) for r in runs))
    cols = min(3, len(cells))
    rows = -(-len(cells) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.1 * rows), squeeze=False)

    for i, (method, staleness) in enumerate(cells):
        ax = axes[i // cols][i % cols]
        for r in (r for r in runs if (r.method, r.staleness) == (method, staleness)):
            color = plt.get_cmap("tab10")(r.seed % 10)
            if r.archived_malformed_curve:
                y = arena.moving_average(r.archived_malformed_curve, 3)
                ax.plot(np.arange(len(y)) + 3, y, color=color, ls="--", lw=1.0, alpha=0.7)
            y = arena.moving_average(r.malformed_curve, 3)
            ax.plot(np.arange(len(y)) + 3, y, color=color, lw=1.6, label=f"seed {r.seed}")
            for a in r.actions if len(y) else []:  # y[j]: the mean over steps j+1 to j+3
                k = min(max(int(a["step"]) - 3, 0), len(y) - 1)
                ax.plot(int(a["step"]), y[k], "x", color=color, ms=8, mew=2)
        ax.axhline(0.5, color="gray", lw=0.8, ls=":")
        ax.set_title(f"{method}, staleness {staleness}", fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)
        ax.set_xlabel("learner step", fontsize=9)
        ax.set_ylabel("malformed share", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    for j in range(len(cells), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    fig.suptitle(
        f"training malformed share, 3-step mean; solid: guard acting (x: an action); "
        f"dashed: {without}; dotted: the malformed-share act rule",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m experiments.guard_act run|report`` (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="re-run one cell's seeds, one at a time")
    run.add_argument("--method", required=True)
    run.add_argument("--staleness", type=int, required=True)
    run.add_argument("--seed", type=int, action="append", required=True, help="repeatable")
    run.add_argument("--output-dir", type=Path, required=True)
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="more overrides, after the default ones (repeatable)")  # fmt: skip
    run.add_argument("--max-run-s", type=float, default=0.0, help="time cap per run (0: none)")
    run.add_argument("--num-steps", type=int, default=None,
                     help="learner steps per run (default: the grid's)")  # fmt: skip
    report = sub.add_parser("report", help="compare the finished re-runs with the archive")
    report.add_argument("--output-dir", type=Path, required=True)
    report.add_argument("--archive", type=Path, default=DEFAULT_ARCHIVE)
    report.add_argument("--json", type=Path, required=True, help="where the comparison goes")
    report.add_argument("--tables", type=Path, default=None, help="also write the tables here")
    report.add_argument(
        "--against",
        type=Path,
        default=None,
        help="compare with the finished runs of this output directory (run "
        "without the guard acting) instead of the archive",
    )
    report.add_argument("--figure", type=Path, default=None, help="draw the malformed shares here")
    args = parser.parse_args(argv)
    if args.command == "run":
        overrides = [*ACT_OVERRIDES, *args.set]
        spec, planned = plan_cell(
            args.method, args.staleness, args.seed, args.output_dir, overrides,
            num_steps=args.num_steps,
        )  # fmt: skip
        restore_warm_start(spec, args.output_dir)
        for p in planned:
            print(f"[guard_act] {p.name}: {p.config.run_dir}", flush=True)
            note = run_one(p, overrides, args.max_run_s)
            print(f"[guard_act] {p.name}: {note}", flush=True)
        return
    js, tables = write_report(
        args.output_dir, args.json, args.archive, control_dir=args.against, figure=args.figure
    )
    if args.tables is not None:
        args.tables.write_text(tables)
    print(tables)
    print(f"wrote {js}")


if __name__ == "__main__":
    main()
