"""Hand-computed values of the ST-PPO losses (learner/losses.py) on a 2-trajectory,
3-turns-each example, plus value loss, KL, entropy, masked mean and input errors.

The example (B = 2, T = 8; E = environment token, P = padding; log-ratios logr = logp -
logp_old; env/padding entries hold garbage, 5.0 and 9.0, that must not leak in):

    seq 0  mask  1    1    0    1    1    0    1    0       turns {0,1} {3,4} {6}
           logr  0.1  0.3  E    -0.1 -0.1 E    0.5  P
           A     1    2    E    -1   -1   E    -0.5 P
    seq 1  mask  1    0    1    1    1    0    1    1       turns {0} {2,3,4} {6,7}
           logr  -0.4 E    0.0  0.3  -0.3 E    0.2  0.0
           A     -2   E    0.5  0.5  0.5  E    1    -1

N = 5 + 6 = 11 masked tokens, 6 turns. Turn log-ratios (means): seq 0: 0.2, -0.1, 0.5;
seq 1: -0.4, 0.0, 0.1. eps_low = eps_high = 0.2.
"""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import (
    clip_bias_scale,
    clip_bias_surrogate,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
)

E = 5.0  # garbage log-ratio on environment/padding tokens
G = 9.0  # garbage advantage on environment/padding tokens
e = math.exp


def _example(requires_grad: bool = True):
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 0], [1, 0, 1, 1, 1, 0, 1, 1]])
    turn_ids = torch.tensor([[0, 0, -1, 1, 1, -1, 2, -1], [0, -1, 1, 1, 1, -1, 2, 2]])
    logr = torch.tensor(
        [[0.1, 0.3, E, -0.1, -0.1, E, 0.5, E], [-0.4, E, 0.0, 0.3, -0.3, E, 0.2, 0.0]],
        dtype=torch.float64,
    )
    old = torch.full_like(logr, -1.5)
    logprobs = (old + logr).detach().requires_grad_(requires_grad)
    adv = torch.tensor(
        [[1.0, 2.0, G, -1.0, -1.0, G, -0.5, G], [-2.0, G, 0.5, 0.5, 0.5, G, 1.0, -1.0]],
        dtype=torch.float64,
    )
    return logprobs, old, adv, mask, turn_ids


def _loss(ratio_level="turn", **kw):
    logprobs, old, adv, mask, turn_ids = _example()
    out = compute_policy_loss(
        logprobs, old, adv, mask, turn_ids,
        ratio_level=ratio_level, clip_eps_low=0.2, clip_eps_high=0.2, **kw,
    )  # fmt: skip
    return out, logprobs


# Turn level, per-token losses max(-A rho, -A clip(rho)):
#   seq 0 turn 0: rho = e^0.2 = 1.2214 > 1.2, A > 0 -> clipped: -1*1.2, -2*1.2
#   seq 0 turn 1: rho = e^-0.1 = 0.9048 inside:      +e^-0.1, +e^-0.1
#   seq 0 turn 2: rho = e^0.5 = 1.6487, A < 0: max(0.5*1.6487, 0.5*1.2) -> 0.5 e^0.5 (unclipped)
#   seq 1 turn 0: rho = e^-0.4 = 0.6703 < 0.8, A < 0 -> clipped: 2 * 0.8 = 1.6
#   seq 1 turn 1: rho = 1: -0.5 * 3
#   seq 1 turn 2: rho = e^0.1 inside: -e^0.1 + e^0.1 = 0
TURN_SUM = -1.2 - 2.4 + 2 * e(-0.1) + 0.5 * e(0.5) + 1.6 - 1.5 + 0.0
TURN_PG_LOSS = TURN_SUM / 11  # = -0.0787240
# Clipping bias, logprob norm: d/dlogp_s of (1/N) sum_{Clip} rho_k A_t = rho_k (sum of clipped A
# in the turn) / (N |T_k|) on each token of the turn:
#   seq 0 turn 0: e^0.2 * (1 + 2) / (11 * 2) on 2 tokens; seq 1 turn 0: e^-0.4 * (-2) / 11.
TURN_BIAS_NORM = math.sqrt(2 * (e(0.2) * 3 / 22) ** 2 + (e(-0.4) * 2 / 11) ** 2)  # = 0.265207


