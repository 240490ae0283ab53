"""The arena in small, through the real pipeline: 2 methods x 1 seed x 3 learner steps on a
tiny synthetic task (a Ray local cluster per run, HF rollout actor, DeepSpeed learner,
managed BM25 retrieval server), two runs side by side, then the leaderboard; asserts the
plumbing (methods reach the learner, the leaderboard reads the runs), not the science."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.env import PROJECT_ROOT
from services.experiment import run_experiment
from services.synthetic_task import SyntheticSpec, build_synthetic

pytestmark = pytest.mark.integration


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_a_two_method_arena_writes_its_leaderboard(tmp_path: Path):
    data = tmp_path / "synthetic"
    build_synthetic(data, SyntheticSpec(num_records=60, hidden_size=32, num_layers=1,
                                        num_heads=2, intermediate_size=64))  # fmt: skip
    overrides = {
        "model.path": str(data / "model" / "tiny-llama"),
        "data.qa_dir": str(data / "qa"),
        "retrieval.server.corpus_path": str(data / "corpus" / "passages.jsonl"),
        "retrieval.server.index_dir": str(data / "index"),
        "sft.enabled": False,
        "run.eval_questions": 2,
        "rollout.prompts_per_batch": 2,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens_per_turn": 12,
        "learner.train_batch_size": 4,
        "learner.mini_batch_size": 2,
        "learner.micro_batch_size": 2,
        "ray.rollout_actor_cpus": 0.5,
    }
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    lines = [
        f'base_config = "{PROJECT_ROOT / "deploy" / "configs" / "synthetic.toml"}"',
        "seeds = [0]",
        "num_steps = 3",
        "parallel_runs = 2",
        "leaderboard = true",
        'baseline_method = "ppo_behavior"',
        "[grid]",
        'method = ["ppo_behavior", "ppo_icepop"]',
        '"buffer.max_staleness" = [1]',
        "[overrides]",
        *(f'"{k}" = {json.dumps(v)}' for k, v in overrides.items()),
        "[methods.ppo_behavior]",
        '"algorithm.variant" = "ppo"',
        '"algorithm.off_policy" = "behavior"',
        "[methods.ppo_icepop]",
        '"algorithm.variant" = "ppo"',
        '"algorithm.off_policy" = "decoupled"',
        '"algorithm.rollout_correction.is_cap" = 5.0',
        '"algorithm.rollout_correction.mask_level" = "token"',
        '"algorithm.rollout_correction.mask_low" = 0.5',
        '"algorithm.rollout_correction.mask_high" = 5.0',
    ]
    (experiments / "tiny_arena.toml").write_text("\n".join(lines) + "\n")

    run_experiment("tiny_arena", tmp_path / "runs", experiments_dir=experiments)

    out = tmp_path / "runs" / "tiny_arena"
    for method in ("ppo_behavior", "ppo_icepop"):
        run = out / f"method-{method}_max_staleness-1_seed-0"
        steps = _lines(run / "steps.jsonl")
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
