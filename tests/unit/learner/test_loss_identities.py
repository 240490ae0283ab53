"""Identities and gradient checks of the ST-PPO losses (learner/losses.py).

- Turn-PPO with one-token turns == token PPO (loss, gradients, metrics);
- Turn-PPO with one turn per sequence == GSPO's sequence-level geometric-mean ratio;
- triggered scale == 1 when nothing is clipped;
- vectorised == a Python-loop reference (per sequence, per turn, per token) on random inputs;
- closed-form clipping-bias gradient == autograd of the clipped-token surrogate;
- gradcheck in float64, and autograd vs central finite differences on a tiny linear policy,
  including the parameter-space bias norm (``bias_norm: param``) by the chain rule.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from learner.advantages import turn_ids_from_mask
from learner.losses import (
    clip_bias_logprob_grad,
    clip_bias_surrogate,
    compute_policy_loss,
)

EPS_LOW, EPS_HIGH = 0.2, 0.28  # asymmetric on purpose


def _random_batch(seed: int, batch: int = 4, seq_len: int = 14, log_ratio_std: float = 0.3):
    """Random multi-turn batch: runs of policy tokens separated by env tokens, a padded tail,
    garbage (inf / huge) values off the mask."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, seq_len, generator=gen) < 0.65).long()
    mask[0, :3] = 1  # at least one token
    mask[1, -3:] = 0  # padding tail
    old = -torch.rand(batch, seq_len, generator=gen, dtype=torch.float64) * 3 - 0.1
    logr = torch.randn(batch, seq_len, generator=gen, dtype=torch.float64) * log_ratio_std
    logprobs = torch.where(mask.bool(), old + logr, torch.full_like(old, -math.inf))
    adv = torch.randn(batch, seq_len, generator=gen, dtype=torch.float64)
    adv = torch.where(mask.bool(), adv, torch.full_like(adv, 1e6))
    return logprobs.requires_grad_(), old, adv, mask, turn_ids_from_mask(mask)


def _one_token_turns(mask: torch.Tensor) -> torch.Tensor:
    """Every masked token its own turn (0, 1, 2, ... per sequence), -1 elsewhere."""
    ids = mask.long().cumsum(dim=1) - 1
    return torch.where(mask.bool(), ids, torch.full_like(ids, -1))


def _one_turn_per_sequence(mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), torch.zeros_like(mask), torch.full_like(mask, -1)).long()


def _loss(logprobs, old, adv, mask, turn_ids, **kw):
    kw = {"clip_eps_low": EPS_LOW, "clip_eps_high": EPS_HIGH, **kw}
    return compute_policy_loss(logprobs, old, adv, mask, turn_ids, **kw)


def _grad(loss, logprobs):
    (g,) = torch.autograd.grad(loss, logprobs)
    return g


# --------------------------------------------------------------------------- identities

AGG_AND_BIAS = list(itertools.product(["token-mean", "seq-mean-token-mean"], [False, True]))


@pytest.mark.parametrize("loss_agg_mode,bias_correction", AGG_AND_BIAS)
def test_turn_ppo_with_one_token_turns_equals_token_ppo(loss_agg_mode, bias_correction):
    logprobs, old, adv, mask, turn_ids = _random_batch(seed=1)
    kw = dict(loss_agg_mode=loss_agg_mode, bias_correction=bias_correction, tau=0.005)
    token = _loss(logprobs, old, adv, mask, turn_ids, ratio_level="token", **kw)
    turn = _loss(logprobs, old, adv, mask, _one_token_turns(mask), ratio_level="turn", **kw)
    assert token.metrics["clip_ratio"] > 0.1  # the identity is exercised with clipping
    if bias_correction:
        assert token.metrics["clip_bias_scale"] < 0.9
    torch.testing.assert_close(turn.loss, token.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(turn.loss, logprobs), _grad(token.loss, logprobs))
    for name in ("pg_loss", "clip_ratio", "approx_kl", "clip_bias_norm", "clip_bias_scale",
                 "ratio_mean", "ratio_max", "ratio_min", "num_tokens"):  # fmt: skip
        torch.testing.assert_close(turn.metrics[name], token.metrics[name], msg=name)
    # With one-token turns, the fraction of clipped turns is the fraction of clipped tokens.
    torch.testing.assert_close(turn.metrics["clip_ratio_turn"], token.metrics["clip_ratio"])