def test_turn_level_hand_computed_loss_and_metrics():
    out, _ = _loss("turn")
    assert out.loss.item() == pytest.approx(TURN_PG_LOSS, abs=1e-12)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["pg_loss"] == pytest.approx(TURN_PG_LOSS, abs=1e-12)
    assert m["clip_ratio"] == pytest.approx(3 / 11, abs=1e-12)  # seq0 t0,t1 (high), seq1 t0 (low)
    assert m["clip_ratio_high"] == pytest.approx(2 / 11, abs=1e-12)
    assert m["clip_ratio_low"] == pytest.approx(1 / 11, abs=1e-12)
    assert m["clip_ratio_turn"] == pytest.approx(2 / 6, abs=1e-12)  # seq0 turn0, seq1 turn0
    # approx_kl = mean(old - new) = -(0.1+0.3-0.1-0.1+0.5 - 0.4+0+0.3-0.3+0.2+0) / 11 = -0.5/11
    assert m["approx_kl"] == pytest.approx(-0.5 / 11, abs=1e-12)
    assert m["clip_bias_norm"] == pytest.approx(TURN_BIAS_NORM, abs=1e-12)
    assert m["clip_bias_norm_sq"] == pytest.approx(TURN_BIAS_NORM**2, abs=1e-12)
    assert m["clip_bias_scale"] == 1.0  # no bias correction requested
    # ratio_mean over tokens: (2 e^.2 + 2 e^-.1 + e^.5 + e^-.4 + 3*1 + 2 e^.1) / 11
    ratio_mean = (2 * e(0.2) + 2 * e(-0.1) + e(0.5) + e(-0.4) + 3 + 2 * e(0.1)) / 11
    assert m["ratio_mean"] == pytest.approx(ratio_mean, abs=1e-12)
    assert m["ratio_max"] == pytest.approx(e(0.5), abs=1e-12)
    assert m["ratio_min"] == pytest.approx(e(-0.4), abs=1e-12)
    assert m["num_tokens"] == 11.0
    assert m["num_turns"] == 6.0
    assert all(not v.requires_grad and v.dim() == 0 for v in out.metrics.values())


def test_turn_level_hand_computed_gradient():
    out, logprobs = _loss("turn")
    out.loss.backward()
    # Unclipped turn k: d/dlogp_s [-(1/N) sum_t A_t rho_k] = -rho_k (sum_t A_t) / (N |T_k|).
    # Clipped turns (seq0 turn0, seq1 turn0) get 0; env tokens 0.
    g1 = -e(-0.1) * (-2.0) / (11 * 2)  # seq 0 turn 1
    g2 = -e(0.5) * (-0.5) / 11  # seq 0 turn 2
    g4 = -1.0 * 1.5 / (11 * 3)  # seq 1 turn 1
    g5 = -e(0.1) * (1.0 - 1.0) / (11 * 2)  # seq 1 turn 2: advantages cancel
    expected = torch.tensor(
        [[0, 0, 0, g1, g1, 0, g2, 0], [0, 0, g4, g4, g4, 0, g5, g5]], dtype=torch.float64
    )
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-14)


def test_turn_level_bias_correction_triggered_and_divide():
    out, logprobs = _loss("turn", bias_correction=True, normalize_mode="triggered", tau=0.1)
    # s = 1 / max(1, 0.265207 / 0.1) = 0.1 / 0.265207 = 0.377063
    s = 0.1 / TURN_BIAS_NORM
    assert out.metrics["clip_bias_scale"].item() == pytest.approx(s, abs=1e-12)
    assert out.loss.item() == pytest.approx(s * TURN_PG_LOSS, abs=1e-12)
    assert out.metrics["pg_loss"].item() == pytest.approx(TURN_PG_LOSS, abs=1e-12)
    out.loss.backward()
    # The scale is a stop-gradient constant: gradient of seq 1 turn 1 is s * (-1.5/33).
    assert logprobs.grad[1, 2].item() == pytest.approx(s * -1.5 / 33, abs=1e-14)

    out, _ = _loss("turn", bias_correction=True, normalize_mode="divide", delta=1e-8)
    assert out.metrics["clip_bias_scale"].item() == pytest.approx(
        1 / (TURN_BIAS_NORM + 1e-8), rel=1e-12
    )
    assert out.loss.item() == pytest.approx(TURN_PG_LOSS / (TURN_BIAS_NORM + 1e-8), rel=1e-12)


