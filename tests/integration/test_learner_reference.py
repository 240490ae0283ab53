"""One ``Learner.step`` against an independent plain-torch reference, for every variant.

The reference is written here from spec sections 2, 3 and 6, with Python loops over turns
and tokens where the learner uses vectorised segment reductions: token rewards (outcome
reward on the last policy token minus ``kl_coef * low_var_kl``), GAE(1, 1) over policy
tokens and whitening, or GRPO group advantages; token or turn (geometric-mean) ratios
against the behaviour or the proximal policy, the +-20 log-ratio clamp, the PPO clip and
the dual clip, decoupled PPO's truncated behaviour weights, and the clipping-bias scale
with ``scale_target = loss``. The learner runs fp32 ZeRO-0 (a plain torch optimizer, so
``p.grad`` holds the accumulated gradient), one optimizer step per learner step, and the
test compares the policy gradient just before that step with the reference's autograd
gradient, computed in float64: the learner's float32 gradient must be within the float32
rounding bound of ``tests/numerics.py`` (derived from the unit roundoff and the vocabulary
size, so it holds whatever order a CPU's kernels sum in). The critic's values are an input of the reference (read from the learner's
critic before the step), not recomputed.

What it catches (each checked by breaking the code on purpose): turn ratios replaced by
token ratios, a flipped loss sign, the reward on the wrong token, the KL estimator or the
whitening changed, the log-ratio clamp widened, behaviour weights or the dual clip ignored,
the clipping-bias scale computed per micro-batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from learner_factories import capture_gradients, make_batch, make_tiny_learner
from numerics import assert_gradients_close
from transformers import AutoModelForCausalLM

from learner.batch import TrainingBatch, collate_trajectories
from learner.config import VARIANT_CONFIGS

pytestmark = [pytest.mark.integration, pytest.mark.cpu_isa]

KL_COEF = 0.05
CLAMP = 20.0  # spec: |log ratio| bound before exp; beyond it a token has no gradient
TURN_RATIO_VARIANTS = {"turn_ppo", "st_ppo", "so_grpo"}  # spec section 2 table, not the code's
CRITIC_VARIANTS = {"ppo", "turn_ppo", "s_ppo", "st_ppo", "gspo", "cispo"}

CASES = [
    # (variant, overrides): every variant; behaviour and decoupled off-policy objectives
    ("ppo", {"off_policy": "behavior", "clip_ratio_c": None}),
    ("turn_ppo", {"off_policy": "decoupled"}),
    ("s_ppo", {"off_policy": "behavior", "scale_target": "loss", "tau": 1e-3}),
    ("st_ppo", {"off_policy": "behavior", "scale_target": "loss", "tau": 1e-3}),
    ("grpo", {"off_policy": "behavior", "clip_ratio_c": None}),
    # the old behavior_weight_level = "turn", cap 1.5 (the turn's geometric mean, truncated)
    ("so_grpo", {"off_policy": "decoupled", "rollout_correction": {
        "is_level": "turn", "is_statistic": "geometric_mean", "is_cap": 1.5}}),
    # GSPO at its own clip range and seq-mean-token-mean; against the behaviour policy, so
    # the sequence ratios clip
    ("gspo", {"off_policy": "behavior"}),
    ("cispo", {"off_policy": "behavior"}),
    # sequence TIS (product) and a sequence Geo-RS mask; IcePop with M2PO on top
    ("ppo", {"off_policy": "decoupled",
             "rollout_correction": {"is_level": "sequence", "is_cap": 3.0,
                                    "mask_level": "sequence", "mask_low": 0.9}}),
    ("turn_ppo", {"off_policy": "decoupled",
                  "rollout_correction": {"is_level": "token", "is_cap": 5.0, "mask_level": "token",
                                         "mask_low": 0.5, "mask_high": 5.0},
                  "m2po_threshold": 0.5}),
    # the log-linear proximal at the step's first update is the recomputed one
    ("ppo", {"off_policy": "decoupled", "proximal": "loglinear",
             "rollout_correction": {"is_level": "turn"}}),
]  # fmt: skip


def trajectories():
    """Four two-turn trajectories (groups of 2, rewards 1, 0, 1, 0). One token of a reward-0
    trajectory has a behaviour log-prob 35 nats below the model's (log-ratio ~ +24 > 20):
    only the log-ratio clamp keeps it from dominating a negative-advantage gradient."""
    batch = make_batch(11)
    batch[1].behavior_logprobs[0] = -45.0
    return batch


def response_logprobs(model, batch: TrainingBatch) -> torch.Tensor:
    """[B, T] log-probs of the response tokens from a plain HF forward (in the model's
    dtype: fp32, or fp64 for the exact reference)."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    ).logits
    p, t = batch.prompt_width, batch.response_ids.shape[1]
    logits = out[:, p - 1 : p + t - 1, :]
    return torch.log_softmax(logits, -1).gather(2, batch.response_ids[..., None])[..., 0]


