"""The learner's memory plan (learner.memory_plan): exact parameter counts, calibration on
the committed H200 learner runs, and a refusal that names the rank, the bytes and what fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from learner.memory_plan import (
    GIB,
    SHAPES_DIR,
    MemoryPlanError,
    ModelShape,
    check_at_start,
    check_learner_fits,
    learner_rank_memory,
    settings_that_fit,
    shape_names,
)

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"

# benchmarks/learner_step.py's "3b" shape: the 1.7B shape's vocabulary with these layers
THREE_B = {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "intermediate_size": 8192, "head_dim": 128}  # fmt: skip


def measured_shape(name: str) -> ModelShape:
    data = json.loads((SHAPES_DIR / "smollm2-1.7b.config.json").read_text())
    if name == "3b":
        data.update(THREE_B)
    return ModelShape.from_config(AutoConfig.for_model(data.pop("model_type"), **data), name)


@pytest.mark.parametrize("name", ["1.7b", "3b"])
def test_the_plan_is_calibrated_on_the_h200_runs(name):
    """The H200 runs measured the model states one rank held at ZeRO-2 in bf16 (the memory
    probe's ``state_bytes``) and what a micro-batch held per token: the plan is within 15%
    of both (it is 5% above the states)."""
    run = json.loads((RESULTS / f"learner_step_h200_budget_{name}.json").read_text())
    shape = measured_shape(name)
    assert shape.policy == run["parameters"]  # counted exactly, tied embeddings once
    assert run["config"]["zero_stage"] == 2 and run["config"]["dtype"] == "bf16"
    probe = run["memory_probe"]
    tokens = probe["largest"]["policy"][0]
    plan = learner_rank_memory(shape, zero_stage=2, ranks=1, bf16=True, micro_batch_tokens=tokens)
    assert plan.states / probe["state_bytes"] == pytest.approx(1.0, abs=0.15)
    per_token = plan.activations / tokens
    assert per_token / probe["bytes_per_token"] == pytest.approx(1.0, abs=0.15)


def test_named_shapes_count_their_parameters():
    assert {"qwen2.5-7b", "qwen2.5-3b", "smollm2-1.7b"} <= set(shape_names())
    seven = ModelShape.load("qwen2.5-7b")
    assert seven.policy == 7_615_616_512  # Qwen2.5-7B: 7.62B, untied
    # the critic has the backbone and a value head, not the 152064 x 3584 LM head
    assert seven.critic == seven.policy - 152_064 * 3_584 + 3_584 + 1
    assert seven.largest_layer == 152_064 * 3_584  # an embedding (or the LM head)
    with pytest.raises(FileNotFoundError, match=r"named shapes: qwen2\.5-3b"):
        ModelShape.load("no-such-shape")


def test_zero3_shards_what_zero2_replicates():
    seven = ModelShape.load("qwen2.5-7b")
    plans = {
        (stage, ranks): learner_rank_memory(
            seven, zero_stage=stage, ranks=ranks, bf16=True, micro_batch_tokens=1024
        )
        for stage in (2, 3)
        for ranks in (1, 8)
    }
    # ZeRO-2: bf16 weights (2 B/param) and the reference stay whole on every rank
    assert plans[2, 8].reference == 2 * seven.policy == plans[2, 1].reference
    assert plans[2, 8].policy_states > 2 * seven.policy
    # ZeRO-3: everything but the gathered largest layer is divided by the ranks
    assert plans[3, 8].states < plans[2, 8].states
    assert plans[3, 8].reference == -(-2 * seven.policy // 8)
    assert plans[3, 8].export_transient == 1 << 30  # one bucket gathered at a time
    assert plans[2, 8].export_transient == 0
    whole = learner_rank_memory(
        seven, zero_stage=3, ranks=8, bf16=True, micro_batch_tokens=1024, bucket_bytes=1 << 40
    )
    assert whole.export_transient == 2 * seven.policy  # a bucket larger than the model


def test_offload_moves_the_optimizer_states_and_weights_to_the_host():
    """DeepSpeed's estimators with ``cpu_offload``: what stays on the GPU; the host holds
    12 bytes per parameter of optimizer states (and the weights with offload_params),
    partitioned over the ranks."""
    seven = ModelShape.load("qwen2.5-7b")
    common = dict(zero_stage=3, ranks=4, bf16=True, micro_batch_tokens=1024)
    plain, optimizer, both = (
        learner_rank_memory(seven, **common, offload_optimizer=opt, offload_params=params)
        for opt, params in ((False, False), (True, False), (True, True))
    )
    trained = seven.policy + seven.critic
    assert plain.host == 0
    assert optimizer.host == -(-12 * seven.policy // 4) + -(-12 * seven.critic // 4)
    assert optimizer.states < plain.states - 0.9 * 12 * trained / 4
    assert optimizer.optimizer_transient == 0  # the step runs on the host
    assert both.host > optimizer.host + 2 * trained / 4
    assert both.reference == 0 and both.states < optimizer.states
    # the 1.7B shape on one 80 GB GPU beside nothing else: ZeRO-2 with the optimizer
    # offloaded fits where it does not without
    small = ModelShape.load("smollm2-1.7b")
    budget = int(0.5 * 80e9)
    kwargs = dict(zero_stage=2, ranks=1, bf16=True, micro_batch_tokens=4096, device_bytes=budget)
    with pytest.raises(MemoryPlanError, match="offload"):
        check_learner_fits(small, **kwargs)
    assert check_learner_fits(small, **kwargs, offload_optimizer=True).peak <= budget


def test_7b_under_zero2_on_6_ranks_is_refused_naming_the_bytes_and_what_fits():
    seven = ModelShape.load("qwen2.5-7b")
    device = int(0.95 * 80e9)  # one 80 GB GPU, gpu_memory_fraction 0.95
    with pytest.raises(MemoryPlanError) as refused:
        check_learner_fits(
            seven, zero_stage=2, ranks=6, bf16=True, micro_batch_tokens=2048,
            device_bytes=device, rank=3,
        )  # fmt: skip
    message = str(refused.value)
    assert "learner rank 3 of 6 at zero_stage 2 needs" in message
    assert "GiB (policy" in message and "over the 70.8 GiB it may use" in message
    assert "fits with zero_stage 3 on" in message
    fitting = settings_that_fit(seven, device, bf16=True, micro_batch_tokens=2048, max_ranks=8)
    assert fitting and all(stage == 3 for stage, _ in fitting)  # ZeRO-2 never fits at 7B
    stage, ranks = fitting[0]
    plan = check_learner_fits(
        seven, zero_stage=stage, ranks=ranks, bf16=True, micro_batch_tokens=2048,
        device_bytes=device,
    )  # fmt: skip
    assert plan.peak <= device < 80 * GIB


def test_a_rank_checks_its_plan_before_allocating(tmp_path):
    """What ``Learner.__init__`` runs on CUDA before it loads a weight: a model folder
    (only its config.json) that cannot fit is refused with the rank named."""
    (tmp_path / "config.json").write_text((SHAPES_DIR / "qwen2.5-7b.config.json").read_text())
    with pytest.raises(MemoryPlanError, match="learner rank 0 of 1 at zero_stage 2"):
        check_at_start(tmp_path, zero_stage=2, ranks=1, bf16=True, device_bytes=80 * GIB, rank=0)
    plan = check_at_start(tmp_path, zero_stage=3, ranks=8, bf16=True, device_bytes=80 * GIB, rank=5)
    assert plan.micro_batch_tokens == 256 and plan.peak < 80 * GIB
