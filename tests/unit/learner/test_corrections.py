"""The off-policy corrections (learner.corrections, the cispo and gspo objectives of
learner.losses) against their published formulas, computed by hand in the comments.

Where a peer's implementation is public, one case is checked against the number it computes
(read at the pinned commit named in the test; the arithmetic is redone here, nothing is
imported from it). Conventions that differ are named where they change a number: verl's
rejection sampling removes masked tokens from the token-mean denominator and AReaL's M2PO
counts only the kept ones; here (as AReaL's rejection sampling and OpenRLHF's IcePop do) a
masked token keeps its place in the denominator with weight 0, which is also the M2PO
paper's ``1 / sum |o_i|``.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner import corrections, losses

VERL = "volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7"
OPENRLHF = "OpenRLHF/OpenRLHF@3c3be6234e0cb353e76bb8019947db9dfe99fca7"
AREAL = "inclusionAI/AReaL@4aef98d8d818af55b43621aaadba047ae10f4e77"


def row(values, dtype=torch.float64):
    return torch.tensor([values], dtype=dtype)


def correction(log_w, turn_ids=None, **options):
    """rollout_correction of one row whose log weights log(pi_prox / pi_b) are ``log_w``."""
    log_w = row(log_w)
    mask = torch.ones_like(log_w)
    turn_ids = torch.zeros_like(log_w, dtype=torch.long) if turn_ids is None else turn_ids
    return corrections.rollout_correction(log_w, torch.zeros_like(log_w), mask, turn_ids, **options)


def ppo_loss_with_weights(weights: torch.Tensor) -> float:
    """Token-mean PPO loss at ratio 1 and A = +1: -sum(w) / N."""
    logp = torch.zeros_like(weights, requires_grad=True)
    adv, mask = torch.ones_like(weights), torch.ones_like(weights)
    out = losses.compute_policy_loss(
        logp, logp.detach(), adv, mask, torch.zeros_like(weights, dtype=torch.long),
        ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2, behavior_weights=weights,
    )  # fmt: skip
    return float(out.loss.detach())


# --------------------------------------------------------------------------- TIS / MIS


def test_tis_token_and_sequence_and_masks_match_verl_rollout_corr():
    """verl ``verl/trainer/ppo/rollout_corr_helper.py`` (``VERL``): delta = log w =
    [0, 0.2, -0.1, 1.0], so w = [1, 1.2214, 0.9048, 2.7183]."""
    log_w = [0.0, 0.2, -0.1, 1.0]
    # token IS, cap 2 (verl rollout_is = token, threshold 2): min(w, 2)
    token = correction(log_w, is_level="token", is_cap=2.0)
    expected = row([1.0, math.exp(0.2), math.exp(-0.1), 2.0])
    torch.testing.assert_close(token.weights, expected, rtol=1e-12, atol=0)
    assert float(token.metrics["behavior_weight_capped"]) == 0.25  # one token of four
    # sequence IS: exp(0 + 0.2 - 0.1 + 1.0) = e^1.1 = 3.0042 -> 2 on every token
    seq = correction(log_w, is_level="sequence", is_cap=2.0)
    torch.testing.assert_close(seq.weights, row([2.0] * 4), rtol=0, atol=0)
    assert float(seq.metrics["behavior_weight_mean"]) == pytest.approx(math.exp(1.1))
    # token mask [0.5, 2] (verl token_k1 "0.5_2.0"; verl bounds -log w by [log L, log U],
    # which for symmetric bounds is the same window): w = e^1 > 2 dropped
    masked = correction(log_w, is_level="token", is_cap=2.0, mask_level="token",
                        mask_low=0.5, mask_high=2.0)  # fmt: skip
    torch.testing.assert_close(masked.weights, expected * row([1, 1, 1, 0]), rtol=1e-12, atol=0)
    assert float(masked.metrics["behavior_masked"]) == 0.25
    # the loss at ratio 1, A = +1: -(1 + 1.2214 + 0.9048 + 0) / 4 = -0.78157 (verl divides by
    # the 3 kept tokens: -1.04208)
    assert ppo_loss_with_weights(masked.weights) == pytest.approx(-3.12624 / 4, abs=1e-5)
    # Geo-RS (verl seq_mean_k1 "0.999_1.001"): the geometric mean e^(1.1 / 4) = e^0.275
    # leaves [0.999, 1.001]: the whole sequence is dropped
    geo = correction(log_w, is_level="none", mask_level="sequence",
                     mask_statistic="geometric_mean", mask_low=0.999, mask_high=1.001)  # fmt: skip
    torch.testing.assert_close(geo.weights, row([0.0] * 4), rtol=0, atol=0)
    # ... and kept by bounds around it: with is_level none every kept weight is 1
    wide = correction(log_w, is_level="none", mask_level="sequence", mask_low=1.3, mask_high=1.33)
    torch.testing.assert_close(wide.weights, row([1.0] * 4), rtol=0, atol=0)


def test_turn_level_weights_use_each_turns_own_tokens():
    # turns [0, 0 | 1, 1 | 2]: log w = [0.1, 0.3 | -0.4, 0.2 | 2.0]
    log_w = [0.1, 0.3, -0.4, 0.2, 2.0]
    turns = torch.tensor([[0, 0, 1, 1, 2]])
    # product per turn: e^0.4, e^-0.2, e^2 -> truncated at 3: [e^.4, e^.4, e^-.2, e^-.2, 3]
    prod = correction(log_w, turns, is_level="turn", is_cap=3.0)
    e = math.exp
    torch.testing.assert_close(
        prod.weights, row([e(0.4), e(0.4), e(-0.2), e(-0.2), 3.0]), rtol=1e-12, atol=0
    )
    # geometric mean per turn: e^0.2, e^-0.1, e^2 -> min(7.39, 3) = 3 on turn 2
    geo = correction(log_w, turns, is_level="turn", is_statistic="geometric_mean", is_cap=3.0)
    torch.testing.assert_close(
        geo.weights, row([e(0.2), e(0.2), e(-0.1), e(-0.1), 3.0]), rtol=1e-12, atol=0
    )
    # mask the turns whose geometric mean leaves [0.85, 1.5]: turn 2 (e^2) goes, turn 1
    # (e^-0.1 = 0.905) stays
    mask = correction(log_w, turns, is_level="none", mask_level="turn", mask_low=0.85,
                      mask_high=1.5)  # fmt: skip
    torch.testing.assert_close(mask.weights, row([1, 1, 1, 1, 0]).double(), rtol=0, atol=0)


def test_icepop_matches_openrlhf_and_areal():
    """IcePop: OpenRLHF ``openrlhf/models/loss.py`` (``OPENRLHF``, is_correction_type =
    icepop, threshold [0.5, 5]) and AReaL's token rejection with metric ratio (``AREAL``,
    ``areal/utils/functional/functional.py``) weight a kept token by k and drop the rest,
    counting them in the denominator. k = [1.0, 0.4, 1.5, 6.0], ratio 1, A = +1:
    coefficients [1, 0, 1.5, 0], loss -2.5 / 4 = -0.625 in both (SkyRL's mask-only form
    would give -2 / 4 = -0.5)."""
    log_k = [math.log(v) for v in (1.0, 0.4, 1.5, 6.0)]
    ice = correction(log_k, is_level="token", is_cap=5.0, mask_level="token",
                     mask_low=0.5, mask_high=5.0)  # fmt: skip
    torch.testing.assert_close(ice.weights, row([1.0, 0.0, 1.5, 0.0]), rtol=1e-12, atol=1e-15)
    assert ppo_loss_with_weights(ice.weights) == pytest.approx(-0.625, abs=1e-12)
    assert float(ice.metrics["behavior_masked"]) == 0.5
    assert float(ice.metrics["behavior_weight_capped"]) == 0.25  # 6 > 5 (and masked)


def test_off_the_mask_and_at_the_bounds_and_bad_inputs():
    """Environment tokens get weight 0 whatever their log-probs; a weight exactly at a
    bound is kept; a weight exactly at the cap is not counted as truncated."""
    prox = row([math.log(2.0), 0.0, 7.0, 0.0])
    behavior = row([0.0, 0.0, -3.0, 0.0])
    mask = torch.tensor([[1, 1, 0, 1]])
    turn_ids = torch.tensor([[0, 0, -1, 1]])
    out = corrections.rollout_correction(
        prox, behavior, mask, turn_ids, is_cap=2.0, mask_level="token", mask_high=2.0
    )
    torch.testing.assert_close(out.weights, row([2.0, 1.0, 0.0, 1.0]), rtol=0, atol=0)
    assert float(out.metrics["behavior_weight_capped"]) == 0.0
    assert float(out.metrics["behavior_masked"]) == 0.0
    assert float(out.metrics["behavior_weight_max"]) == 2.0
    assert float(out.metrics["behavior_log_ratio_abs_mean"]) == pytest.approx(math.log(2) / 3)
    with pytest.raises(ValueError, match=r"^behavior_logprobs shape \(1, 3\) != proximal"):
        corrections.rollout_correction(prox, behavior[:, :3], mask, turn_ids)
    with pytest.raises(ValueError, match="is_cap must be > 1"):
        corrections.rollout_correction(prox, behavior, mask, turn_ids, is_cap=1.0)
    with pytest.raises(ValueError, match=r"mask bounds must satisfy 0 <= low < high"):
        corrections.rollout_correction(prox, behavior, mask, turn_ids, mask_low=2.0, mask_high=1.0)
    with pytest.raises(ValueError, match="is_level must be one of"):
        corrections.rollout_correction(prox, behavior, mask, turn_ids, is_level="row")
    bf16 = corrections.rollout_correction(prox.bfloat16(), behavior.bfloat16(), mask, turn_ids)
    assert bf16.weights.dtype == torch.float32  # the arithmetic runs in float32


def test_no_correction_is_weight_one_and_decoupled_at_staleness_zero_is_ppo():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    old = logp.detach() - 0.1
    adv = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    mask, turn_ids = torch.ones(2, 6), torch.zeros(2, 6, dtype=torch.long)
    ones = corrections.rollout_correction(old, old, mask, turn_ids)  # pi_prox == pi_b: w = 1
    off = corrections.rollout_correction(old, old - 5.0, mask, turn_ids, is_level="none")
    torch.testing.assert_close(off.weights, torch.ones_like(old), rtol=0, atol=0)
    kw = dict(ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2)
    plain = losses.compute_policy_loss(logp, old, adv, mask, turn_ids, **kw)
    decoupled = losses.compute_policy_loss(
        logp, old, adv, mask, turn_ids, behavior_weights=ones.weights, **kw
    )
    torch.testing.assert_close(decoupled.loss, plain.loss, rtol=0, atol=0)


# --------------------------------------------------------------------------- M2PO


def test_m2po_mask_matches_areal_and_the_paper():
    """AReaL ``areal/trainer/ppo/actor.py::_get_m2po_loss_mask`` (``AREAL``) and the paper's
    Algorithm 1: log w = -delta with delta = [0.05, -0.1, 0.3 | 0.02, -0.5, 0.35], M2 =
    [.0025, .01, .09 | .0004, .25, .1225], mean .07923 >= .04 -> drop .25 (mean .04508) ->
    drop .1225 (mean .025725 < .04): tokens (1, 1) and (1, 2) masked."""
    delta = torch.tensor([[0.05, -0.1, 0.3], [0.02, -0.5, 0.35]], dtype=torch.float64)
    behavior = torch.zeros_like(delta)
    mask = torch.ones_like(delta)
    keep = corrections.m2po_keep_mask(-delta, behavior, mask, threshold=0.04)
    assert keep.tolist() == [[True, True, True], [True, False, False]]
    # the loss at ratio 1, A = +1 with the untruncated weights e^-delta of the kept tokens:
    # -(0.9512 + 1.1052 + 0.7408 + 0.9802) / 6 = -0.62957 (AReaL divides by the 4 kept:
    # -0.94435; the paper's objective divides by every token, 6)
    weights = torch.exp(-delta) * keep
    assert ppo_loss_with_weights(weights) == pytest.approx(-3.77742 / 6, abs=1e-5)
    # a threshold above the mean keeps everything; one below every suffix keeps one token
    assert bool(corrections.m2po_keep_mask(-delta, behavior, mask, threshold=0.08).all())
    tiny = corrections.m2po_keep_mask(-delta, behavior, mask, threshold=1e-5)
    assert tiny.tolist() == [[False, False, False], [True, False, False]]  # the smallest M2
    # a mean exactly at the threshold is not below it (AReaL's strict <; the paper's loop
    # "while M2 > tau" would stop there): M2 = [.25, .0625, .0625], tau = .0625, exact in
    # binary: suffix means .125, .0625, .0625, none below -> all but one token masked
    tie = corrections.m2po_keep_mask(
        row([0.5, 0.25, 0.25]), torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, 3),
        threshold=0.0625,
    )  # fmt: skip
    assert tie.tolist() == [[False, False, True]]


def test_m2po_ignores_environment_tokens_and_checks_inputs():
    prox = torch.tensor([[0.0, 9.0, 0.3, 0.0]])  # token 1: environment, garbage
    mask = torch.tensor([[1, 0, 1, 1]])
    # policy M2 = [0, .09, 0]: mean .03 < .04, nothing masked
    keep = corrections.m2po_keep_mask(prox, torch.zeros_like(prox), mask, threshold=0.04)
    assert keep.tolist() == [[True, False, True, True]]
    with pytest.raises(ValueError, match="threshold must be > 0"):
        corrections.m2po_keep_mask(prox, prox, mask, threshold=0.0)
    with pytest.raises(ValueError, match="selects no token"):
        corrections.m2po_keep_mask(prox, prox, torch.zeros_like(mask), threshold=0.1)


# --------------------------------------------------------------------------- proximal


def test_loglinear_proximal_matches_areal_and_is_exact_at_the_ends():
    """AReaL ``areal/trainer/ppo/actor.py::compute_prox_logp_approximations`` (``AREAL``):
    log pi_b = -1, log pi_theta = -2, v_b = 3, v_prox = 4, v_theta = 5: alpha = 0.5, -1.5.
    Here time counts optimizer updates: proximal version P = 4 with K = 1 update per version,
    the current policy j = 1 update past it: alpha = (4 - 3) / ((4 - 3) + 1) = 0.5."""
    versions = torch.tensor([[3, 4, 0, -1]])
    alpha = corrections.loglinear_proximal_alpha(versions, 4, updates_done=1, updates_per_version=1)
    # v_b = 4 = P: the behaviour policy is the proximal one (0); v_b = 0: 4 / 5; off policy 0
    torch.testing.assert_close(alpha, torch.tensor([[0.5, 0.0, 0.8, 0.0]]))
    approx = corrections.loglinear_proximal_logprobs(
        torch.full((1, 4), -1.0), torch.full((1, 4), -2.0), alpha
    )
    assert float(approx[0, 0]) == -1.5 and float(approx[0, 1]) == -1.0
    # at the step's first update the current policy is the proximal one: alpha = 1
    first = corrections.loglinear_proximal_alpha(versions, 4, updates_done=0, updates_per_version=4)
    torch.testing.assert_close(first, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    # K = 4 updates per version, 2 done, one version stale: 4 / (4 + 2)
    later = corrections.loglinear_proximal_alpha(versions, 4, updates_done=2, updates_per_version=4)
    assert float(later[0, 0]) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="updates_per_version >= 1"):
        corrections.loglinear_proximal_alpha(versions, 4, updates_done=0, updates_per_version=0)


# --------------------------------------------------------------------------- CISPO


def test_cispo_matches_verl():
    """verl ``verl/trainer/ppo/core_algos.py::compute_policy_loss_cispo`` (``VERL``, its
    example's clip_ratio_low = 10: no floor; high 0.2): r = [1.0, 1.5, 0.5, 3.0], A = +1,
    log pi = [-1.0, -0.5, -2.0, -0.2]; c = sg(clip(r, 0, 1.2)) = [1.0, 1.2, 0.5, 1.2];
    L = mean(-c A log pi) = (1.0 + 0.6 + 1.0 + 0.24) / 4 = 0.71; dL/dlog pi = -c A / 4."""
    logp = row([-1.0, -0.5, -2.0, -0.2]).requires_grad_(True)
    old = logp.detach() - torch.log(row([1.0, 1.5, 0.5, 3.0]))
    adv, mask = torch.ones_like(old), torch.ones_like(old)
    out = losses.compute_policy_loss(
        logp, old, adv, mask, torch.zeros_like(old, dtype=torch.long), ratio_level="token",
        clip_eps_low=1.0, clip_eps_high=0.2, objective="cispo",
    )  # fmt: skip
    assert float(out.loss.detach()) == pytest.approx(0.71, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, row([-0.25, -0.30, -0.125, -0.30]), rtol=1e-12, atol=0)
    # every token keeps its gradient; two weights were truncated, none removed (C = 0)
    assert float(out.metrics["clip_ratio"]) == 0.5 and float(out.metrics["clip_bias_norm"]) == 0
    # with a floor at 1 - 0.2 = 0.8 the third weight is 0.8: dL/dlog pi_3 = -0.8 / 4
    floored = losses.compute_policy_loss(
        logp, old, adv, mask, torch.zeros_like(old, dtype=torch.long), ratio_level="token",
        clip_eps_low=0.2, clip_eps_high=0.2, objective="cispo",
    )  # fmt: skip
    (grad,) = torch.autograd.grad(floored.loss, logp)
    assert float(grad[0, 2]) == pytest.approx(-0.2)


# --------------------------------------------------------------------------- GSPO


def gspo(logp, old, adv, **kw):
    mask = torch.ones_like(old)
    return losses.compute_policy_loss(
        logp, old, adv, mask, torch.zeros_like(old, dtype=torch.long), ratio_level="sequence",
        segment_gradient="token", loss_agg_mode="seq-mean-token-mean", **kw,
    )  # fmt: skip


def test_gspo_matches_verl():
    """verl ``verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo`` (``VERL``):
    log-ratios [0.003, 0, 0.0006]: s = e^0.0012 = 1.0012007, clip [0.9997, 1.0004].
    A = +1: every token at the clipped -1.0004, no gradient. A = -1: +1.0012 unclipped,
    dL/dlog pi_t = s / 3 per token."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = row([0.003, 0.0, 0.0006]).requires_grad_(True)
    kw = dict(clip_eps_low=3e-4, clip_eps_high=4e-4)
    up = gspo(logp, old, torch.ones_like(old), **kw)
    assert float(up.loss) == pytest.approx(-1.0004, abs=1e-12)
    (grad,) = torch.autograd.grad(up.loss, logp)
    assert float(grad.abs().max()) == 0.0
    down = gspo(logp, old, -torch.ones_like(old), **kw)
    s = math.exp(0.0012)
    assert float(down.loss) == pytest.approx(s, abs=1e-12)
    (grad,) = torch.autograd.grad(down.loss, logp)
    torch.testing.assert_close(grad, row([s / 3] * 3), rtol=1e-12, atol=0)


def test_gspo_is_turn_ppo_with_one_turn_per_sequence_and_differs_with_token_advantages():
    """Spec section 2: GSPO = Turn-PPO with one turn per sequence. With one advantage per
    sequence, value and gradient agree; with per-token advantages the values agree and the
    gradients differ (GSPO-token weighs each token by its own A, Turn-PPO by the turn's
    mean A)."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    mask, one_turn = torch.ones_like(old), torch.zeros(3, 5, dtype=torch.long)
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.2, loss_agg_mode="seq-mean-token-mean")
    for adv, same_grad in ((torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 5), True),
                           (torch.randn(3, 5, generator=gen, dtype=torch.float64), False)):  # fmt: skip
        adv = adv.to(torch.float64)
        g = gspo(logp, old, adv, clip_eps_low=0.2, clip_eps_high=0.2)
        t = losses.compute_policy_loss(logp, old, adv, mask, one_turn, ratio_level="turn", **kw)
        torch.testing.assert_close(g.loss, t.loss, rtol=1e-12, atol=0)
        (gg,) = torch.autograd.grad(g.loss, logp)
        (tg,) = torch.autograd.grad(t.loss, logp)
        assert torch.allclose(gg, tg, rtol=1e-10, atol=1e-14) is same_grad


def test_gspo_clip_bias_closed_form_matches_autograd():
    """||C|| of the GSPO-token form: the gradient of the clipped-token surrogate reaches each
    token through its own log-prob (closed form == autograd)."""
    gen = torch.Generator().manual_seed(4)
    old = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    logp = old + 0.05 * torch.randn(3, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones_like(old)
    kw = dict(ratio_level="sequence", segment_gradient="token", clip_eps_low=1e-3,
              clip_eps_high=1e-3)  # fmt: skip
    turns = torch.zeros_like(old, dtype=torch.long)
    leaf = logp.clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(
        losses.clip_bias_surrogate(leaf, old, adv, mask, turns, **kw), leaf
    )
    closed = losses.clip_bias_logprob_grad(logp, old, adv, mask, turns, **kw)
    torch.testing.assert_close(closed, auto, rtol=1e-12, atol=1e-15)
    assert closed.abs().sum() > 0