def low_var_kl(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = torch.clamp(ref - logp, -CLAMP, CLAMP)
    return torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)


def turns_of(batch: TrainingBatch, row: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for t in range(batch.response_ids.shape[1]):
        if batch.loss_mask[row, t] > 0:
            out.setdefault(int(batch.turn_ids[row, t]), []).append(t)
    return out


def reference_advantages(
    batch: TrainingBatch, old: torch.Tensor, ref: torch.Tensor, values, critic: bool
) -> torch.Tensor:
    mask = batch.loss_mask
    kl = low_var_kl(old, ref) * mask
    adv = torch.zeros_like(mask, dtype=torch.float64)
    if critic:
        for i in range(batch.batch_size):
            policy = [t for t in range(mask.shape[1]) if mask[i, t] > 0]
            rewards = {t: -KL_COEF * float(kl[i, t]) for t in policy}
            rewards[policy[-1]] += float(batch.rewards[i])  # outcome reward on the last token
            for t in policy:  # GAE(gamma = 1, lambda = 1): return-to-go minus the value
                adv[i, t] = sum(rewards[u] for u in policy if u >= t) - float(values[i, t])
        picked = adv[mask > 0]
        whitened = (picked - picked.mean()) / torch.sqrt(picked.var(unbiased=True) + 1e-8)
        adv[mask > 0] = whitened
        return adv.to(old.dtype)
    scores = batch.rewards.double() - KL_COEF * kl.double().sum(1)
    for i in range(batch.batch_size):
        group = [j for j in range(batch.batch_size) if batch.group_ids[j] == batch.group_ids[i]]
        g = scores[group]
        adv[i] = (scores[i] - g.mean()) / (g.std(unbiased=True) + 1e-6) * mask[i]
    return adv.to(old.dtype)


def segments_of(batch: TrainingBatch, row: int, level: str) -> list[list[int]]:
    """The policy-token positions of ``row`` grouped by token, turn or sequence."""
    turns = list(turns_of(batch, row).values())
    if level == "turn":
        return turns
    flat = [t for tokens in turns for t in tokens]
    return [flat] if level == "sequence" else [[t] for t in flat]


def behavior_weights(old, behavior, batch: TrainingBatch, cfg) -> torch.Tensor:
    """The rollout correction (TIS, MIS, IcePop) and M2PO, written out per segment: the
    weight of a token is min(W, cap) with W the product (or geometric mean) of the token
    weights pi_prox / pi_b over its segment, times 0 where the mask statistic of its
    segment leaves [low, high] or M2PO drops it."""
    weight = torch.ones_like(old)
    rc = cfg.correction
    logw = ((old - behavior) * batch.loss_mask).double()
    for i in range(batch.batch_size):
        if rc.is_level != "none":
            for tokens in segments_of(batch, i, rc.is_level):
                total = float(sum(logw[i, t] for t in tokens))
                stat = total / len(tokens) if rc.is_statistic == "geometric_mean" else total
                for t in tokens:
                    weight[i, t] = min(math.exp(stat), rc.is_cap)
        if rc.mask_level != "none":
            high = math.inf if rc.mask_high is None else rc.mask_high
            for tokens in segments_of(batch, i, rc.mask_level):
                total = float(sum(logw[i, t] for t in tokens))
                stat = total / len(tokens) if rc.mask_statistic == "geometric_mean" else total
                if not rc.mask_low <= math.exp(stat) <= high:
                    for t in tokens:
                        weight[i, t] = 0.0
    if cfg.m2po_threshold is not None:  # drop the largest (log w)^2 until the mean is below
        policy = [(i, t) for i in range(batch.batch_size) for t in range(old.shape[1])
                  if batch.loss_mask[i, t] > 0]  # fmt: skip
        kept = sorted(policy, key=lambda it: -(float(logw[it]) ** 2))
        while sum(float(logw[it]) ** 2 for it in kept) / len(kept) >= cfg.m2po_threshold:
            weight[kept.pop(0)] = 0.0
    return weight


def reference_loss(logp, old, behavior, adv, batch: TrainingBatch, cfg) -> torch.Tensor:
    """Spec sections 2 and 6 and the corrections, token by token; scaled by s with
    scale_target = loss."""
    mask = batch.loss_mask.to(logp.dtype)
    n = float(mask.sum())
    level = {"gspo": "sequence"}.get(cfg.variant, "turn" if cfg.variant in TURN_RATIO_VARIANTS
                                     else "token")  # fmt: skip
    logr = torch.zeros_like(logp)
    delta = cfg.token_log_ratio_bound if level != "token" else None
    for i in range(batch.batch_size):
        for tokens in segments_of(batch, i, level):
            raw = [logp[i, t] - old[i, t] for t in tokens]
            if delta is not None:  # bound each token in the direction of the turn's mean A
                mean_adv = float(adv[i, tokens].mean())
                if mean_adv > 0:
                    raw = [torch.clamp(x, max=delta) for x in raw]
                elif mean_adv < 0:
                    raw = [torch.clamp(x, min=-delta) for x in raw]
            mean = torch.stack(raw).mean()
            for k, t in enumerate(tokens):
                if level == "sequence":  # GSPO-token: value s_i, gradient s_i grad log pi_t
                    logr[i, t] = mean.detach() + raw[k] - raw[k].detach()
                else:
                    logr[i, t] = mean
    weight_b = torch.ones_like(logp)
    if cfg.off_policy == "decoupled":
        weight_b = behavior_weights(old, behavior, batch, cfg)
    in_range = (logr.detach().abs() < CLAMP).float()
    ratio = torch.exp(logr.clamp(-CLAMP, CLAMP))
    low, high = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    if cfg.variant == "cispo":  # -sg(clip(r)) A log pi (MiniMax-M1 eq. 4)
        per_token = -ratio.detach().clamp(max(low, 0.0), high) * adv * logp * mask
    else:
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    c = cfg.clip_ratio_c
    if c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * c), per_token)
    if cfg.loss_agg_mode == "seq-mean-token-mean":  # mean over a row's tokens, then rows
        w = mask / (mask.sum(1, keepdim=True) * batch.batch_size)
    else:
        w = mask / n
    w = w * weight_b
    loss = (w * per_token).sum()
    if getattr(cfg, "scale_target", "update") != "loss":
        return loss  # no scale, or s acts on the learning rate (not on the gradient)
    # clipping bias (logprob norm): d/dlogp of sum_{Clip} w ratio A, turn-summed for turn ratios
    r = ratio.detach()
    clipped = ((adv > 0) & (r > high)) | ((adv < 0) & (r < low))
    if c is not None:
        clipped |= (adv < 0) & (r > c)
    contrib = (w * clipped * r * adv * in_range).detach()
    grad = torch.zeros_like(contrib)
    for i in range(batch.batch_size):
        for tokens in turns_of(batch, i).values():
            mean_adv = float(adv[i, tokens].mean())
            for t in tokens:
                if level == "token":
                    grad[i, t] = contrib[i, t]
                    continue
                raw = float(logp[i, t] - old[i, t])
                bounded = delta is not None and (
                    (mean_adv > 0 and raw > delta) or (mean_adv < 0 and raw < -delta)
                )
                grad[i, t] = 0.0 if bounded else contrib[i, tokens].sum() / len(tokens)
    norm = float(grad.norm())
    s = 1.0 / max(1.0, norm / cfg.tau)
    assert s < 1.0  # the case is built so that the scale acts
    return s * loss