def _gspo_loss(logprobs, old, adv, mask):
    """GSPO-style sequence ratio s_i = exp(mean_t logr_t), written directly."""
    m = mask.double()
    logr = torch.where(mask.bool(), logprobs - old, torch.zeros_like(old))
    seq_ratio = torch.exp((logr * m).sum(1) / m.sum(1).clamp_min(1)).unsqueeze(1)
    a = torch.where(mask.bool(), adv, torch.zeros_like(adv))
    per_token = torch.maximum(-a * seq_ratio, -a * seq_ratio.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    return (per_token * m).sum() / m.sum(), seq_ratio


def test_turn_ppo_with_one_turn_per_sequence_equals_gspo_sequence_ratio():
    logprobs, old, adv, mask, _ = _random_batch(seed=2, log_ratio_std=0.6)
    turn = _loss(logprobs, old, adv, mask, _one_turn_per_sequence(mask), ratio_level="turn")
    gspo, seq_ratio = _gspo_loss(logprobs, old, adv, mask)
    assert turn.metrics["clip_ratio"] > 0.1
    torch.testing.assert_close(turn.loss, gspo, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(turn.loss, logprobs), _grad(gspo, logprobs))
    present = mask.sum(1) > 0
    torch.testing.assert_close(turn.metrics["ratio_max"], seq_ratio.squeeze(1)[present].max())


@pytest.mark.parametrize("ratio_level", ["token", "turn"])
def test_triggered_scale_is_one_when_nothing_is_clipped(ratio_level):
    logprobs, old, adv, mask, turn_ids = _random_batch(seed=3, log_ratio_std=0.05)
    plain = _loss(logprobs, old, adv, mask, turn_ids, ratio_level=ratio_level)
    scaled = _loss(logprobs, old, adv, mask, turn_ids, ratio_level=ratio_level,
                   bias_correction=True, normalize_mode="triggered", tau=1e-12)  # fmt: skip
    assert scaled.metrics["clip_ratio"].item() == 0.0
    assert scaled.metrics["clip_bias_norm"].item() == 0.0
    assert scaled.metrics["clip_bias_scale"].item() == 1.0  # exactly, even with a tiny tau
    assert scaled.loss.item() == plain.loss.item()
    torch.testing.assert_close(_grad(scaled.loss, logprobs), _grad(plain.loss, logprobs),
                               rtol=0, atol=0)  # fmt: skip
    divide = _loss(logprobs, old, adv, mask, turn_ids, ratio_level=ratio_level,
                   bias_correction=True, normalize_mode="divide")  # fmt: skip
    assert divide.metrics["clip_bias_scale"].item() == 1.0


@pytest.mark.parametrize("ratio_level", ["token", "turn"])
def test_bias_corrected_gradient_is_scaled_base_gradient(ratio_level):
    logprobs, old, adv, mask, turn_ids = _random_batch(seed=4)
    plain = _loss(logprobs, old, adv, mask, turn_ids, ratio_level=ratio_level)
    scaled = _loss(logprobs, old, adv, mask, turn_ids, ratio_level=ratio_level,
                   bias_correction=True, tau=0.01)  # fmt: skip
    s = scaled.metrics["clip_bias_scale"]
    assert 0.0 < s.item() < 0.9
    torch.testing.assert_close(
        _grad(scaled.loss, logprobs), s * _grad(plain.loss, logprobs), rtol=1e-12, atol=1e-15
    )


# --------------------------------------------------------------------------- reference loop


def _reference_policy_loss(
    logprobs, old, adv, mask, turn_ids, *, ratio_level, turn_advantage, loss_agg_mode,
    bias_correction, normalize_mode, tau, delta=1e-8,
):  # fmt: skip
    """Python loops over sequences, turns and tokens; the clipping bias by autograd."""
    batch, seq_len = mask.shape
    num_tokens = int(mask.sum())
    num_seqs = int((mask.sum(1) > 0).sum())
    loss = logprobs.new_zeros(())
    surrogate = logprobs.new_zeros(())
    num_turns = clipped_turns = 0
    for i in range(batch):
        n_i = int(mask[i].sum())
        turns = sorted({int(turn_ids[i, t]) for t in range(seq_len) if mask[i, t]})
        for k in turns:
            toks = [t for t in range(seq_len) if mask[i, t] and int(turn_ids[i, t]) == k]
            logrs = [logprobs[i, t] - old[i, t] for t in toks]
            turn_log_rho = sum(logrs) / len(toks)
            turn_mean_adv = sum(float(adv[i, t]) for t in toks) / len(toks)
            any_clipped = False
            for t, logr in zip(toks, logrs, strict=True):
                ratio = torch.exp(turn_log_rho if ratio_level == "turn" else logr)
                a = turn_mean_adv if turn_advantage == "turn_mean" else float(adv[i, t])
                w = 1 / num_tokens if loss_agg_mode == "token-mean" else 1 / (n_i * num_seqs)
                clipped_ratio = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
                loss = loss - w * torch.minimum(ratio * a, clipped_ratio * a)
                r = ratio.item()
                if (a > 0 and r > 1 + EPS_HIGH) or (a < 0 and r < 1 - EPS_LOW):
                    surrogate = surrogate + w * ratio * a
                    any_clipped = True
            num_turns += 1
            clipped_turns += any_clipped
    if surrogate.requires_grad:
        (bias_grad,) = torch.autograd.grad(surrogate, logprobs, retain_graph=True)
        norm = bias_grad.norm()
    else:
        norm = logprobs.new_zeros(())
    if not bias_correction:
        scale = 1.0
    elif normalize_mode == "triggered":
        scale = 1 / max(1.0, float(norm) / tau)
    else:
        scale = 1 / (float(norm) + delta) if surrogate.requires_grad else 1.0
    return scale * loss, norm, clipped_turns / num_turns


CASES = list(
    itertools.product(
        ["token", "turn"], ["token", "turn_mean"], ["token-mean", "seq-mean-token-mean"],
        [(False, "triggered"), (True, "triggered"), (True, "divide")],
    )
)  # fmt: skip


@pytest.mark.parametrize("ratio_level,turn_advantage,loss_agg_mode,bias", CASES)
def test_vectorised_matches_reference_loop(ratio_level, turn_advantage, loss_agg_mode, bias):
    bias_correction, normalize_mode = bias
    for seed in (10, 11):
        logprobs, old, adv, mask, turn_ids = _random_batch(seed=seed, log_ratio_std=0.4)
        kw = dict(ratio_level=ratio_level, turn_advantage=turn_advantage,
                  loss_agg_mode=loss_agg_mode, bias_correction=bias_correction,
                  normalize_mode=normalize_mode, tau=0.01)  # fmt: skip
        out = _loss(logprobs, old, adv, mask, turn_ids, **kw)
        ref_loss, ref_norm, ref_clip_turn = _reference_policy_loss(
            logprobs, old, adv, mask, turn_ids, **kw
        )
        torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(
            _grad(out.loss, logprobs), _grad(ref_loss, logprobs), rtol=1e-10, atol=1e-13
        )
        torch.testing.assert_close(out.metrics["clip_bias_norm"], ref_norm, rtol=1e-10, atol=0)
        assert out.metrics["clip_ratio_turn"].item() == pytest.approx(ref_clip_turn, abs=1e-15)
        assert 0 < ref_clip_turn < 1


CLOSED_FORM_CASES = list(
    itertools.product(
        ["token", "turn"], ["token", "turn_mean"], ["token-mean", "seq-mean-token-mean"]
    )
)


@pytest.mark.parametrize("ratio_level,turn_advantage,loss_agg_mode", CLOSED_FORM_CASES)
def test_closed_form_bias_gradient_equals_autograd(ratio_level, turn_advantage, loss_agg_mode):
    logprobs, old, adv, mask, turn_ids = _random_batch(seed=5, log_ratio_std=0.5)
    kw = dict(ratio_level=ratio_level, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
              turn_advantage=turn_advantage, loss_agg_mode=loss_agg_mode)  # fmt: skip
    leaf = logprobs.detach().clone().requires_grad_()
    surrogate = clip_bias_surrogate(leaf, old, adv, mask, turn_ids, **kw)
    (autograd_grad,) = torch.autograd.grad(surrogate, leaf)
    out = compute_policy_loss(logprobs, old, adv, mask, turn_ids, **kw)
    assert out.metrics["clip_ratio"] > 0.1
    torch.testing.assert_close(
        out.metrics["clip_bias_norm"], autograd_grad.norm(), rtol=1e-12, atol=0
    )
    # The per-token closed form itself.
    closed = clip_bias_logprob_grad(logprobs, old, adv, mask, turn_ids, **kw)
    torch.testing.assert_close(closed, autograd_grad, rtol=1e-12, atol=1e-16)
    # A shared (mini-batch) denominator scales it: D instead of this batch's own count
    own = mask.sum() if loss_agg_mode == "token-mean" else (mask.sum(dim=1) > 0).sum()
    shared = clip_bias_logprob_grad(logprobs, old, adv, mask, turn_ids, **kw, agg_denominator=50)
    torch.testing.assert_close(shared, closed * float(own) / 50, rtol=1e-12, atol=1e-16)


# --------------------------------------------------------------------------- gradient checks


@pytest.mark.parametrize("ratio_level", ["token", "turn"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_gradcheck_float64(ratio_level, loss_agg_mode):
    logprobs, old, adv, mask, turn_ids = _random_batch(
        seed=8, batch=3, seq_len=9, log_ratio_std=0.6
    )
    logprobs = torch.where(mask.bool(), logprobs, old).detach().requires_grad_()

    def fn(lp):
        return _loss(lp, old, adv, mask, turn_ids, ratio_level=ratio_level,
                     loss_agg_mode=loss_agg_mode).loss  # fmt: skip

    out = _loss(logprobs, old, adv, mask, turn_ids, ratio_level=ratio_level)
    assert out.metrics["clip_ratio"] > 0.2  # both branches of the min are exercised
    assert torch.autograd.gradcheck(fn, (logprobs,), eps=1e-6, atol=1e-8, rtol=1e-6)


def _linear_policy(weight, features, actions):
    """Tiny "policy": logits = features @ weight; log-prob of the taken action. [B, T]."""
    logits = features @ weight
    return torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def _linear_setup(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len, dim, vocab = 2, 7, 3, 4
    weight = torch.randn(dim, vocab, generator=gen, dtype=torch.float64)
    features = torch.randn(batch, seq_len, dim, generator=gen, dtype=torch.float64)
    actions = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 1, 1]])
    # Behaviour policy: a perturbed copy of the weights (off-policy data).
    old_weight = weight + 0.6 * torch.randn(dim, vocab, generator=gen, dtype=torch.float64)
    old = _linear_policy(old_weight, features, actions)
    adv = torch.randn(batch, seq_len, generator=gen, dtype=torch.float64)
    return weight, features, actions, mask, old, adv


@pytest.mark.parametrize("ratio_level", ["token", "turn"])
def test_autograd_matches_finite_differences_on_linear_policy(ratio_level):
    weight, features, actions, mask, old, adv = _linear_setup(seed=7)
    turn_ids = turn_ids_from_mask(mask)

    def loss_of(w):
        lp = _linear_policy(w, features, actions)
        return _loss(lp, old, adv, mask, turn_ids, ratio_level=ratio_level)

    w = weight.clone().requires_grad_()
    out = loss_of(w)
    assert out.metrics["clip_ratio"] > 0.1  # clipping is active in this check
    (grad,) = torch.autograd.grad(out.loss, w)
    numeric = torch.zeros_like(weight)
    h = 1e-6
    for idx in itertools.product(*(range(n) for n in weight.shape)):
        plus, minus = weight.clone(), weight.clone()
        plus[idx] += h
        minus[idx] -= h
        numeric[idx] = (loss_of(plus).loss - loss_of(minus).loss) / (2 * h)
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("ratio_level", ["token", "turn"])
def test_param_bias_norm_is_chain_rule_of_logprob_gradient(ratio_level):
    # bias_norm=param: C = d/dW of the clipped-token surrogate. By the chain rule it equals
    # J^T g, with g the [B, T] logprob-space clipping bias (closed form) and J = dlogp/dW.
    weight, features, actions, mask, old, adv = _linear_setup(seed=8)
    turn_ids = turn_ids_from_mask(mask)
    w = weight.clone().requires_grad_()
    lp = _linear_policy(w, features, actions)
    kw = dict(ratio_level=ratio_level, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    surrogate = clip_bias_surrogate(lp, old, adv, mask, turn_ids, **kw)
    (param_bias,) = torch.autograd.grad(surrogate, w, retain_graph=True)
    leaf = lp.detach().requires_grad_()
    (logprob_bias,) = torch.autograd.grad(
        clip_bias_surrogate(leaf, old, adv, mask, turn_ids, **kw), leaf
    )
    (chain,) = torch.autograd.grad(lp, w, grad_outputs=logprob_bias)
    assert param_bias.norm() > 0
    torch.testing.assert_close(param_bias, chain, rtol=1e-12, atol=1e-15)
    # Passing the parameter-space norm switches the scale to it: s = 1 / max(1, ||C|| / tau).
    tau = param_bias.norm().item() / 4
    out = compute_policy_loss(lp, old, adv, mask, turn_ids, **kw, bias_correction=True, tau=tau,
                              clip_bias_norm=param_bias.norm())  # fmt: skip
    assert out.metrics["clip_bias_scale"].item() == pytest.approx(0.25, rel=1e-12)
    assert out.loss.item() == pytest.approx(0.25 * out.metrics["pg_loss"].item(), rel=1e-12)
