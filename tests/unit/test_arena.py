"""The arena's leaderboards (services.arena) and the stabiliser-activity line
(services.stabilisers) on run directories written by hand, numbers worked in comments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.arena import (
    bias_norm_distributions,
    leaderboard,
    read_run,
    write_leaderboards,
)
from services.collapse import CollapseRule
from services.config import load_config
from services.stabilisers import activity_line, stabiliser_activity

RULE = CollapseRule(window=1, last_k=2, drop=0.5)


def write_run(root: Path, method: str, staleness: int, seed: int, end: float, **step) -> Path:
    """A finished run: 4 steps of ``step`` fields (step_s 1.0 unless given), start 0.1."""
    run_dir = root / f"{method}_{staleness}_{seed}"
    run_dir.mkdir(parents=True)
    cfg = load_config(None, [f'run.label="{method}"', f"buffer.max_staleness={staleness}",
                             f"run.seed={seed}"])  # fmt: skip
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    steps = [{"step": i, "success_rate": 0.5, "step_s": 1.0, **step} for i in range(1, 5)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    evals = [{"tag": "start", "success_rate": 0.1}, {"tag": "end", "success_rate": end}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return run_dir


def test_leaderboard_ranks_compares_and_counts(tmp_path: Path):
    dirs = []
    for seed, (a, b) in enumerate([(0.5, 0.2), (0.6, 0.3), (0.7, 0.4)]):
        dirs.append(write_run(tmp_path, "base", 4, seed, b, clip_ratio=0.01, step_s=2.0))
        dirs.append(write_run(tmp_path, "good", 4, seed, a, clip_ratio=0.03, step_s=3.0,
                              behavior_masked=0.1))  # fmt: skip
    dirs.append(write_run(tmp_path, "base", 0, 0, 0.65))
    runs = [read_run(d, RULE) for d in dirs]
    rows = leaderboard(runs, baseline="base")
    board = [r for r in rows if r.staleness == 4]
    assert [r.method for r in board] == ["good", "base"]  # best IQM first
    good = board[0]
    # IQM of 3 values cuts floor(0.75) = 0 from each end: the mean, 0.6
    assert good.val_success_iqm == pytest.approx(0.6)
    assert good.gain_mean == pytest.approx(0.5)  # 0.6 - 0.1
    # every good run beats every base run: P(improve) = 1
    assert good.poi_vs_baseline == 1.0
    assert good.step_time_vs_baseline == pytest.approx(1.5)  # 3.0 / 2.0 (steps after the first)
    assert good.shares["clip_ratio"] == pytest.approx(0.03)
    assert good.shares["behavior_masked"] == pytest.approx(0.1)
    assert math.isnan(good.shares["m2po_masked"])  # never logged
    # vs on-policy: 0.6 - 0.65
    assert good.vs_on_policy == pytest.approx(-0.05)
    assert good.overlaps_best and not board[1].overlaps_best  # [.5, .7] vs [.2, .4]
    assert math.isnan(board[1].poi_vs_baseline)  # the baseline is not compared with itself


def test_bias_norm_distribution_counts_zero_and_triggering_steps(tmp_path: Path):
    run_dir = write_run(tmp_path, "st", 16, 0, 0.3)
    norms = [0.0, 0.0, 0.005, 0.02]  # ||C|| / 0.01 = 0, 0, 0.5, 2
    steps = [{"step": i + 1, "success_rate": 0.5, "clip_bias_norm": n, "step_s": 1.0}
             for i, n in enumerate(norms)]  # fmt: skip
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (dist,) = bias_norm_distributions([read_run(run_dir, RULE)])
    assert (dist.steps, dist.share_zero, dist.share_above_one) == (4, 0.5, 0.25)
    assert dist.quantiles["max"] == pytest.approx(2.0)
    assert dist.quantiles["0.5"] == pytest.approx(0.25)  # between 0 and 0.5


def test_write_leaderboards_writes_tables_and_figures(tmp_path: Path):
    dirs = [write_run(tmp_path / "runs", m, 4, s, 0.3 + 0.1 * s, clip_bias_norm=0.001)
            for m in ("a", "b") for s in range(2)]  # fmt: skip
    md = write_leaderboards(dirs, RULE, tmp_path / "out", baseline="a", extra={"x": 1})
    text = md.read_text()
    assert "### Staleness 4" in text and "| **a** | 2 |" in text
    data = json.loads((tmp_path / "out" / "leaderboard.json").read_text())
    assert data["x"] == 1 and len(data["rows"]) == 2 and data["unfinished_runs"] == 0
    for name in ("intervals", "curves", "bias_norm"):
        assert (tmp_path / "out" / f"leaderboard_{name}.png").stat().st_size > 0


def test_stabiliser_activity_line():
    steps = [
        {"clip_ratio": 0.0, "behavior_weight_capped": 0.02, "clip_bias_scale": 1.0},
        {"clip_ratio": 0.01, "behavior_weight_capped": 0.0, "clip_bias_scale": 0.5},
    ]
    act = stabiliser_activity(steps)
    assert act.shares["clip_ratio"] == pytest.approx(0.005)
    assert act.steps_acting == {"clip_ratio": 1, "token_bound_ratio": 0,
                                "behavior_weight_capped": 1, "behavior_masked": 0,
                                "m2po_masked": 0}  # fmt: skip
    assert (act.scale_min, act.scale_max, act.scale_steps_below_one) == (0.5, 1.0, 1)
    line = activity_line(act)
    assert line == (
        "stabilisers over 2 steps: clipped 0.50% of tokens (1 steps), truncated (TIS) 1.00% "
        "(1 steps); scale s 0.500-1.000 (< 1 in 1 steps)"
    )
    idle = activity_line(stabiliser_activity([{"clip_ratio": 0.0, "clip_bias_scale": 1.0}]))
    assert idle.endswith("-- none acted")