def test_turn_level_seq_mean_token_mean():
    out, _ = _loss("turn", loss_agg_mode="seq-mean-token-mean")
    # seq 0: (-1.2 - 2.4 + 2 e^-.1 + .5 e^.5) / 5 ; seq 1: (1.6 - 1.5 + 0) / 6 ; mean of the two
    seq0 = (-1.2 - 2.4 + 2 * e(-0.1) + 0.5 * e(0.5)) / 5
    seq1 = (1.6 - 1.5) / 6
    assert out.loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-12)
    # Bias weights are m_t / (n_i S): seq 0 turn 0 tokens get e^.2 * 3 / (5*2*2), seq 1 turn 0
    # gets e^-.4 * (-2) / (6*2).
    norm = math.sqrt(2 * (e(0.2) * 3 / 20) ** 2 + (e(-0.4) * 2 / 12) ** 2)
    assert out.metrics["clip_bias_norm"].item() == pytest.approx(norm, abs=1e-12)


def test_turn_mean_advantage():
    out, _ = _loss("turn", turn_advantage="turn_mean")
    # Turn-mean advantages: seq0 1.5, -1, -0.5; seq1 -2, 0.5, 0.
    #   seq 0 turn 0: rho 1.2214 > 1.2, A = 1.5 -> clipped: -1.5 * 1.2 * 2 tokens = -3.6
    #   seq 0 turn 1: +2 e^-.1; turn 2: +0.5 e^.5; seq 1 turn 0: +1.6; turn 1: -1.5; turn 2: 0
    assert out.loss.item() == pytest.approx(TURN_SUM / 11, abs=1e-12)
    # Bias: seq 0 turn 0: e^.2 * (1.5+1.5)/(11*2) per token -- the same as with token A.
    assert out.metrics["clip_bias_norm"].item() == pytest.approx(TURN_BIAS_NORM, abs=1e-12)


