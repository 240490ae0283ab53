"""The stability benchmark's short version: the synthetic task built by its command, one
variant, two seeds run side by side (``parallel_runs = 2``, as the default grid), 5 learner
steps at an exact lag of 2 through the real pipeline (a Ray local cluster per run, HF
rollout actor, DeepSpeed learner, managed BM25 retrieval server, lagged weight sync);
asserts the pipeline and the logged staleness, not the science."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_experiment import build_tiny_task, tiny_run_overrides, write_experiment

from experiments.grid import run_experiment
from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration

LAG = 2
STEPS = 5
BATCH = 4


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_stability_grid_short(tmp_path: Path):
    data = tmp_path / "synthetic"
    report = build_tiny_task(data)
    assert report.built and report.num_records == 60
    overrides = tiny_run_overrides(data) | {
        "learner.train_batch_size": BATCH,
        "learner.mini_batch_size": BATCH,
        "learner.micro_batch_size": BATCH,
        "sft.num_demonstrations": 8,
        "sft.early_answer_share": 0.5,  # the answer grid's warm start, in small
        "run.eval_sampled": True,
        "sft.epochs": 1,
        "sft.batch_size": 8,
    }
    experiments = tmp_path / "experiments"
    write_experiment(
        experiments,
        "short",
        {"seeds": [0, 1], "num_steps": STEPS, "cells": True, "parallel_runs": 2},
        {
            "grid": {"algorithm.variant": ["st_ppo"], "buffer.max_staleness": [LAG]},
            "overrides": overrides,
        },
    )

    result = run_experiment("short", tmp_path / "runs", experiments_dir=experiments)

    for seed in (0, 1):
        run = tmp_path / "runs" / "short" / f"variant-st_ppo_max_staleness-{LAG}_seed-{seed}"
        steps = _lines(run / "steps.jsonl")
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        # exact lag: step t trains on trajectories generated min(t - 1, LAG) versions earlier
        consumed = _lines(run / "consumed.jsonl")
        assert [c["staleness"] for c in consumed] == [
            [min(t - 1, LAG)] * BATCH for t in range(1, STEPS + 1)
        ]
        assert [s["staleness_max"] for s in steps] == [min(t - 1, LAG) for t in range(1, STEPS + 1)]
        assert steps[-1]["trajectories_dropped_stale"] == 0
        # each run's own process wrote its console output beside its logs
        assert "[step 5/5" in (run / "console.log").read_text()
        assert json.loads((run / "config.json").read_text())["run"]["seed"] == seed
        # the end evaluation answered with the final policy, not the engines' lagged one
        # (the fixed lag held them at STEPS - LAG; they got version STEPS before it ran)
        for end in [e for e in _lines(run / "eval.jsonl") if e["tag"].startswith("end")]:
            versions = (end["engine_policy_version_min"], end["engine_policy_version_max"])
            assert versions == (end["policy_version"],) * 2, end
        samples = [r for r in _lines(run / "eval_samples.jsonl") if r["tag"] == "end"]
        assert samples and {r["policy_version_min"] for r in samples} == {
            steps[-1]["policy_version"]
        }
    # the per-cell summary reads the same logs
    cells = json.loads((run.parent / "cells.json").read_text())["cells"]
    assert len(cells) == 1
    cell = cells[0]
    assert (cell["variant"], cell["max_staleness"], cell["runs"]) == ("st_ppo", LAG, 2)
    assert cell["exact_staleness_share"] == 1.0
    assert cell["steps_mean"] == STEPS
    assert result.cells_md is not None and "| st_ppo | 2 | 2 | 5 |" in result.cells_md.read_text()
    assert (run.parent / "cells.png").stat().st_size > 10_000
    # the sampled evaluations ran and reached the cell; so did the per-seed values
    evals = {e["tag"] for e in _lines(run / "eval.jsonl")}
    assert {"start", "start_sampled", "end", "end_sampled"} <= evals
    assert cell["val_sampled_iqm"] is not None and len(cell["val_success_per_seed"]) == 2
    assert "answering after their first search" in (run / "console.log").read_text()


def test_parallel_grid_reports_failed_runs_and_starts_no_more(tmp_path: Path):
    """A run that fails in its pool process stops the grid with an error naming the run and
    its console.log (which holds the child's traceback); runs not started yet stay so."""
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    missing = tmp_path / "no-such-corpus.jsonl"  # the first thing a run needs, data or not
    (experiments / "broken.toml").write_text(
        "\n".join([
            f'base_config = "{PROJECT_ROOT / "deploy" / "configs" / "synthetic.toml"}"',
            "seeds = [0, 1, 2]",
            "num_steps = 1",
            "parallel_runs = 2",
            "[grid]",
            '"algorithm.variant" = ["ppo"]',
            "[overrides]",
            f'"retrieval.server.corpus_path" = "{missing}"',
        ]) + "\n"
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="grid run\\(s\\) failed") as err:
        run_experiment("broken", tmp_path / "runs", experiments_dir=experiments)
    grid = tmp_path / "runs" / "broken"
    for seed in (0, 1):
        log = grid / f"variant-ppo_seed-{seed}" / "console.log"
        assert f"{log}" in str(err.value)
        assert "Traceback" in log.read_text() and "no-such-corpus" in log.read_text()
    assert not (grid / "variant-ppo_seed-2").exists()
