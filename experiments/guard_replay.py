"""Replay archived runs through the stability guard, offline: when would it have acted?

Every run of a grid's archive (:mod:`experiments.archive`, e.g. the off-policy arena's
``experiments/runs/arena/``) is read back, and its ``steps.jsonl`` records are fed, step by
step, to a fresh :class:`services.loop.guard.Guard` with ``guard.mode = "act"`` and no
control plane (decisions only: the archived run went on unchanged, so only the first action
is evidence; what the later ones would have done is not known). Per run
(:class:`ReplayRun`): the step of the first ``act`` (None: never), of the first ``warn``,
and whether the run fell by the arena's own measures (:mod:`experiments.arena`): it *ended
low* (final greedy success more than :data:`experiments.arena.LOW_MARGIN` below the
on-policy median, :func:`experiments.arena.low_threshold`) or was *degrading at the end*
(training rollouts malformed in more than :data:`experiments.arena.DEGRADING_MALFORMED` over
the last :data:`experiments.arena.END_STEPS` steps). Its *fall step* is the first step at
which that trailing malformed share exceeded the same bound (None: it never did).

Per cell (method x staleness, :class:`ReplayCell`): runs, runs that fell, fallen runs acted
on (and how many steps before their fall step), runs that did not fall but were acted on
(false alarms), and the median first act step. The healthy cells (:data:`HEALTHY_METHODS`
and the on-policy cell, none of whose runs fell) give the false-alarm count the defaults
are set against.

Usage::

    python -m experiments.guard_replay                                  # the table
    python -m experiments.guard_replay --out docs/results/guard_replay  # also .md, .json
    python -m experiments.guard_replay --set guard.window=5 --set guard.patience=3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments import arena
from experiments.archive import read_archived_run
from experiments.collapse import CollapseRule
from services.config import RunConfig, apply_overrides, update_config
from services.loop.guard import Guard
from services.run_records import read_records

DEFAULT_ARCHIVE = Path("experiments/runs/arena")
"""The off-policy arena's archive."""

HEALTHY_METHODS: tuple[str, ...] = ("ppo_behavior", "st_ppo_behavior")
"""The arena's behaviour-ratio methods none of whose runs fell (ended low or degrading) at
any staleness; with the on-policy cell, where a guard that acts is a false alarm."""


@dataclass
class ReplayRun:
    """One archived run replayed (steps are learner steps, 1-based)."""

    name: str
    method: str
    staleness: int
    seed: int
    steps: int
    val_success: float
    ended_low: bool
    degrading: bool
    fall_step: int | None
    first_act: int | None
    first_warn: int | None
    act_rule: str | None

    @property
    def fell(self) -> bool:
        """Ended low or degrading at the end."""
        return self.ended_low or self.degrading


@dataclass
class ReplayCell:
    """One (method, staleness) cell over its runs."""

    method: str
    staleness: int
    runs: int
    fell: int
    fell_acted: int
    """Fallen runs the guard acted on (at any step)."""
    fell_acted_before_fall: int
    """Fallen runs acted on before their fall step (or acted on without one)."""
    lead_steps_median: float
    """Median of fall step - first act step over the fallen runs acted on that have both."""
    healthy_acted: int
    """Runs that did not fall and were acted on: false alarms."""
    first_act_median: float
    """Median first act step over the runs acted on (NaN: none)."""
    act_steps: list[int | None]
    """Each run's first act step, in seed order (None: never)."""
    healthy: bool
    """A healthy cell (:data:`HEALTHY_METHODS` or the on-policy cell)."""


def fall_step(malformed: Sequence[float]) -> int | None:
    """The first step whose trailing mean of the malformed share over
    :data:`experiments.arena.END_STEPS` steps (fewer at the start) exceeds
    :data:`experiments.arena.DEGRADING_MALFORMED`: the degrading measure applied at every
    step; None if it never does."""
    for i in range(len(malformed)):
        window = [
            v for v in malformed[max(0, i - arena.END_STEPS + 1) : i + 1] if not math.isnan(v)
        ]
        if window and sum(window) / len(window) > arena.DEGRADING_MALFORMED:
            return i + 1
    return None


