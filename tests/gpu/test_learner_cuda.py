"""The DeepSpeed learner on a CUDA device (nccl, single process) on the tiny Llama.

What the CPU suite cannot check: that the learner's numbers on CUDA equal a plain Hugging
Face forward on the CPU, that every variant steps under bf16 on the GPU, that DeepSpeed's
bf16 overflow check on CUDA skips a poisoned step, and that exported weights come back as
CPU tensors (what the object store ships to the rollout engines).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from host_syncs import count_syncs
from learner_factories import expected_sft_loss, make_batch, make_uneven_batch
from transformers import AutoModelForCausalLM

from learner.config import VARIANT_CONFIGS, LearnerConfig, PPOConfig, STPPOConfig
from learner.trainer import Learner

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def config(**overrides) -> LearnerConfig:
    base = dict(
        train_batch_size=4, mini_batch_size=2, micro_batch_size=2, actor_lr=1e-3, critic_lr=1e-3
    )
    return LearnerConfig(**{**base, **overrides})


def test_supervised_loss_on_cuda_equals_a_cpu_forward(tiny_llama_dir: Path):
    learner = Learner(tiny_llama_dir, config(dtype="fp32", zero_stage=0), PPOConfig(), seed=0)
    assert learner.device.type == "cuda"
    cpu = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    cpu.load_state_dict(learner.export_weights().state_dict)
    trajectories = make_batch(0)
    expected = expected_sft_loss(cpu, trajectories, learner.pad_token_id)

    metrics = learner.supervised_step(trajectories)
    assert metrics.loss == pytest.approx(expected, rel=1e-4)
    exported = learner.export_weights().state_dict
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in exported.values())
    before = cpu.state_dict()
    assert not all(torch.equal(exported[k], before[k]) for k in exported)  # it trained


@pytest.fixture(scope="module")
def bf16_learner(tiny_llama_dir: Path) -> Learner:
    return Learner(tiny_llama_dir, config(dtype="bf16", zero_stage=2), STPPOConfig(), seed=0)


@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_every_variant_steps_on_cuda_bf16(bf16_learner: Learner, variant: str):
    # ratios against the behaviour log-probs (drawn far from the model's: tokens clip); the
    # `decoupled` ratio is against the proximal policy, 1 at the first mini-batch
    bf16_learner.set_algorithm(VARIANT_CONFIGS[variant](off_policy="behavior"))
    before = bf16_learner.export_weights().state_dict
    version = bf16_learner.policy_version
    metrics = bf16_learner.step(make_batch(1))
    assert metrics.variant == variant and metrics.skipped_steps == 0
    assert metrics.policy_version == version + 1
    assert math.isfinite(metrics.grad_norm) and 0.0 < metrics.clip_ratio <= 1.0
    after = bf16_learner.export_weights().state_dict
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_nonfinite_batch_is_skipped_on_cuda_bf16(tiny_llama_dir: Path):
    learner = Learner(tiny_llama_dir, config(dtype="bf16", zero_stage=2), PPOConfig(), seed=0)
    poisoned = make_batch(7, num=2)
    poisoned[1].behavior_logprobs[0] = np.nan  # a policy token: the policy loss is NaN
    before = learner.export_weights().state_dict
    metrics = learner.step(poisoned)
    assert metrics.skipped_steps == 1 and metrics.nonfinite_steps_total == 1
    after = learner.export_weights().state_dict
    assert all(torch.equal(before[k], after[k]) for k in before)
    clean = learner.step(make_batch(8, num=2))
    assert clean.skipped_steps == 0


LAYOUTS = {
    "padded": {},
    "packed": {"pack_sequences": True},
    "varlen": {"pack_sequences": True, "packed_attention": "varlen"},
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_packed_step_on_cuda_equals_padded(tiny_llama_dir: Path, dtype: str):
    """Sequence packing on CUDA, with transformers' packed mask through the CUDA attention
    kernels and with the varlen attention (torch's FlashAttention varlen kernel in bf16,
    the per-segment loop in float32), fused AdamW: one step on uneven trajectories gives
    the padded step's losses, within 1e-5 in float32 and bf16 rounding in bf16."""
    metrics = {}
    for layout, overrides in LAYOUTS.items():
        learner = Learner(
            tiny_llama_dir,
            config(
                dtype=dtype,
                zero_stage=2,
                train_batch_size=6,
                mini_batch_size=6,
                micro_batch_size=6,
                **overrides,
            ),
            PPOConfig(),
            seed=0,
        )
        metrics[layout] = learner.step(make_uneven_batch())
    tolerance = 1e-5 if dtype == "fp32" else 2e-2
    for layout in ("packed", "varlen"):
        for key in ("pg_loss", "value_loss", "kl_ref", "entropy", "advantage_mean"):
            want, got = metrics["padded"][key], metrics[layout][key]
            assert got == pytest.approx(want, abs=tolerance), (layout, key)


def _cuda_syncs(learner: Learner, trajectories: list) -> Counter:
    """Synchronising CUDA calls in one learner step by site (``count_syncs``: PyTorch's
    ``set_sync_debug_mode`` warns at each one: a host read of a CUDA tensor, a blocking
    copy, ``nonzero``...)."""
    step = lambda: learner.step(trajectories)  # noqa: E731
    return count_syncs(step, learner.engines, learner.device)


