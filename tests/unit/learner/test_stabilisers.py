"""Stabilisers of spec section 6 on the loss functions: token bound inside turns, dual clip,
low_var_kl, and their config validation (the behaviour weights: tests/unit/learner/test_corrections.py)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from learner import losses
from learner.config import PPOConfig, STPPOConfig


def one_turn(n: int = 64, drifted: float = -13.0, others: float = 0.05):
    """One 64-token turn: one token 13 nats below the behaviour policy, the rest slightly
    above, so the turn's mean log-ratio (-0.15) sits inside the clip range."""
    old = torch.zeros(1, n, dtype=torch.float64)
    logp = torch.full((1, n), others, dtype=torch.float64)
    logp[0, 7] = drifted
    mask = torch.ones(1, n)
    turn_ids = torch.zeros(1, n, dtype=torch.long)
    adv = -torch.ones(1, n, dtype=torch.float64)  # the turn is pushed down
    return logp.requires_grad_(True), old, adv, mask, turn_ids


def test_token_bound_stops_the_gradient_of_a_token_hiding_in_an_unclipped_turn():
    # mean log ratio = (63 * 0.05 - 13) / 64 = -0.154 > log(0.8) = -0.223: the turn is not clipped
    for bound, expect_grad in ((None, True), (0.4, False)):
        logp, old, adv, mask, turn_ids = one_turn()
        out = losses.compute_policy_loss(
            logp, old, adv, mask, turn_ids, ratio_level="turn", clip_eps_low=0.2,
            clip_eps_high=0.2, token_log_ratio_bound=bound,
        )  # fmt: skip
        out.loss.backward()
        assert float(out.metrics["clip_ratio"]) == 0.0
        assert (logp.grad[0, 7] != 0).item() is expect_grad
        assert logp.grad[0, 0] != 0  # the other tokens keep theirs
        if bound is not None:
            assert float(out.metrics["token_bound_ratio"]) == pytest.approx(1 / 64)
        assert float(out.metrics["token_log_ratio_abs_max"]) == pytest.approx(13.0)


def test_token_bound_acts_only_against_the_turn_advantage():
    # A > 0: a token far *below* (pushed up, towards the trust region) keeps its gradient
    logp, old, adv, mask, turn_ids = one_turn()
    out = losses.compute_policy_loss(
        logp, old, -adv, mask, turn_ids, ratio_level="turn", clip_eps_low=0.2,
        clip_eps_high=0.2, token_log_ratio_bound=0.4,
    )  # fmt: skip
    out.loss.backward()
    assert logp.grad[0, 7] != 0 and float(out.metrics["token_bound_ratio"]) == 0.0


def test_token_bound_is_ignored_by_token_ratios():
    logp, old, adv, mask, turn_ids = one_turn()
    kw = dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2)
    a = losses.compute_policy_loss(logp, old, adv, mask, turn_ids, **kw)
    b = losses.compute_policy_loss(logp, old, adv, mask, turn_ids, token_log_ratio_bound=0.4, **kw)
    assert torch.equal(a.loss, b.loss)