def test_turn_mean_advantage_differs_when_clipping_splits_a_turn():
    # Outside the clip region a turn contributes rho * sum_t A_t either way (Lemma 4.1), so
    # the options differ only when clipping splits a turn. One turn, logr = [.3, .3], rho = e^.3
    # = 1.3499 > 1.2, A = [1, -1]:
    #   token A:     t0 clipped: -1 * 1.2 ; t1: max(e^.3, 1.2) = e^.3  -> (e^.3 - 1.2) / 2
    #   turn_mean A: A = [0, 0]                                        -> 0
    logprobs = torch.tensor([[0.3, 0.3]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    args = (logprobs, old, adv, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long))
    kw = dict(ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2)
    out = compute_policy_loss(*args, **kw, turn_advantage="token")
    assert out.loss.item() == pytest.approx((e(0.3) - 1.2) / 2, abs=1e-12)
    assert out.metrics["clip_ratio"].item() == 0.5
    out = compute_policy_loss(*args, **kw, turn_advantage="turn_mean")
    assert out.loss.item() == 0.0
    assert out.metrics["clip_ratio"].item() == 0.0


# Token level, per-token losses max(-A r, -A clip(r)):
#   seq 0: t0 r=e^.1 in range: -e^.1 ; t1 r=e^.3 > 1.2, A=2: -2.4 ; t3,t4: +e^-.1 each ;
#          t6 r=e^.5, A=-.5: +.5 e^.5 (unclipped side)
#   seq 1: t0 r=e^-.4 < .8, A=-2: +1.6 ; t2 r=1: -.5 ; t3 r=e^.3 > 1.2, A=.5: -.6 ;
#          t4 r=e^-.3 (A > 0, low side not clipped): -.5 e^-.3 ; t6 r=e^.2 > 1.2, A=1: -1.2 ;
#          t7 r=1, A=-1: +1
TOKEN_SUM = -e(0.1) - 2.4 + 2 * e(-0.1) + 0.5 * e(0.5) + 1.6 - 0.5 - 0.6 - 0.5 * e(-0.3) - 1.2 + 1.0
# Clip = {seq0 t1, seq1 t0, t3, t6}; bias gradient w_t r_t A_t = r_t A_t / 11 on those tokens.
TOKEN_BIAS_NORM = (
    math.sqrt((2 * e(0.3)) ** 2 + (2 * e(-0.4)) ** 2 + (0.5 * e(0.3)) ** 2 + e(0.2) ** 2) / 11
)


def test_token_level_hand_computed():
    out, logprobs = _loss("token")
    assert out.loss.item() == pytest.approx(TOKEN_SUM / 11, abs=1e-12)
    m = {k: v.item() for k, v in out.metrics.items()}
    assert m["clip_ratio"] == pytest.approx(4 / 11, abs=1e-12)
    assert m["clip_ratio_high"] == pytest.approx(3 / 11, abs=1e-12)
    assert m["clip_ratio_low"] == pytest.approx(1 / 11, abs=1e-12)
    # turns with a clipped token: seq0 turn0 (t1), seq1 turn0, turn1 (t3), turn2 (t6) -> 4/6
    assert m["clip_ratio_turn"] == pytest.approx(4 / 6, abs=1e-12)
    assert m["clip_bias_norm"] == pytest.approx(TOKEN_BIAS_NORM, abs=1e-12)
    assert m["ratio_max"] == pytest.approx(e(0.5), abs=1e-12)
    out.loss.backward()
    # Unclipped tokens: d/dlogp_t (-A_t r_t / N) = -A_t r_t / N; clipped tokens: 0.
    expected = (
        torch.tensor(
            [
                [-e(0.1), 0, 0, e(-0.1), e(-0.1), 0, 0.5 * e(0.5), 0],
                [0, 0, -0.5, 0, -0.5 * e(-0.3), 0, 0, 1.0],
            ],
            dtype=torch.float64,
        )
        / 11
    )
    torch.testing.assert_close(logprobs.grad, expected, rtol=0, atol=1e-14)


def test_clip_bias_surrogate_value():
    logprobs, old, adv, mask, turn_ids = _example()
    # (1/N) sum_{Clip} rho A = (e^.2 * (1 + 2) + e^-.4 * (-2)) / 11
    s = clip_bias_surrogate(
        logprobs, old, adv, mask, turn_ids, ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2
    )
    assert s.item() == pytest.approx((3 * e(0.2) - 2 * e(-0.4)) / 11, abs=1e-12)
    s.backward()
    # Its gradient is the clipping bias C (logprob norm): seq 0 turn 0 tokens e^.2 * 3 / 22.
    assert logprobs.grad[0, 0].item() == pytest.approx(3 * e(0.2) / 22, abs=1e-14)
    assert logprobs.grad.norm().item() == pytest.approx(TURN_BIAS_NORM, abs=1e-12)


def test_precomputed_clip_bias_norm_is_used():
    out, _ = _loss(
        "turn", bias_correction=True, tau=0.1, clip_bias_norm=torch.tensor(0.4, dtype=torch.float64)
    )
    # s = 1 / max(1, 0.4 / 0.1) = 0.25
    assert out.metrics["clip_bias_scale"].item() == pytest.approx(0.25, abs=1e-15)
    assert out.metrics["clip_bias_norm"].item() == pytest.approx(0.4, abs=1e-15)
    assert out.loss.item() == pytest.approx(0.25 * TURN_PG_LOSS, abs=1e-12)


def test_agg_denominator_for_micro_batches():
    # Splitting the batch into its two sequences with the global N = 11 as denominator: the
    # two micro-batch losses add up to the full-batch loss, squared bias norms add up too.
    logprobs, old, adv, mask, turn_ids = _example()
    kw = dict(ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2, agg_denominator=11)
    parts = [
        compute_policy_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                            turn_ids[i : i + 1], **kw)
        for i in range(2)
    ]  # fmt: skip
    total = sum(p.loss for p in parts)
    assert total.item() == pytest.approx(TURN_PG_LOSS, abs=1e-12)
    norm_sq = sum(p.metrics["clip_bias_norm_sq"] for p in parts)
    assert norm_sq.item() == pytest.approx(TURN_BIAS_NORM**2, abs=1e-12)


def test_clip_bias_scale_modes():
    norm = torch.tensor(0.03)
    yes, no = torch.tensor(True), torch.tensor(False)
    # triggered: 1 / max(1, 0.03 / 0.01) = 1/3; below tau: 1
    assert clip_bias_scale(norm, yes, normalize_mode="triggered", tau=0.01).item() == pytest.approx(
        1 / 3
    )
    assert clip_bias_scale(norm, yes, normalize_mode="triggered", tau=0.05).item() == 1.0
    # divide: 1 / (0.03 + 0.01) = 25 when something is clipped, else 1
    assert clip_bias_scale(norm, yes, normalize_mode="divide", delta=0.01).item() == pytest.approx(
        25.0
    )
    assert clip_bias_scale(norm, no, normalize_mode="divide", delta=0.01).item() == 1.0
    with pytest.raises(ValueError, match="normalize_mode"):
        clip_bias_scale(norm, yes, normalize_mode="sqrt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tau"):
        clip_bias_scale(norm, yes, normalize_mode="triggered", tau=0.0)