@pytest.mark.parametrize("layout", ["packed", "varlen"])
def test_packed_micro_batches_add_no_host_sync_on_cuda(
    tiny_llama_dir: Path, layout, record_property
):
    """The CUDA side of ``tests/unit/learner/test_host_syncs.py``: eight micro-batches per step
    against two (the same optimizer steps), bf16, ZeRO-2, st_ppo (policy and critic). The
    six more micro-batches add no sync anywhere (this project's code, transformers' and
    DeepSpeed's: the packed layouts' masks come prepared, and varlen runs the kernel, which
    takes the segments on the device). The counts per step and per site go into the junit
    report."""
    syncs = {}
    for micro in (1, 4):
        learner = Learner(
            tiny_llama_dir,
            config(
                dtype="bf16",
                zero_stage=2,
                train_batch_size=8,
                mini_batch_size=4,
                micro_batch_size=micro,
                **LAYOUTS[layout],
            ),
            STPPOConfig(),
            seed=0,
        )
        learner.step(make_uneven_batch(0, 8))  # warm: allocations, pinned buffers
        syncs[micro] = _cuda_syncs(learner, make_uneven_batch(1, 8))
        record_property(f"syncs_per_step_micro{micro}", sum(syncs[micro].values()))
        record_property(f"sync_sites_micro{micro}", dict(syncs[micro].most_common()))
    added = {site for site in syncs[1] if syncs[1][site] > syncs[4][site]}
    assert not added, syncs


def test_packed_varlen_kernel_on_cuda_equals_segments():
    """torch's FlashAttention varlen kernel is there (torch >= 2.10 on CUDA) and computes
    the per-segment causal attention (the CPU twin) to bf16 rounding, with grouped-query
    heads, forward and backward."""
    from learner.attention import segment_attention, varlen_kernel

    kernel = varlen_kernel()
    assert kernel is not None, f"torch {torch.__version__} has no usable varlen_attn"
    torch.manual_seed(0)
    lengths = [700, 1, 129, 64, 300]
    total = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cot = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16)
    outputs, grads = [], []
    for attend in (lambda: kernel(q, k, v, cu, max(lengths), None),
                   lambda: segment_attention(q, k, v, cu, None)):  # fmt: skip
        out = attend()
        outputs.append(out.float())
        grads.append([g.float() for g in torch.autograd.grad((out * cot).sum(), (q, k, v))])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=2e-2)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=5e-2 * float(want.abs().max()))


def test_compiled_layers_on_cuda_equal_eager(tiny_llama_dir: Path):
    """``compile_layers`` with TorchInductor's Triton kernels (what the CPU suite cannot
    build in time): a packed bf16 ZeRO-2 step and an SFT step give the eager learner's
    losses to bf16 rounding."""
    metrics = {}
    for compiled in (False, True):
        learner = Learner(
            tiny_llama_dir,
            config(
                dtype="bf16", zero_stage=2, train_batch_size=6, mini_batch_size=6,
                micro_batch_size=3, pack_sequences=True, compile_layers=compiled,
            ),
            PPOConfig(),
            seed=0,
        )  # fmt: skip
        metrics[compiled] = (
            learner.step(make_uneven_batch()),
            learner.supervised_step(make_uneven_batch()),
        )
    assert all("forward" in block.__dict__ for block in learner.layer_compiler.blocks)
    for key in ("pg_loss", "value_loss", "kl_ref", "entropy"):
        assert metrics[True][0][key] == pytest.approx(metrics[False][0][key], abs=2e-2), key
    assert metrics[True][1].loss == pytest.approx(metrics[False][1].loss, abs=2e-2)


def test_memory_token_budget_settles_after_the_first_step(tiny_llama_dir: Path):
    """``micro_batch_tokens = -1`` on CUDA: at most 8,192 tokens before the first RL step
    (SFT steps do not settle it), then the budget from what that step measured: the
    states' and optimizer steps' peak and the bytes per token a micro-batch held."""
    from learner.micro_batches import FIRST_STEP_TOKEN_BUDGET

    learner = Learner(
        tiny_llama_dir,
        config(dtype="bf16", zero_stage=2, micro_batch_tokens=-1, pack_sequences=True),
        PPOConfig(),
        seed=0,
    )
    assert not learner.micro_batches.budget_settled
    first = learner.micro_batches.auto_micro_batch_tokens
    assert 256 <= first <= FIRST_STEP_TOKEN_BUDGET
    learner.supervised_step(make_batch(2))
    assert (
        not learner.micro_batches.budget_settled
        and learner.micro_batches.auto_micro_batch_tokens == first
    )
    metrics = learner.step(make_batch(2))
    assert metrics.skipped_steps == 0
    probe = learner.micro_batches.memory_probe
    assert learner.micro_batches.budget_settled and probe.optimizer_steps >= 2  # policy and critic
    assert set(probe.largest) == {"policy", "critic"} and probe.bytes_per_token > 0
    total = torch.cuda.get_device_properties(learner.device).total_memory
    # held while micro-batches run, at most what an optimizer step peaked at
    assert 0 < probe.state_bytes <= probe.optimizer_peak_bytes < total
    assert learner.micro_batches.auto_micro_batch_tokens >= 256
    assert learner.step(make_batch(2)).skipped_steps == 0  # the settled budget runs


def test_the_installed_torch_is_built_for_the_cuda_the_image_and_docs_name():
    """pyproject ``[tool.stppo] torch_cuda`` (what deploy/Dockerfile's base and the docs'
    driver floor follow) is what the installed CUDA torch was built for."""
    import tomllib

    from services.env import PROJECT_ROOT

    pinned = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["stppo"]
    assert torch.version.cuda is not None
    assert ".".join(torch.version.cuda.split(".")[:2]) == pinned["torch_cuda"]