def test_dual_clip_caps_negative_advantage_loss():
    # ratio e^2 = 7.39 > c = 3 with A = -1: loss -A * c = 3 and no gradient (verl dual clip)
    logp = torch.tensor([[2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    mask, turn_ids = torch.ones(1, 2), torch.tensor([[0, 1]])
    kw = dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, loss_agg_mode="token-mean")
    out = losses.compute_policy_loss(logp, old, adv, mask, turn_ids, clip_ratio_c=3.0, **kw)
    out.loss.backward()
    # (3 + e^0.1) / 2
    assert float(out.loss) == pytest.approx((3.0 + math.exp(0.1)) / 2)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    assert float(out.metrics["clip_ratio_dual"]) == 0.5
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses.compute_policy_loss(logp, old, adv, mask, turn_ids, clip_ratio_c=1.1, **kw)


@pytest.mark.parametrize("level", ["token", "turn"])
def test_closed_form_clip_bias_equals_autograd_with_every_stabiliser(level):
    gen = torch.Generator().manual_seed(0)
    shape = (3, 12)
    logp = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.6
    old = torch.zeros(shape, dtype=torch.float64)
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = (torch.rand(shape, generator=gen) > 0.2).float()
    turn_ids = torch.where(mask > 0, torch.arange(12).expand(shape) // 4, -1)
    weights = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5
    kw = dict(
        ratio_level=level, clip_eps_low=0.2, clip_eps_high=0.2, token_log_ratio_bound=0.3,
        clip_ratio_c=1.5, behavior_weights=weights,
    )  # fmt: skip
    leaf = logp.clone().requires_grad_(True)
    surrogate = losses.clip_bias_surrogate(leaf, old, adv, mask, turn_ids, **kw)
    (auto,) = torch.autograd.grad(surrogate, leaf)
    closed = losses.clip_bias_logprob_grad(logp, old, adv, mask, turn_ids, **kw)
    torch.testing.assert_close(closed, auto * mask, rtol=1e-12, atol=1e-15)
    assert closed.abs().sum() > 0


def test_kl_estimator_error_names_the_field():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"^estimator must be one of"):
        losses.kl_penalty(logp, logp, "k2")  # type: ignore[arg-type]


def test_low_var_kl_is_bounded_where_k3_explodes():
    logp, ref = torch.tensor([[-12.0, -1.0]]), torch.tensor([[0.0, -1.1]])
    k3 = losses.kl_penalty(logp, ref, "k3")
    low = losses.kl_penalty(logp, ref, "low_var_kl")
    assert float(k3[0, 0]) == pytest.approx(math.exp(12) - 12 - 1)  # 1.6e5
    assert float(low[0, 0]) == 10.0
    assert float(low[0, 1]) == pytest.approx(float(k3[0, 1]))  # small gaps unchanged


def test_config_defaults_and_validation():
    cfg = STPPOConfig()
    assert (cfg.kl_estimator, cfg.off_policy, cfg.scale_target) == (
        "low_var_kl",
        "behavior",
        "update",
    )
    assert cfg.token_log_ratio_bound == 0.4 and cfg.clip_ratio_c == 3.0
    with pytest.raises(ValidationError, match="old_logprob_source was removed"):
        PPOConfig.model_validate({"old_logprob_source": "recompute"})
    with pytest.raises(ValidationError, match="clip_ratio_c"):
        PPOConfig(clip_eps_high=0.5, clip_ratio_c=1.4)
    # the old behaviour-weight options name their replacement (algorithm.rollout_correction)
    with pytest.raises(ValidationError, match=r"folded into algorithm\.rollout_correction"):
        PPOConfig.model_validate({"behavior_weight_cap": 3.0})
    with pytest.raises(ValidationError, match="is_cap"):
        PPOConfig.model_validate({"rollout_correction": {"is_cap": 1.0}})
    with pytest.raises(ValidationError, match="neither mask_low nor mask_high"):
        PPOConfig.model_validate({"rollout_correction": {"mask_level": "token"}})
    with pytest.raises(ValidationError, match=r"mask_low .* must be below mask_high"):
        PPOConfig.model_validate({"rollout_correction": {"mask_low": 2.0, "mask_high": 1.0}})
    with pytest.raises(ValidationError, match=r'm2po_threshold: .*off_policy = "decoupled"'):
        PPOConfig(off_policy="behavior", m2po_threshold=0.04)
    with pytest.raises(ValidationError, match="m2po_threshold masks"):
        PPOConfig(off_policy="decoupled", m2po_threshold=0.04, proximal="loglinear")
    with pytest.raises(ValidationError, match="loglinear"):
        PPOConfig(off_policy="behavior", proximal="loglinear")
    with pytest.raises(ValidationError, match="bias_norm = 'param'"):
        STPPOConfig(off_policy="decoupled", bias_norm="param", proximal="loglinear")
    # a rollout correction is the decoupled objective's: with the behaviour ratio it would
    # silently do nothing
    with pytest.raises(ValidationError, match="rollout_correction: only the decoupled objective"):
        PPOConfig.model_validate({"rollout_correction": {"is_level": "sequence"}})
    assert PPOConfig(off_policy="decoupled", rollout_correction={"is_level": "sequence"})


def test_token_bound_acts_only_in_the_advantage_direction_and_only_beyond_the_bound():
    """GMPO bound, one case per side of every comparison (mutation testing found the
    direction-0 tokens, the exact-bound tokens and the input errors unchecked)."""
    #              up-over  dir0-up  down-over up-below at+bound dir.5 dir0-down at-bound
    logr = torch.tensor([[0.6, 0.6, -0.6, -0.6, 0.4, 0.6, -0.6, -0.4]], dtype=torch.float64)
    direction = torch.tensor([[1.0, 0.0, -1.0, 1.0, 1.0, 0.5, 0.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 8)
    turn_ids = torch.arange(8).reshape(1, 8)
    out = losses.importance_log_ratios(
        logr, torch.zeros_like(logr), mask, turn_ids, ratio_level="token",
        token_log_ratio_bound=0.4, bound_direction=direction,
    )  # fmt: skip
    expected = torch.tensor([[0.4, 0.6, -0.4, -0.6, 0.4, 0.4, -0.6, -0.4]], dtype=torch.float64)
    torch.testing.assert_close(out.log_ratio, expected)
    assert out.token_bounded.tolist() == [[True, False, True, False, False, True, False, False]]
    kw = dict(ratio_level="token", bound_direction=direction)
    with pytest.raises(ValueError, match=r"^token_log_ratio_bound must be > 0 \(nats\), got 0.0$"):
        losses.importance_log_ratios(logr, logr, mask, turn_ids, token_log_ratio_bound=0.0, **kw)
    with pytest.raises(ValueError, match=r"^token_log_ratio_bound needs bound_direction"):
        losses.importance_log_ratios(
            logr, logr, mask, turn_ids, ratio_level="token", token_log_ratio_bound=0.4
        )


def test_sequence_mean_counts_only_sequences_with_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    w = losses.aggregation_weights(mask, loss_agg_mode="seq-mean-token-mean")
    # S = 2 sequences with tokens: row 0 tokens 1/(2*2), row 2 token 1/(1*2)
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.25, 0.0], [0.0] * 3, [0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"^loss_agg_mode must be one of"):
        losses.aggregation_weights(mask, loss_agg_mode="sum")  # type: ignore[arg-type]


def test_dual_clip_and_behaviour_weight_inputs_are_checked_exactly():
    logp = torch.zeros(1, 3)
    mask, turn_ids, adv = torch.ones(1, 3), torch.tensor([[0, 0, 1]]), torch.ones(1, 3)
    kw = dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2)
    with pytest.raises(
        ValueError, match=r"^clip_ratio_c must be > 1 \+ clip_eps_high = 1.2, got 1.2$"
    ):
        losses.compute_policy_loss(logp, logp, adv, mask, turn_ids, **kw, clip_ratio_c=1.2)
    losses.compute_policy_loss(logp, logp, adv, mask, turn_ids, **kw, clip_ratio_c=1.21)
    with pytest.raises(
        ValueError, match=r"^behavior_weights shape \(1, 2\) != logprobs shape \(1, 3\)$"
    ):
        losses.compute_policy_loss(
            logp, logp, adv, mask, turn_ids, **kw, behavior_weights=torch.ones(1, 2)
        )
