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


def _event(key, device_type, cpu_us=0.0, device_us=0.0, annotation=False):
    return SimpleNamespace(
        key=key,
        device_type=device_type,
        self_cpu_time_total=cpu_us,
        self_device_time_total=device_us,
        is_user_annotation=annotation,
    )


def test_profile_summary_counts_each_kernel_once():
    """On a GPU the profiler lists a kernel as a device event and in the self device time of
    the operator that launched it: the summary counts it once, under that operator's
    category; kernel time no operator launched is kept, as "other"; user annotations' device
    spans and the ProfilerStep marker are left out."""
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event("aten::mm", cpu, cpu_us=50, device_us=600),
        _event("sm90_xmma_gemm_bf16bf16_bf16f32", cuda, device_us=600),
        _event("aten::_fused_adamw_", cpu, cpu_us=20, device_us=300),
        _event("multi_tensor_apply_kernel", cuda, device_us=300),
        _event("Optimizer.step#AdamW.step", cpu, cpu_us=30, annotation=True),
        _event("Optimizer.step#AdamW.step", cuda, device_us=300, annotation=True),
        _event("ProfilerStep#0", cpu, cpu_us=200, device_us=0),
        _event("ncclDevKernel_AllReduce", cuda, device_us=100),
    ]
    gpu = _bench.summarize_profile(events, on_gpu=True)
    assert gpu["time_s"] == pytest.approx(1000e-6)
    assert gpu["by_category"] == pytest.approx({"matmul": 0.6, "optimizer": 0.3, "other": 0.1})
    assert [op for op, _ in gpu["top"]] == [
        "aten::mm",
        "aten::_fused_adamw_",
        "(kernels not under an operator)",
    ]
    assert gpu["top_kernels"][0] == ["sm90_xmma_gemm_bf16bf16_bf16f32", pytest.approx(600e-6)]
    cpu_summary = _bench.summarize_profile(events, on_gpu=False)  # self CPU time of operators
    assert cpu_summary["time_s"] == pytest.approx(100e-6)  # the annotation's own 30 us too
    assert cpu_summary["by_category"] == pytest.approx({"matmul": 0.5, "optimizer": 0.5})
    assert "top_kernels" not in cpu_summary


def test_gpu_memory_gib_is_a_share_of_the_device(monkeypatch):
    from argparse import Namespace

    import torch

    args = Namespace(gpu_memory_fraction=0.9, gpu_memory_gib=66.7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _bench.gpu_memory_fraction(args) == 0.9  # no GPU: the fraction as given
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    h200 = SimpleNamespace(total_memory=int(139.8 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: h200)
    assert _bench.gpu_memory_fraction(args) == pytest.approx(66.7 / 139.8, rel=1e-6)
    args.gpu_memory_gib = 500.0
    assert _bench.gpu_memory_fraction(args) == 1.0
