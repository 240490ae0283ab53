"""Re-runs of arena cells with the stability guard acting (experiments/guard_act.py): the
planning (the grid's config and seeds with the overrides) and the reading of a re-run's
records (its actions, the steps a rollback threw away and their time, Fisher's test). The
runs themselves are not run here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.archive import read_archived_run, restore_runs
from experiments.guard_act import (
    ACT_OVERRIDES,
    RUN_NOTE,
    action_text,
    chronological,
    finished_runs,
    first_difference,
    first_lineage,
    fisher,
    guard_actions,
    plan_cell,
    read_control_runs,
    refill_seconds,
    rollback_seconds,
    write_report,
)
from experiments.guard_replay import DEFAULT_ARCHIVE


def test_plan_cell_is_the_grids_run_with_the_guard_acting(tmp_path: Path):
    spec, planned = plan_cell("ppo_decoupled", 16, [3, 0], tmp_path, ACT_OVERRIDES)
    assert [p.seed for p in planned] == [0, 3]
    cfg = planned[0].config
    # the name the archive keys the run by, the grid's method and overrides, the warm start
    assert planned[0].name == "method-ppo_decoupled_max_staleness-16_seed-0"
    assert cfg.run.label == "ppo_decoupled" and cfg.buffer.max_staleness == 16
    assert cfg.algorithm.off_policy == "decoupled" and cfg.learner.actor_lr == 1e-4
    assert cfg.run.num_steps == spec.num_steps == 40 and not cfg.sft.enabled
    assert cfg.model.path == tmp_path / "arena/warm_start/checkpoints/step_000000/hf_policy"
    # the only changes: the guard acts, checkpoints every 5 steps
    assert cfg.guard.mode == "act" and cfg.guard.rollback and cfg.checkpoint.every_k_steps == 5
    with pytest.raises(ValueError, match="no cell"):
        plan_cell("ppo_decoupled", 3, [0], tmp_path)
    # longer runs: the grid sets run.num_steps itself, so an override of it would not hold
    _, (longer,) = plan_cell("ppo_decoupled", 16, [0], tmp_path, num_steps=80)
    assert longer.config.run.num_steps == 80 and longer.config.model.path == cfg.model.path


def test_guard_actions_keep_the_acts_with_their_rollbacks():
    records = [
        {"step": 20, "level": "warn", "rule": "r", "action": "lower_staleness", "rollback": None},
        {"step": 21, "level": "act", "rule": "r", "action": "lower_staleness",
         "before": {"buffer.max_staleness": 16}, "after": {"buffer.max_staleness": 4},
         "rollback": {"from_step": 21, "signal_began": 19, "to_step": 15, "reason": ""}},
        {"step": 3, "level": "act", "rule": "r", "action": "lower_lr", "before": {},
         "after": {}, "rollback": {"from_step": 3, "signal_began": 2, "to_step": None,
                                   "reason": "no checkpoint before step 2"}},
        {"step": 27, "level": "act", "rule": "r", "action": "stop", "reason": "budget",
         "rollback": {"from_step": 27, "signal_began": 25, "to_step": None, "reason": "spent"}},
    ]  # fmt: skip
    acts = guard_actions(records)
    assert [a["step"] for a in acts] == [21, 3, 27]
    assert acts[0]["rollback_from"] == 21 and acts[0]["rollback_to"] == 15
    assert action_text(acts[0]) == "21 lower_staleness (16->4), back to 15"
    assert action_text(acts[1]) == "3 lower_lr, no rollback: no checkpoint before step 2"
    assert action_text(acts[2]) == "27 stop (spent)"


def _rec(step: int, elapsed: float, wall: float) -> dict:
    return {"step": step, "elapsed_s": elapsed, "wall_s": wall}


def test_rollback_time_and_the_steps_before_the_first_rollback():
    # steps 1-3 (kept), 4-5 thrown away by a rollback at step 5 to the checkpoint of step 3,
    # then 4 again: it starts at 30.0 - 2.0 = 28.0, step 5 ended at 20.0: 8.0 s of rollback
    kept = [_rec(1, 2.0, 2.0), _rec(2, 4.0, 2.0), _rec(3, 6.0, 2.0), _rec(4, 30.0, 2.0)]
    superseded = [_rec(4, 10.0, 4.0), _rec(5, 20.0, 10.0)]
    records = chronological(kept, superseded)
    assert [r["elapsed_s"] for r in records] == [2.0, 4.0, 6.0, 10.0, 20.0, 30.0]
    assert [r["step"] for r in first_lineage(records)] == [1, 2, 3, 4, 5]
    assert rollback_seconds(records, [5]) == [8.0]
    # the step after it took 2.0 s; the step walls sorted are 2, 2, 2, 2, 4, 10: median 2.0
    assert refill_seconds(records, [5]) == [0.0]
    slow = [*records[:5], _rec(4, 36.0, 8.0)]
    assert refill_seconds(slow, [5]) == [5.0]  # 2, 2, 2, 4, 8, 10: median 3.0; 8.0 - 3.0
    # a rollback at the last record has no next step
    assert math.isnan(rollback_seconds(records[:5], [5])[0])


def test_first_difference_pairs_the_records_in_order():
    a = [{"step": 1, "pg_loss": 0.5}, {"step": 2, "pg_loss": 0.25}, {"step": 3, "pg_loss": 0.1}]
    assert first_difference(a, a) is None
    b = [*a[:2], {"step": 3, "pg_loss": 0.2}]
    assert first_difference(a, b, keys=("pg_loss",)) == 3
    assert first_difference(a, a[:2]) is None  # over their common length


def test_fisher_two_sided():
    # 0 of 5 against 5 of 5: only this table and its mirror are as extreme;
    # each has probability 1 / C(10, 5) = 1/252, so p = 2/252
    assert fisher(0, 5, 5, 5) == pytest.approx(2 / 252, rel=1e-12)
    assert fisher(0, 3, 0, 10) == 1.0
    assert math.isnan(fisher(0, 0, 1, 5))


def _write_run(root: Path, archived: Path, guard: list[dict] | None = None) -> Path:
    """An archived run restored as a finished ``guard_act run`` directory."""
    record = read_archived_run(archived)
    run_dir = root / "arena" / record["run"]
    assert restore_runs(DEFAULT_ARCHIVE, [run_dir], record["warm_start_sha256"]) == [run_dir]
    (run_dir / "guard.jsonl").write_text("".join(json.dumps(g) + "\n" for g in guard or []))
    (run_dir / RUN_NOTE).write_text(json.dumps({"overrides": [], "guard_stopped_at": None}))
    return run_dir


def test_report_against_control_runs_instead_of_the_archive(tmp_path: Path):
    # the same archived run as the run with the guard and as its control run: the control
    # (not the cell's five archived runs) is what the run is set beside
    archived = DEFAULT_ARCHIVE / "method-ppo_decoupled_max_staleness-16_seed-0.json.gz"
    act = {"step": 22, "level": "act", "rule": "r", "action": "lower_staleness",
           "before": {"buffer.max_staleness": 16}, "after": {"buffer.max_staleness": 4},
           "rollback": {"from_step": 22, "signal_began": 20, "to_step": 20, "reason": ""}}  # fmt: skip
    _write_run(tmp_path / "act", archived, [act])
    _write_run(tmp_path / "warn", archived)
    other = DEFAULT_ARCHIVE / "method-ppo_decoupled_max_staleness-16_seed-1.json.gz"
    _write_run(tmp_path / "act", other)  # no control run: left out of the comparison
    assert [d.name for d in finished_runs(tmp_path / "act")] == [
        "method-ppo_decoupled_max_staleness-16_seed-0",
        "method-ppo_decoupled_max_staleness-16_seed-1",
    ]
    assert finished_runs(tmp_path / "none") == []
    with pytest.raises(FileNotFoundError, match="no finished run"):
        read_control_runs(tmp_path / "none")
    figure = tmp_path / "guard.png"
    js, tables = write_report(
        tmp_path / "act", tmp_path / "cmp.json", control_dir=tmp_path / "warn", figure=figure
    )
    report = json.loads(js.read_text())
    (cell,) = report["cells"]
    assert cell["archived_runs"] == 1 and cell["runs"] == 1 and cell["acted_on"] == 1
    (run,) = report["runs"]
    assert run["val_success"] == run["archived_val_success"]
    assert run["same_as_archive_until"] == 40 and len(run["malformed_curve"]) == 40
    assert report["compared_with"] == str(tmp_path / "warn")
    assert "final success (without)" in tables and "22 lower_staleness (16->4)" in tables
    assert figure.stat().st_size > 10_000
    # against the archive: the archived runs of the seeds re-run (two of the cell's five),
    # the whole cell's count beside them
    js, tables = write_report(tmp_path / "act", tmp_path / "cmp2.json")
    assert "| ppo_decoupled | 16 | 0 1 | 2 | 2 | 2 | 2 | 2 | 2 | 1.000 | 1.000 | 5 of 5 |" in tables
    (cell,) = json.loads(js.read_text())["cells"]
    assert (cell["archived_runs"], cell["cell_runs"], cell["cell_ended_low"]) == (2, 5, 5)
    # beside the method's archived runs at each lower staleness (the arena ran it at 4 only)
    assert "| ppo_decoupled | 16 | 2 of 2, 0.000 | 4: 2 of 10, 0.245, p = 0.091 |" in tables
    # runs longer than the archive's have no archived runs at a lower staleness to match
    for config in (tmp_path / "act").rglob("config.json"):
        config.write_text(config.read_text().replace('"num_steps": 40', '"num_steps": 80'))
    _, tables = write_report(tmp_path / "act", tmp_path / "cmp3.json")
    assert "| ppo_decoupled | 16 | 2 of 2, 0.000 | - |" in tables