def _run_config(config_json: dict[str, Any], guard_changes: dict[str, Any]) -> RunConfig:
    """The archived run's config with ``guard_changes`` (nested) applied; an archived config
    that no longer validates is replaced by the defaults with its staleness and objective
    (all the guard's actions read)."""
    try:
        cfg = RunConfig.model_validate(config_json)
    except ValueError:
        algo = config_json.get("algorithm", {})
        cfg = update_config(RunConfig(), {
            "buffer": {"max_staleness": int(config_json["buffer"]["max_staleness"])},
            "algorithm": {"off_policy": algo.get("off_policy", "behavior")},
        })  # fmt: skip
    return update_config(cfg, {"guard": {**guard_changes.get("guard", {}), "mode": "act"}})


def replay_steps(
    steps: Sequence[dict[str, Any]], cfg: RunConfig
) -> tuple[int | None, int | None, str | None]:
    """Feed ``steps`` to a fresh guard (decisions only); returns (first act step, first warn
    step, the rule of the first act)."""
    guard = Guard()
    first_act = first_warn = None
    rule = None
    for record in steps:
        decision = guard.observe(record, cfg)
        if decision.level == "act" and first_act is None:
            first_act, rule = decision.step, decision.rule
        if decision.level != "ok" and first_warn is None:
            first_warn = decision.step
    return first_act, first_warn, rule


@dataclass
class ArchivedRun:
    """One archived run as read back (:func:`read_archive`)."""

    name: str
    run: arena.ArenaRun
    """Its records as :func:`experiments.arena.read_run` reads them (``wall_s`` from the
    archived modification times)."""
    steps: list[dict[str, Any]]
    """Its ``steps.jsonl`` records."""
    config: dict[str, Any]
    """Its ``config.json`` as archived."""


def read_run_dir(run_dir: Path) -> ArchivedRun:
    """A finished run directory read back as :class:`ArchivedRun` (named by the directory):
    an archived run written out (:func:`read_archive`), or a run made here to compare with.

    Raises:
        ValueError: its ``steps.jsonl`` mixes runs or repeats a step
            (:func:`services.run_records.read_records`).
    """
    return ArchivedRun(
        run_dir.name,
        arena.read_run(run_dir, CollapseRule()),
        read_records(run_dir / "steps.jsonl", "step"),
        json.loads((run_dir / "config.json").read_text()),
    )


def read_archive(archive_dir: Path = DEFAULT_ARCHIVE) -> list[ArchivedRun]:
    """Every archived run of ``archive_dir`` (``*.json.gz``), in file-name order, read back
    through a temporary run directory (:func:`experiments.archive.read_archived_run`).

    Raises:
        ValueError: an unreadable archive file.
        FileNotFoundError: no archived run in ``archive_dir``.
    """
    paths = sorted(Path(archive_dir).glob("*.json.gz"))
    if not paths:
        raise FileNotFoundError(f"{archive_dir}: no archived run (*.json.gz)")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            record = read_archived_run(path)
            run_dir = Path(tmp) / record["run"]
            run_dir.mkdir()
            for name, text in record["files"].items():
                (run_dir / name).write_text(text)
            for name, mtime in record.get("mtimes", {}).items():
                os.utime(run_dir / name, (mtime, mtime))
            out.append(read_run_dir(run_dir))
    return out


