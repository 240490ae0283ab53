"""Re-runs of arena cells with the stability guard acting (experiments/guard_act.py): the
planning (the grid's config and seeds with the overrides) and the reading of a re-run's
records (its actions, the steps a rollback threw away and their time, Fisher's test). The
runs themselves are not run here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiments.guard_act import (
    ACT_OVERRIDES,
    action_text,
    chronological,
    first_difference,
    first_lineage,
    fisher,
    guard_actions,
    plan_cell,
    refill_seconds,
    rollback_seconds,
)


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
