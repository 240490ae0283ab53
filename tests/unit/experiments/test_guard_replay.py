"""The offline replay of archived runs through the stability guard
(experiments/guard_replay.py): the guard's defaults against the off-policy arena's archive."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiments.guard_replay import DEFAULT_ARCHIVE, fall_step, run_replay, write_replay
from services.env import PROJECT_ROOT

ARCHIVE = PROJECT_ROOT / DEFAULT_ARCHIVE


def test_fall_step_is_the_degrading_measure_at_every_step():
    assert fall_step([0.0] * 10) is None
    # trailing mean over 5 steps (fewer at the start) above 0.1
    assert fall_step([0.0, 0.0, 0.0, 0.0, 0.3, 0.3]) == 6  # 0.3 / 5 = 0.06, then 0.12
    assert fall_step([0.5]) == 1
    assert fall_step([math.nan, 0.0]) is None


@pytest.mark.skipif(not ARCHIVE.exists(), reason="the arena's archive is not in this checkout")
def test_the_defaults_catch_falls_early_and_leave_the_healthy_cells_alone(tmp_path: Path):
    runs, cells, head, guard = run_replay(ARCHIVE)
    assert head.runs == len(runs) >= 290 and guard["mode"] == "act"
    assert head.healthy_runs == 60 and head.healthy_acted == 0
    assert head.fell_acted_before_fall >= 30 and head.lead_steps_median >= 10
    decoupled_16 = next(c for c in cells if (c.method, c.staleness) == ("ppo_decoupled", 16))
    assert decoupled_16.fell_acted_before_fall == decoupled_16.runs == 5
    # inverted rules would act on every healthy run
    inverted = [
        'guard.rules=[{signal="behavior_log_ratio_abs_mean",below=0.1},'
        '{signal="malformed_rate",below=0.5}]'
    ]
    _, _, bad, _ = run_replay(ARCHIVE, inverted)
    assert bad.healthy_acted == bad.healthy_runs
    md, js = write_replay(tmp_path / "replay", ARCHIVE)
    assert "| ppo_decoupled | 16 | 5 | 5 | 5 | 5 |" in md.read_text() and js.exists()
