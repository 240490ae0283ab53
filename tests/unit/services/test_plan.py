"""``stppo plan`` (services.plan): a run config's GPU memory per learner rank and per
engine, the exit status a script can test, and the shipped GPU config passing it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from learner.memory_plan import GIB, ModelShape
from services.cli import app
from services.config import load_config
from services.plan import PROMPT_TOKENS, plan_run

ROOT = Path(__file__).resolve().parents[3]
SEVEN_B = [
    "--shape", "qwen2.5-7b", 'learner.dtype="bf16"', "ray.learner_gpus=1",
    "ray.rollout_actor_gpus=1", 'rollout.engine="vllm"', "rollout.vllm_gpu_memory_utilization=0.5",
    'sync.transport="collective"', "learner.micro_batch_tokens=2048",
]  # fmt: skip


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *args], terminal_width=120)


def test_7b_under_zero2_on_6_ranks_does_not_fit_and_says_what_does():
    result = plan(*SEVEN_B, "learner.zero_stage=2", "learner.num_ranks=6")
    assert result.exit_code == 1, result.output
    assert "each of 6 rank(s) at zero_stage 2, bf16:" in result.output
    assert "DOES NOT FIT" in result.output and "GiB (policy 35.5 + critic 32.9" in result.output
    assert "learner settings that fit (up to 8 ranks): zero_stage 3 on" in result.output
    fitting = plan(*SEVEN_B, "learner.zero_stage=3", "learner.num_ranks=6")
    assert fitting.exit_code == 0, fitting.output
    assert "DOES NOT FIT" not in fitting.output


def test_the_collective_sync_holds_one_tensor_outside_vllms_budget():
    """The engine loads each received tensor as it arrives: beside vLLM's 0.9 of the GPU
    it holds at most the largest one (the embedding, 1.0 GiB at 7B), not the policy
    (14.2 GiB, which did not fit when the sync received a whole state dict)."""
    cfg = load_config(None, [*SEVEN_B[2:], "rollout.vllm_gpu_memory_utilization=0.9"])
    seven = ModelShape.load("qwen2.5-7b")
    result = plan_run(cfg, seven, int(79.6 * GIB))
    assert result.engine_bytes == int(0.9 * int(79.6 * GIB)) + 2 * seven.largest_layer
    assert result.engine_fits
    assert int(0.9 * int(79.6 * GIB)) + 2 * seven.policy > result.engine_budget
    assert result.sync_bytes == 2 * seven.policy


def test_micro_batches_by_count_are_planned_at_the_longest_trajectory():
    cfg = load_config(None, ["learner.micro_batch_size=4", "rollout.max_response_tokens=1024"])
    result = plan_run(cfg, ModelShape.load("smollm2-135m"), 80 * GIB)
    assert result.learner.micro_batch_tokens == 4 * (PROMPT_TOKENS + 1024)


GPU_CONFIGS = {  # every shipped config that asks for GPUs, with its model's shape and node
    "k8s_gpu.toml": ("smollm2-135m", None),
    "k8s_gpu_7b.toml": ("qwen2.5-7b", 8),
    "gpu_8gpu_7b.toml": ("qwen2.5-7b", 8),
    "gpu_1gpu.toml": ("smollm2-1.7b", 1),
}


def test_every_shipped_gpu_config_is_planned_here():
    from services.config import load_config

    asking = {
        p.name
        for p in (ROOT / "deploy" / "configs").glob("*.toml")
        if load_config(p).ray.learner_gpus > 0
    }
    assert asking == set(GPU_CONFIGS)


@pytest.mark.parametrize("config", sorted(GPU_CONFIGS))
def test_the_shipped_gpu_configs_pass_the_plan(config):
    shape, node_gpus = GPU_CONFIGS[config]
    node = ["--node-gpus", str(node_gpus)] if node_gpus else []
    result = plan(f"@{ROOT / 'deploy' / 'configs' / config}", "--shape", shape, *node)
    assert result.exit_code == 0, result.output
    assert "fits" in result.output and "DOES NOT FIT" not in result.output


def test_the_1gpu_recipe_fits_only_with_the_optimizer_on_the_host():
    recipe = f"@{ROOT / 'deploy' / 'configs' / 'gpu_1gpu.toml'}"
    result = plan(recipe, "--shape", "smollm2-1.7b", "--node-gpus", "1")
    assert "offloaded to host memory: 38.3 GiB per rank" in result.output
    refused = plan(recipe, "--shape", "smollm2-1.7b", "learner.offload_optimizer=false")
    assert refused.exit_code == 1 and "DOES NOT FIT" in refused.output


def test_a_model_without_a_config_is_a_clear_error():
    result = plan("model.path='/nowhere'")
    assert result.exit_code == 2
    assert "no model config at '/nowhere'" in result.output and "give --shape" in result.output


def test_the_7b_recipe_fits_one_node_of_8_gpus_and_not_under_zero2():
    recipe = f"@{ROOT / 'deploy' / 'configs' / 'gpu_8gpu_7b.toml'}"
    result = plan(recipe, "--shape", "qwen2.5-7b", "--node-gpus", "8")
    assert result.exit_code == 0, result.output
    assert "each of 6 rank(s) at zero_stage 3, bf16:" in result.output
    assert "DOES NOT FIT" not in result.output and "GPUs in all: 8" in result.output
    assert plan(recipe, "--shape", "qwen2.5-7b", "learner.zero_stage=2").exit_code == 1
    assert plan(recipe, "--shape", "qwen2.5-7b", "--node-gpus", "4").exit_code == 1