def replay_archive(
    archive_dir: Path = DEFAULT_ARCHIVE, guard_changes: dict[str, Any] | None = None
) -> list[ReplayRun]:
    """Replay every archived run of ``archive_dir`` (``*.json.gz``) through the guard.

    Args:
        archive_dir: a grid's archive (:mod:`experiments.archive`).
        guard_changes: nested changes to the ``guard`` section (``{"guard": {...}}``).

    Raises:
        ValueError: an unreadable archive file, or a ``guard`` change that does not validate
            (:class:`services.config.ConfigError`).
        FileNotFoundError: no archived run in ``archive_dir``.
    """
    archived = read_archive(archive_dir)
    read = [(a.name, a.run, a.steps, _run_config(a.config, guard_changes or {})) for a in archived]
    low = arena.low_threshold([r for _, r, _, _ in read])
    out = []
    for name, run, steps, cfg in read:
        first_act, first_warn, rule = replay_steps(steps, cfg)
        out.append(
            ReplayRun(
                name=name, method=run.method, staleness=run.staleness, seed=run.seed,
                steps=run.steps, val_success=run.val_success,
                ended_low=bool(run.val_success < low),
                degrading=bool(run.malformed_end > arena.DEGRADING_MALFORMED),
                fall_step=fall_step(run.malformed_curve), first_act=first_act,
                first_warn=first_warn, act_rule=rule,
            )
        )  # fmt: skip
    return out


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def cells(runs: Sequence[ReplayRun]) -> list[ReplayCell]:
    """:class:`ReplayCell` per (method, staleness), by staleness then method."""
    groups: dict[tuple[str, int], list[ReplayRun]] = {}
    for r in sorted(runs, key=lambda r: (r.staleness, r.method, r.seed)):
        groups.setdefault((r.method, r.staleness), []).append(r)
    on_policy = min((s for _, s in groups), default=0)
    out = []
    for (method, staleness), rs in groups.items():
        fell = [r for r in rs if r.fell]
        acted = [r for r in fell if r.first_act is not None]
        before = [r for r in acted if r.fall_step is None or r.first_act < r.fall_step]  # type: ignore[operator]
        leads = [r.fall_step - r.first_act for r in acted if r.fall_step is not None]  # type: ignore[operator]
        out.append(
            ReplayCell(
                method=method, staleness=staleness, runs=len(rs), fell=len(fell),
                fell_acted=len(acted), fell_acted_before_fall=len(before),
                lead_steps_median=_median(leads),
                healthy_acted=sum(not r.fell and r.first_act is not None for r in rs),
                first_act_median=_median([r.first_act for r in rs if r.first_act is not None]),
                act_steps=[r.first_act for r in rs],
                healthy=method in HEALTHY_METHODS or staleness == on_policy,
            )
        )  # fmt: skip
    return out


@dataclass
class Headline:
    """The replay in a few numbers."""

    runs: int
    fell: int
    fell_acted: int
    fell_acted_before_fall: int
    lead_steps_median: float
    healthy_runs: int
    healthy_acted: int
    """Runs of the healthy cells acted on (all of them did not fall)."""
    healthy_warned: int
    """Runs of the healthy cells with a ``warn`` decision (a warn rule, or an act rule
    before its patience)."""
    other_not_fell_acted: int
    """Runs outside the healthy cells that did not fall but were acted on."""
    other_not_fell: int


def headline(runs: Sequence[ReplayRun], table: Sequence[ReplayCell]) -> Headline:
    """Totals over every run (:class:`Headline`)."""
    healthy = {(c.method, c.staleness) for c in table if c.healthy}
    fell = [r for r in runs if r.fell]
    acted = [r for r in fell if r.first_act is not None]
    leads = [r.fall_step - r.first_act for r in acted if r.fall_step is not None]  # type: ignore[operator]
    in_healthy = [r for r in runs if (r.method, r.staleness) in healthy]
    other_ok = [r for r in runs if (r.method, r.staleness) not in healthy and not r.fell]
    return Headline(
        runs=len(runs), fell=len(fell), fell_acted=len(acted),
        fell_acted_before_fall=sum(r.fall_step is None or r.first_act < r.fall_step for r in acted),  # type: ignore[operator]
        lead_steps_median=_median(leads), healthy_runs=len(in_healthy),
        healthy_acted=sum(r.first_act is not None for r in in_healthy),
        healthy_warned=sum(r.first_warn is not None for r in in_healthy),
        other_not_fell_acted=sum(r.first_act is not None for r in other_ok),
        other_not_fell=len(other_ok),
    )  # fmt: skip


