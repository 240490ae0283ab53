"""The clipping-bias scale on the real DeepSpeed learner: one ``||C||`` and one ``s`` per
optimizer step (independent of ``micro_batch_size``), and ``scale_target = update`` shrinks
the AdamW step by exactly ``s`` where a loss multiplier barely moves it (spec section 6);
``scale_target = loss`` takes ``s`` from the pre-pass before the first backward, clipped flag
included (``divide``)."""

from __future__ import annotations

import pytest
import torch
from learner_factories import make_batch, make_tiny_learner

from learner.config import SPPOConfig, STPPOConfig
from learner.trainer import Learner

pytestmark = pytest.mark.integration


def displacement(learner: Learner, before: dict[str, torch.Tensor]) -> torch.Tensor:
    after = learner.export_weights().state_dict
    return torch.cat([(after[k] - before[k]).flatten() for k in sorted(before)])


@pytest.mark.parametrize("cls", [SPPOConfig, STPPOConfig])
def test_one_clip_bias_norm_per_optimizer_step_whatever_the_micro_batch(tiny_llama_dir, cls):
    algorithm = cls(off_policy="behavior", token_log_ratio_bound=None, tau=1e-3)
    runs = [
        make_tiny_learner(tiny_llama_dir, algorithm, micro_batch_size=m).step(make_batch(5))
        for m in (1, 2, 4)
    ]
    for other in runs[1:]:
        assert other.clip_bias_norm == pytest.approx(runs[0].clip_bias_norm, rel=1e-5)
        assert other.clip_bias_scale == pytest.approx(runs[0].clip_bias_scale, rel=1e-5)
    assert runs[0].clip_bias_scale < 1.0


@pytest.mark.parametrize(("target", "expect_half"), [("update", True), ("loss", False)])
def test_update_target_moves_parameters_exactly_s_times_as_far(tiny_llama_dir, target, expect_half):
    """From the same (fresh) AdamW state, s = 0.5 moves the parameters half as far as s = 1
    with ``scale_target = update``; as a loss multiplier Adam normalises it away."""
    unscaled = make_tiny_learner(
        tiny_llama_dir, STPPOConfig(off_policy="behavior", token_log_ratio_bound=None, tau=1e6)
    )
    start = unscaled.export_weights().state_dict
    first = unscaled.step(make_batch(6))
    assert first.clip_bias_scale == 1.0 and first.clip_bias_norm > 0.0
    full = displacement(unscaled, start)

    tau = first.clip_bias_norm / 2.0  # triggered scale: s = tau / ||C|| = 0.5
    scaled = make_tiny_learner(
        tiny_llama_dir,
        STPPOConfig(
            off_policy="behavior", token_log_ratio_bound=None, tau=tau, scale_target=target
        ),
    )
    second = scaled.step(make_batch(6))
    assert second.clip_bias_scale == pytest.approx(0.5, rel=1e-5)
    ratio = float(displacement(scaled, start).norm() / full.norm())
    if expect_half:
        torch.testing.assert_close(
            displacement(scaled, start), 0.5 * full, rtol=1e-4, atol=1e-7
        )  # fp32 ulp of the weights
    else:
        assert ratio > 0.8  # AdamW's first step is ~lr * sign(g): the multiplier cancels


@pytest.mark.parametrize(("bias_norm", "micro"), [("logprob", 1), ("logprob", 4), ("param", 2)])
def test_divide_scale_comes_from_the_pre_pass_when_tokens_clip(tiny_llama_dir, bias_norm, micro):
    """``normalize_mode = divide``, ``scale_target = loss``: the pre-pass before the first
    backward measures ||C|| and whether any token clipped, and the loss is multiplied by
    s = 1 / (||C|| + delta) when one did (by 1 when none did): the gradient is s times the
    unscaled one (the same first step with s = 1 from an unreachable tau)."""

    def first_step(**options):
        algorithm = STPPOConfig(
            off_policy="behavior",
            token_log_ratio_bound=None,
            scale_target="loss",
            bias_norm=bias_norm,
            **options,
        )
        learner = make_tiny_learner(tiny_llama_dir, algorithm, micro_batch_size=micro)
        return learner.step(make_batch(5))

    unscaled = first_step(tau=1e6)
    divided = first_step(normalize_mode="divide")
    assert unscaled.clip_bias_scale == 1.0 and divided.clip_ratio > 0.0
    assert divided.clip_bias_norm == pytest.approx(unscaled.clip_bias_norm, rel=1e-5)
    scale = 1.0 / (divided.clip_bias_norm + 1e-8)
    assert divided.clip_bias_scale == pytest.approx(scale, rel=1e-5)
    assert scale != pytest.approx(1.0, rel=1e-2)
    assert divided.grad_norm == pytest.approx(scale * unscaled.grad_norm, rel=1e-4)