def test_bf16_inputs_are_upcast():
    logprobs, old, adv, mask, turn_ids = _example(requires_grad=False)
    lp = logprobs.to(torch.bfloat16).requires_grad_()
    out = compute_policy_loss(
        lp, old.to(torch.bfloat16), adv, mask, turn_ids,
        ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2,
    )  # fmt: skip
    assert out.loss.dtype == torch.float32
    # bf16 rounding of -1.5 + logr moves log-ratios by up to ~4e-3
    assert out.loss.item() == pytest.approx(TURN_PG_LOSS, abs=2e-3)
    out.loss.backward()
    assert lp.grad.dtype == torch.bfloat16


def test_policy_loss_input_errors():
    logprobs, old, adv, mask, turn_ids = _example()
    kw = dict(ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2)
    with pytest.raises(ValueError, match="advantages shape"):
        compute_policy_loss(logprobs, old, adv[:, :4], mask, turn_ids, **kw)
    with pytest.raises(ValueError, match="no token"):
        compute_policy_loss(logprobs, old, adv, torch.zeros_like(mask), turn_ids, **kw)
    bad = turn_ids.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="turn_ids must be >= 0"):
        compute_policy_loss(logprobs, old, adv, mask, bad, **kw)
    with pytest.raises(ValueError, match="int64"):
        compute_policy_loss(logprobs, old, adv, mask, turn_ids.double(), **kw)
    with pytest.raises(ValueError, match="ratio_level"):
        compute_policy_loss(logprobs, old, adv, mask, turn_ids, **{**kw, "ratio_level": "seq"})
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_policy_loss(logprobs, old, adv, mask, turn_ids, **kw, loss_agg_mode="sum")
    with pytest.raises(ValueError, match="clip_eps_low"):
        compute_policy_loss(logprobs, old, adv, mask, turn_ids, **{**kw, "clip_eps_low": 1.0})