def _f(v: float, digits: int = 0) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def markdown(table: Sequence[ReplayCell], head: Headline, guard: dict[str, Any]) -> str:
    """The replay table and its headline as markdown."""
    rules = "; ".join(
        f"`{r['signal']} {'>' if r.get('above') is not None else '<'} "
        f"{r['above'] if r.get('above') is not None else r['below']}` ({r['level']})"
        for r in guard["rules"]
    )
    lines = [
        "# Stability guard: replay of the archived arena runs",
        "",
        f"Generated by `python -m experiments.guard_replay` over {head.runs} archived runs. "
        f"Rules: {rules}; trailing mean over {guard['window']} steps, an act rule must hold "
        f"{guard['patience']} step{'s' * (guard['patience'] != 1)} in a row, no decision before "
        f"step {guard['warmup_steps']}.",
        "",
        f"- runs that fell (ended low or degrading at the end): {head.fell}; the guard acted "
        f"on {head.fell_acted} of them, {head.fell_acted_before_fall} before their fall step "
        f"(median lead {_f(head.lead_steps_median)} steps);",
        f"- healthy cells (on-policy, {', '.join(HEALTHY_METHODS)}): acted on "
        f"{head.healthy_acted} of {head.healthy_runs} runs (warned in {head.healthy_warned});",
        f"- other runs that did not fall: acted on {head.other_not_fell_acted} of "
        f"{head.other_not_fell}.",
        "",
        "| method | staleness | runs | fell | fell, acted on | before the fall | median lead "
        "(steps) | acted on, did not fall | median first act step | first act step per seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in table:
        name = f"{c.method} (healthy)" if c.healthy else c.method
        steps = " ".join("-" if s is None else str(s) for s in c.act_steps)
        lines.append(
            f"| {name} | {c.staleness} | {c.runs} | {c.fell} | {c.fell_acted} | "
            f"{c.fell_acted_before_fall} | {_f(c.lead_steps_median)} | {c.healthy_acted} | "
            f"{_f(c.first_act_median)} | {steps} |"
        )
    lines += [
        "",
        "Fell: ended low (final greedy success more than "
        f"{arena.LOW_MARGIN} below the on-policy median) or degrading at the end (training "
        f"rollouts more than {arena.DEGRADING_MALFORMED:.0%} malformed over the last "
        f"{arena.END_STEPS} steps). Fall step: the first step at which that trailing "
        "malformed share exceeded the same bound (a run that ended low without it has "
        "none). Lead: fall step minus the guard's first act step. The archived runs went on "
        "unchanged: only the first action is evidence; what acting does is not measured here.",
    ]
    return "\n".join(lines) + "\n"


def write_replay(
    out: Path, archive_dir: Path = DEFAULT_ARCHIVE, overrides: Sequence[str] = ()
) -> tuple[Path, Path]:
    """Replay ``archive_dir`` and write ``<out>.md`` and ``<out>.json``; returns both paths.

    Raises:
        ValueError, FileNotFoundError: as :func:`replay_archive`;
            :class:`services.config.ConfigError` for a bad override.
    """
    md, js = Path(f"{out}.md"), Path(f"{out}.json")
    runs, table, head, guard = run_replay(archive_dir, overrides)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(markdown(table, head, guard))
    payload = {"archive_dir": str(archive_dir), "guard": guard, "headline": asdict(head),
               "cells": [asdict(c) for c in table], "runs": [asdict(r) for r in runs]}  # fmt: skip
    js.write_text(json.dumps(arena.json_safe(payload), indent=1) + "\n")
    return md, js


def run_replay(
    archive_dir: Path = DEFAULT_ARCHIVE, overrides: Sequence[str] = ()
) -> tuple[list[ReplayRun], list[ReplayCell], Headline, dict[str, Any]]:
    """Replay with dotted ``guard.*`` overrides (``guard.window=5``); returns the runs, the
    cells, the headline and the guard section used (``mode`` as the replay ran it)."""
    changes = apply_overrides({}, list(overrides))
    runs = replay_archive(archive_dir, changes)
    table = cells(runs)
    guard = update_config(RunConfig(), {"guard": {**changes.get("guard", {}), "mode": "act"}})
    return runs, table, headline(runs, table), guard.guard.model_dump(mode="json")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m experiments.guard_replay``: print the table (and write it with ``--out``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", type=Path, default=DEFAULT_ARCHIVE)
    parser.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    parser.add_argument("--set", action="append", default=[], metavar="guard.KEY=VALUE",
                        help="override the guard section (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.out is not None:
        md, _ = write_replay(args.out, args.archive, args.set)
        print(md.read_text())
        return
    _, table, head, guard = run_replay(args.archive, args.set)
    print(markdown(table, head, guard))


if __name__ == "__main__":
    main()
