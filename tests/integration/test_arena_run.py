"""The arena in small, through the real pipeline: 2 methods x 1 seed x 3 learner steps on a
tiny synthetic task (a Ray local cluster per run, HF rollout actor, DeepSpeed learner,
managed BM25 retrieval server), two runs side by side, then the leaderboard; asserts the
plumbing (methods reach the learner, the leaderboard reads the runs), not the science. Then
the grid's archive: on a machine without the run directories the grid trains nothing and
writes the same leaderboard from the archived runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_experiment import build_tiny_task, tiny_run_overrides, write_experiment

from experiments.grid import read_jsonl, run_experiment

pytestmark = pytest.mark.integration


def test_a_two_method_arena_writes_its_leaderboard(tmp_path: Path, capsys: pytest.CaptureFixture):
    data = tmp_path / "synthetic"
    build_tiny_task(data)
    overrides = tiny_run_overrides(data) | {
        "sft.enabled": False,
        "learner.train_batch_size": 4,
        "learner.mini_batch_size": 2,
        "learner.micro_batch_size": 2,
    }
    experiments = tmp_path / "experiments"
    write_experiment(
        experiments,
        "tiny_arena",
        {"seeds": [0], "num_steps": 3, "parallel_runs": 2, "leaderboard": True,
         "baseline_method": "ppo_behavior", "archive_dir": str(tmp_path / "archive")},
        {
            "grid": {"method": ["ppo_behavior", "ppo_icepop"], "buffer.max_staleness": [1]},
            "overrides": overrides,
            "methods.ppo_behavior": {"algorithm.variant": "ppo", "algorithm.off_policy": "behavior"},
            "methods.ppo_icepop": {
                "algorithm.variant": "ppo",
                "algorithm.off_policy": "decoupled",
                "algorithm.rollout_correction.is_cap": 5.0,
                "algorithm.rollout_correction.mask_level": "token",
                "algorithm.rollout_correction.mask_low": 0.5,
                "algorithm.rollout_correction.mask_high": 5.0,
            },
        },
    )  # fmt: skip

    run_experiment("tiny_arena", tmp_path / "runs", experiments_dir=experiments)

    out = tmp_path / "runs" / "tiny_arena"
    for method in ("ppo_behavior", "ppo_icepop"):
        run = out / f"method-{method}_max_staleness-1_seed-0"
        steps = read_jsonl(run / "steps.jsonl", "step")
        assert [s["step"] for s in steps] == [1, 2, 3]
        config = json.loads((run / "config.json").read_text())
        assert config["run"]["label"] == method
        # the objective reached the learner: no proximal under `behavior`, a mask otherwise
        masked = [s["behavior_masked"] for s in steps]
        if method == "ppo_behavior":
            assert all(m is None or m != m for m in masked)  # NaN: nothing to correct
        else:
            assert all(0.0 <= m <= 1.0 for m in masked)
        assert "stabilisers over 3 steps" in (run / "console.log").read_text()
    board = json.loads((out / "leaderboard.json").read_text())
    rows = {r["method"]: r for r in board["rows"]}
    assert set(rows) == {"ppo_behavior", "ppo_icepop"} and board["unfinished_runs"] == 0
    assert rows["ppo_icepop"]["runs"] == 1 and rows["ppo_icepop"]["step_time_vs_baseline"] > 0
    assert len(board["bias_norm_over_tau"]) == 2
    assert "### Staleness 1" in (out / "leaderboard.md").read_text()
    assert (out / "leaderboard_intervals.png").stat().st_size > 5_000

    # the archive: one file per finished run; a new machine (no run directories) restores
    # them, trains nothing and writes the same leaderboard
    archived = sorted(p.name for p in (tmp_path / "archive").iterdir())
    assert archived == [f"method-{m}_max_staleness-1_seed-0.json.gz"
                        for m in ("ppo_behavior", "ppo_icepop")]  # fmt: skip
    first_console = capsys.readouterr().out
    for m in ("ppo_behavior", "ppo_icepop"):  # archived as it finished, not at the end
        assert f"method-{m}_max_staleness-1_seed-0 archived in" in first_console
    shutil.rmtree(tmp_path / "runs")
    run_experiment("tiny_arena", tmp_path / "runs", experiments_dir=experiments)
    console = capsys.readouterr().out
    assert "2 finished run(s) restored" in console and console.count("finished before") == 2
    assert json.loads((out / "leaderboard.json").read_text())["rows"] == board["rows"]