def test_unchecked_values_give_the_same_loss_and_keep_the_other_checks():
    """``check_values=False`` (the learner's rows are validated at collation) skips only
    the checks that read values: same loss and metrics, bad shapes and options still fail."""
    logprobs, old, adv, mask, turn_ids = _example()
    kw = dict(ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2)
    checked = compute_policy_loss(logprobs, old, adv, mask, turn_ids, **kw)
    unchecked = compute_policy_loss(logprobs, old, adv, mask, turn_ids, **kw, check_values=False)
    assert torch.equal(unchecked.loss, checked.loss)
    assert unchecked.metrics.keys() == checked.metrics.keys()
    for name, value in checked.metrics.items():
        assert torch.equal(unchecked.metrics[name], value), name
    bad = turn_ids.clone()
    bad[0, 0] = -1
    compute_policy_loss(logprobs, old, adv, mask, bad, **kw, check_values=False)  # not read
    with pytest.raises(ValueError, match="advantages shape"):
        compute_policy_loss(logprobs, old, adv[:, :4], mask, turn_ids, **kw, check_values=False)
    with pytest.raises(ValueError, match="clip_eps_low"):
        options = {**kw, "clip_eps_low": 1.0}
        compute_policy_loss(logprobs, old, adv, mask, turn_ids, **options, check_values=False)


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0, 7.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0, 0.5]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1]])
    out = compute_value_loss(values, old, returns, mask, value_clip=0.2)
    # t0: v=1, v_clip = .5 + clamp(.5) = .7; max((1-2)^2, (.7-2)^2) = max(1, 1.69) = 1.69
    # t1: v=2, v_clip = 2; (2-1)^2 = 1 both
    # t3: v=0, v_clip = .5 + clamp(-.5) = .3; max((0-1)^2, (.3-1)^2) = max(1, .49) = 1
    # loss = 0.5 * (1.69 + 1 + 1) / 3
    assert out.loss.item() == pytest.approx(0.5 * 3.69 / 3, abs=1e-12)
    assert out.metrics["value_clip_ratio"].item() == pytest.approx(1 / 3, abs=1e-12)
    assert out.metrics["value_mean"].item() == pytest.approx(1.0, abs=1e-12)  # (1+2+0)/3
    out.loss.backward()
    # t0: clipped branch active and v_clip is at its bound -> 0; t1: both branches tie at
    # v == v_old, both have gradient (v-R)/3 = 1/3; t3: unclipped branch (v-R)/3 = -1/3.
    expected = torch.tensor([[0.0, 1 / 3, 0.0, -1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(values.grad, expected, rtol=0, atol=1e-12)


def test_value_loss_aggregation_denominator_and_modes():
    """The micro-batch path passes the mini-batch's denominator; seq-mean-token-mean
    averages each sequence first (mutation testing found both unchecked)."""
    values = torch.tensor([[1.0, 2.0, 7.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[0.5, 2.0, 0.0, 0.5], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])
    row0, row1 = 0.5 * 3.69, 0.5 * 4.0  # summed per-token losses (row 1: (3 - 1)^2 = 4)
    token = compute_value_loss(values, old, returns, mask, value_clip=0.2)
    assert token.loss.item() == pytest.approx((row0 + row1) / 4, abs=1e-12)
    shared = compute_value_loss(values, old, returns, mask, value_clip=0.2, agg_denominator=10)
    assert shared.loss.item() == pytest.approx((row0 + row1) / 10, abs=1e-12)
    seq = compute_value_loss(
        values, old, returns, mask, value_clip=0.2, loss_agg_mode="seq-mean-token-mean"
    )
    assert seq.loss.item() == pytest.approx((row0 / 3 + row1 / 1) / 2, abs=1e-12)
    assert token.metrics["return_mean"].item() == pytest.approx((2 + 1 + 1 + 1) / 4)
    # the clip acts below too: v far under old, return under both -> the clipped branch
    low = compute_value_loss(
        torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1),
        value_clip=0.2,
    )  # fmt: skip
    assert low.loss.item() == pytest.approx(0.5 * (0.8 + 1.0) ** 2)  # v_clip = 1 - 0.2
    assert token.metrics["value_loss"].item() == token.loss.item()


@pytest.mark.parametrize("name", ["old_values", "returns", "loss_mask"])
def test_value_loss_names_the_input_of_the_wrong_shape(name):
    values = torch.zeros(1, 4)
    inputs = {"old_values": torch.zeros(1, 4), "returns": torch.zeros(1, 4),
              "loss_mask": torch.ones(1, 4)}  # fmt: skip
    inputs[name] = inputs[name][:, :3]
    with pytest.raises(ValueError, match=rf"^{name} shape \(1, 3\) != values shape \(1, 4\)"):
        compute_value_loss(values, **inputs, value_clip=0.2)
    with pytest.raises(ValueError, match=r"^value_clip must be > 0, got 0.0"):
        compute_value_loss(values, torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(1, 4),
                           value_clip=0.0)  # fmt: skip


def test_kl_clamps_the_log_ratio_on_both_sides_before_exp():
    """k3 at log-ratios of -30 and +30 uses +-LOG_RATIO_CLAMP (20), and low_var_kl then
    bounds it at 10 (k3 >= 0, so its lower bound of -10 can never act)."""
    logp = torch.tensor([[-30.0, -1.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.0, -30.0]], dtype=torch.float64)
    k3 = kl_penalty(logp, ref, "k3")
    expected = torch.tensor([[e(20.0) - 21.0, 0.0, e(-20.0) + 19.0]], dtype=torch.float64)
    torch.testing.assert_close(k3, expected, rtol=1e-12, atol=1e-9)
    low = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(low, torch.tensor([[10.0, 0.0, 10.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^ref_logprobs shape \(1, 2\) != logprobs shape"):
        kl_penalty(logp, ref[:, :2], "k1")


def test_kl_penalty_k1_k3():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -2.0, -0.3]])
    k1 = kl_penalty(logp, ref, "k1")
    torch.testing.assert_close(k1, torch.tensor([[0.5, 0.0, -0.2]]))
    k3 = kl_penalty(logp, ref, "k3")
    # k3 = e^(ref-logp) - (ref-logp) - 1: e^-.5 + .5 - 1 ; 0 ; e^.2 - .2 - 1
    expected = torch.tensor([[e(-0.5) - 0.5, 0.0, e(0.2) - 1.2]])
    torch.testing.assert_close(k3, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k2")  # type: ignore[arg-type]


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]]])
    ent = entropy_from_logits(logits)
    # uniform over 4: ln 4 ; probs (3/4, 1/4): -(.75 ln .75 + .25 ln .25)
    expected = torch.tensor([[math.log(4.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]])
    torch.testing.assert_close(ent, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        entropy_from_logits(logits[0])


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(7 / 3)  # (1+2+4)/3
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.0]))
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError, match="shape"):
        masked_mean(x, mask[:, :2])