@pytest.mark.parametrize(("variant", "overrides"), CASES, ids=[c[0] for c in CASES])
def test_learner_gradient_equals_reference(variant, overrides, tiny_llama_dir: Path):
    check_against_reference(variant, overrides, tiny_llama_dir)


@pytest.mark.parametrize(
    ("variant", "overrides"), [CASES[1], CASES[3]], ids=[CASES[1][0], CASES[3][0]]
)
@pytest.mark.parametrize("learner_overrides", [
    # rows of 5..8 prompt + 10 response tokens (make_batch): the two longest share a
    # 40-slot micro-batch (2 * (8 + 10) = 36), a third would not fit (54); 16: each alone
    {"micro_batch_tokens": 40},
    {"micro_batch_tokens": 16},
    {"logprob_chunk_tokens": 0},  # the full-vocabulary path
    {"logprob_chunk_tokens": 3},  # a few policy tokens per chunk
    # packed forwards (no padding, no attention mask); by budget, 18 + 17 real tokens share
    {"pack_sequences": True},
    {"pack_sequences": True, "micro_batch_tokens": 40},
], ids=["budget40", "budget16", "full_vocab", "chunk3", "packed", "packed_budget40"])  # fmt: skip
def test_learner_paths_equal_reference(variant, overrides, learner_overrides, tiny_llama_dir: Path):
    """The same reference holds with micro-batches by token budget and either log-prob path
    (turn ratios with the decoupled objective; scale_target = loss, whose ||C|| must add up
    over whatever micro-batches there are). Gradients sum in another order across chunks
    and micro-batches: the same float32 bound (``tests/numerics.py``) holds."""
    check_against_reference(variant, overrides, tiny_llama_dir, **learner_overrides)


