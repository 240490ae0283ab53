"""The learner benchmark's model-FLOP count (benchmarks/learner_step.py), by hand on
SmolLM2-135M's shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from learner_factories import make_batch
from script_modules import load_script

from learner.config import GRPOConfig, PPOConfig, STPPOConfig
from services.env import PROJECT_ROOT

_bench = load_script(PROJECT_ROOT / "benchmarks" / "learner_step.py", "learner_step_benchmark")
flops_per_token, padded_tokens, step_flops = (
    _bench.flops_per_token,
    _bench.padded_tokens,
    _bench.step_flops,
)

SMOLLM2 = SimpleNamespace(
    hidden_size=576,
    num_attention_heads=9,
    head_dim=64,
    num_key_value_heads=3,
    intermediate_size=1536,
    num_hidden_layers=30,
    vocab_size=49152,
)
# per layer: q 576*576 = 331,776; k, v 2*576*192 = 221,184; o 331,776;
# MLP 3*576*1536 = 2,654,208; sum 3,538,944; x 30 layers x 2 = 212,336,640 per token
BACKBONE = 212_336_640.0
HEAD = 2.0 * 576 * 49152  # 56,623,104 per policy token


def test_flops_per_token_smollm2():
    assert flops_per_token(SMOLLM2) == (BACKBONE, HEAD)


def test_step_flops_by_variant():
    n, n_pol = 1000, 300
    pol = BACKBONE * n + HEAD * n_pol
    crit = BACKBONE * n
    # st_ppo (decoupled, critic): reference + old values + proximal, then 3 x policy + 3 x critic
    assert step_flops(STPPOConfig(off_policy="decoupled"), SMOLLM2, n, n_pol, 1) == pytest.approx(
        pol + crit + pol + 3 * pol + 3 * crit
    )
    # ppo with the behaviour policy: no proximal forward; two epochs
    ppo = PPOConfig(off_policy="behavior", clip_ratio_c=None)
    assert step_flops(ppo, SMOLLM2, n, n_pol, 2) == pytest.approx(
        pol + crit + 2 * (3 * pol + 3 * crit)
    )
    # grpo with the behaviour policy: reference + 3 x policy, no critic
    grpo = GRPOConfig(off_policy="behavior", clip_ratio_c=None)
    assert step_flops(grpo, SMOLLM2, n, n_pol, 1) == pytest.approx(pol + 3 * pol)
    # scale_target = loss adds a no-grad pre-pass; bias_norm = param a forward + backward
    loss = STPPOConfig(off_policy="behavior", scale_target="loss")
    assert step_flops(loss, SMOLLM2, n, n_pol, 1) == pytest.approx(pol + crit + 4 * pol + 3 * crit)
    param = STPPOConfig(off_policy="behavior", bias_norm="param")
    assert step_flops(param, SMOLLM2, n, n_pol, 1) == pytest.approx(pol + crit + 6 * pol + 3 * crit)
    assert step_flops(None, SMOLLM2, n, n_pol, 1) == pytest.approx(3 * pol)  # SFT


def test_padded_tokens():
    trajectories = make_batch(0)  # prompts 5..8 tokens, responses 10 tokens
    # micro 2: rows (5, 6) -> width 6 + 10, rows (7, 8) -> 8 + 10: 2*16 + 2*18 = 68
    assert padded_tokens(trajectories, 2) == 68
    assert padded_tokens(trajectories, 1) == 5 + 6 + 7 + 8 + 4 * 10


@pytest.mark.parametrize(
    ("op", "category"),
    [
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),  # not elementwise although it starts with aten::add
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::_softmax_backward_data", "softmax / log-sum-exp"),
        ("aten::logsumexp", "softmax / log-sum-exp"),
        ("aten::copy_", "dtype copies"),
        ("aten::_foreach_add_", "optimizer"),
        ("Optimizer.step#AdamW.step", "optimizer"),
        ("aten::mul", "elementwise"),
        ("aten::empty", "other"),
    ],
)
def test_profile_categories(op, category):
    assert _bench.op_category(op) == category


def test_path_budget_suffix():
    paths = _bench.PATHS
    assert _bench.path_config("packed@4096", paths)["micro_batch_tokens"] == 4096
    assert _bench.path_config("packed", paths) == paths["packed"]
    assert _bench.path_config("new@-1", paths)["micro_batch_tokens"] == -1
    with pytest.raises(ValueError, match="by count"):
        _bench.path_config("chunked@4096", paths)
    with pytest.raises(ValueError, match="unknown path"):
        _bench.path_config("fast", paths)


def test_named_shapes_are_the_published_configs():
    """SmolLM2-360M / 1.7B and Llama-3.2-3B shapes (their config.json on the Hub): heads
    divide the hidden size, key-value heads divide the heads."""
    shapes = _bench.SHAPES
    assert shapes["1.7b"]["hidden_size"] == 2048 and shapes["1.7b"]["num_hidden_layers"] == 24
    for shape in shapes.values():
        if shape:
            assert shape["hidden_size"] % shape["num_attention_heads"] == 0
            assert shape["num_attention_heads"] % shape["num_key_value_heads"] == 0
