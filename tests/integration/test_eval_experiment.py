"""``stppo experiment`` end to end on the tiny Llama: a 2-run grid (ppo, st_ppo) x 2 learner
steps through the real driver (Ray local cluster, DeepSpeed learner, BM25 retrieval server on
the fixture corpus), then the summary files and the overlaid figure."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fixture_paths import FIXTURE_CORPUS

from experiments.grid import run_experiment
from services.env import PROJECT_ROOT
from services.plots import read_run

pytestmark = pytest.mark.integration

FIXTURE_QA = PROJECT_ROOT / "tests" / "fixtures" / "qa"


def test_tiny_grid_runs_and_summarises(tmp_path: Path, tiny_llama_dir: Path):
    overrides = {
        "run.eval_questions": 2,
        "model.path": str(tiny_llama_dir),
        "data.qa_dir": str(FIXTURE_QA),
        "data.datasets": ["single_hop"],
        "retrieval.server.corpus_path": str(FIXTURE_CORPUS),
        "retrieval.server.index_dir": str(tmp_path / "index"),
        "retrieval.server.port": 0,
        "rollout.num_actors": 1,
        "rollout.prompts_per_batch": 2,
        "rollout.group_size": 2,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens_per_turn": 8,
        "rollout.max_response_tokens": 96,
        "rollout.max_information_tokens": 48,
        "learner.train_batch_size": 4,
        "learner.mini_batch_size": 2,
        "learner.micro_batch_size": 2,
        "learner.zero_stage": 1,
        "learner.dtype": "fp32",
        "learner.actor_lr": 1e-3,
        "sft.num_demonstrations": 4,
        "sft.batch_size": 2,
        "sft.epochs": 1,
        "buffer.max_staleness": 1,
        "buffer.capacity": 12,
        "checkpoint.every_k_steps": 0,
        "ray.num_cpus": 2,
        "ray.rollout_actor_cpus": 0.5,
        "ray.learner_cpus": 1.0,
        "control.port": 0,
        "metrics.port": 0,
    }
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    lines = ["seeds = [3]", "num_steps = 2", "shared_warm_start = true"]
    lines += ["[grid]", '"algorithm.variant" = ["ppo", "st_ppo"]']
    lines += ["[overrides]", *(f'"{k}" = {json.dumps(v)}' for k, v in overrides.items())]
    (experiments / "tiny.toml").write_text("\n".join(lines) + "\n")

    result = run_experiment("tiny", tmp_path / "runs", experiments_dir=experiments)

    out = tmp_path / "runs" / "tiny"
    # the warm start ran once (SFT, 0 learner steps) and both runs started from its export
    policy = out / "warm_start" / "checkpoints" / "step_000000" / "hf_policy"
    assert (policy / "config.json").exists()
    sft = [json.loads(x) for x in (out / "warm_start" / "sft.jsonl").read_text().splitlines()]
    assert len(sft) == 1 and sft[0]["num_steps"] >= 1
    names = ["variant-ppo_seed-3", "variant-st_ppo_seed-3"]
    payload = json.loads((out / "summary.json").read_text())
    assert payload["warm_start"] == sft
    assert [r["run"] for r in payload["runs"]] == names
    assert [r["variant"] for r in payload["runs"]] == ["ppo", "st_ppo"]
    for name in names:
        cfg = json.loads((out / name / "config.json").read_text())
        assert (cfg["model"]["path"], cfg["sft"]["enabled"]) == (str(policy), False)
        # SFT is off in the grid runs: no before_warm_start evaluation, no sft.jsonl
        evals = [json.loads(x) for x in (out / name / "eval.jsonl").read_text().splitlines()]
        assert [e["tag"] for e in evals] == ["start", "end"]
    for row in payload["runs"]:
        assert (row["num_steps"], row["seed"], row["max_staleness"]) == (2, 3, 1)
        assert row["collapsed"] is None  # 2 steps < last_k + 1 = 4: cannot be judged
        assert 0.0 <= row["clip_ratio_mean"] <= 1.0
        assert 0.0 <= row["val_success_final"] <= 1.0
    # the summary means are the means of what the runs logged
    for name, row in zip(names, payload["runs"], strict=True):
        steps = [json.loads(x) for x in (out / name / "steps.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2]
        assert row["clip_ratio_mean"] == pytest.approx(sum(s["clip_ratio"] for s in steps) / 2)
        assert row["train_success_last"] == steps[-1]["success_rate"]
    assert result.summary_md.read_text().count("| variant-") == 2
    assert "| n/a |" in result.summary_md.read_text()
    assert result.figure == out / "curves.png" and result.figure.stat().st_size > 10_000
    # each run's driver.log handler is closed after the run (none left pointing into out/)
    assert (out / names[0] / "driver.log").exists()
    handlers = logging.getLogger("stppo").handlers
    assert not [h for h in handlers if str(out) in str(getattr(h, "baseFilename", ""))]
    assert [read_run(out / n).label for n in names] == [f"{names[0]} (ppo)", f"{names[1]} (st_ppo)"]

    # a second call skips finished runs and rewrites the same summary
    again = run_experiment("tiny", tmp_path / "runs", experiments_dir=experiments)
    assert [s.num_steps for s in again.summaries] == [2, 2]
    assert len((out / names[0] / "steps.jsonl").read_text().splitlines()) == 2
