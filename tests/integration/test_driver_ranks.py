"""The whole service with a 2-rank learner group (real Ray local cluster, real retrieval
server, 2 rollout actors, 2 DeepSpeed learner ranks in a gloo group, tiny Llama): the run
trains, checkpoints with ``num_ranks = 2``, and ``--resume`` with ``num_ranks = 1`` fails at
start with an error naming both values instead of loading a mismatched optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixture_paths import FIXTURE_CORPUS

from services.config import load_config
from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration

FIXTURE_QA = PROJECT_ROOT / "tests" / "fixtures" / "qa"


def run_config(tmp_path: Path, model_dir: Path, **extra):
    overrides = {
        "run.name": "ranks",
        "run.output_dir": str(tmp_path / "runs"),
        "run.num_steps": 2,
        "run.eval_questions": 0,
        "model.path": str(model_dir),
        "data.qa_dir": str(FIXTURE_QA),
        "data.datasets": ["single_hop"],
        "retrieval.server.corpus_path": str(FIXTURE_CORPUS),
        "retrieval.server.index_dir": str(tmp_path / "index"),
        "retrieval.server.port": 0,
        "rollout.num_actors": 2,
        "rollout.prompts_per_batch": 1,
        "rollout.group_size": 2,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens_per_turn": 12,
        "rollout.max_response_tokens": 160,
        "rollout.max_information_tokens": 48,
        "algorithm.variant": "st_ppo",
        "learner.num_ranks": 2,
        "learner.train_batch_size": 4,
        "learner.mini_batch_size": 4,
        "learner.micro_batch_size": 1,
        "learner.zero_stage": 3,
        "learner.dtype": "fp32",
        "learner.actor_lr": 1e-3,
        "sft.enabled": False,
        "buffer.max_staleness": 1,
        "buffer.capacity": 12,
        "checkpoint.every_k_steps": 0,
        "ray.num_cpus": 3,
        "ray.rollout_actor_cpus": 0.5,
        "ray.learner_cpus": 1.0,
        "control.port": 0,
        "metrics.port": 0,
    }
    overrides.update(extra)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def test_run_with_two_learner_ranks_then_resume_with_one_fails_clearly(tmp_path, tiny_llama_dir):
    from services.driver import Driver

    cfg = run_config(tmp_path, tiny_llama_dir)
    state = Driver(cfg).run()
    assert state.learner_step == 2
    steps = [json.loads(line) for line in (cfg.run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    latest = cfg.run_dir / "checkpoints" / (cfg.run_dir / "checkpoints" / "latest").read_text()
    saved = json.loads((latest / "learner_state.json").read_text())
    assert (saved["num_ranks"], saved["zero_stage"]) == (2, 3)
    assert (latest / "hf_policy" / "config.json").exists()

    one = run_config(tmp_path, tiny_llama_dir, **{"learner.num_ranks": 1, "run.num_steps": 3})
    with pytest.raises(ValueError, match=r"num_ranks = 2.*num_ranks = 1"):
        Driver(one, resume=True).run()