def check_against_reference(variant, overrides, tiny_llama_dir: Path, **learner_overrides):
    cfg = VARIANT_CONFIGS[variant](kl_coef=KL_COEF, **overrides)
    learner = make_tiny_learner(tiny_llama_dir, cfg, actor_lr=1e-4, **learner_overrides)
    trajs = trajectories()
    if cfg.proximal == "loglinear":
        learner.policy_version = 5  # two versions ahead of the batch's (3): alpha = 1 at j = 0
    batch = collate_trajectories(trajs, learner.pad_token_id)
    if "micro_batch_tokens" in learner_overrides:  # the plans the cases above describe
        sizes = [len(rows) for rows, _ in learner.micro_batches.plan(batch, range(4))]
        assert sizes == ([2, 2] if learner_overrides["micro_batch_tokens"] == 40 else [1] * 4)
    with torch.no_grad():
        values = (
            learner._values(batch) * batch.loss_mask if cfg.variant in CRITIC_VARIANTS else None
        )

    captured = capture_gradients(learner)
    metrics = learner.step(trajs)
    assert metrics.optimizer_steps == 1 and metrics.skipped_steps == 0

    # the reference in float64: exact next to the learner's float32, whose rounding the
    # tolerance bounds (tests/numerics.py), whatever order this CPU's kernels sum in
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64)
    with torch.no_grad():
        ref = response_logprobs(reference, batch) * batch.loss_mask
        start = response_logprobs(model, batch) * batch.loss_mask
    behavior = batch.behavior_logprobs.double()
    old = start if cfg.off_policy == "decoupled" else behavior
    # the log-linear proximal has no proximal log-probs at the reward: the behaviour's stand in
    kl_old = behavior if cfg.proximal == "loglinear" else old
    values = None if values is None else values.double()
    adv = reference_advantages(batch, kl_old, ref, values, cfg.variant in CRITIC_VARIANTS)
    logp = response_logprobs(model, batch)
    loss = reference_loss(logp, old, behavior, adv, batch, cfg)
    loss.backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert_gradients_close(captured["policy"], expected, reduction_length=model.config.vocab_size)
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in expected.values()])) > 0
