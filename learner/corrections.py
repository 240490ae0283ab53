"""Off-policy corrections of the behaviour/proximal mismatch, as pure functions over tensors.

With the decoupled objective (AReaL's decoupled PPO; spec section 6) three policies meet in
one learner step: the behaviour policy pi_b that sampled a token (its engine log-prob, recorded
at generation), the proximal policy pi_prox (the learner's weights at the start of the step)
and the current policy pi_theta. The clipped ratio of :func:`learner.losses.compute_policy_loss`
is ``pi_theta / pi_prox``; this module decides how each token's loss is weighted for the gap
``w_t = pi_prox(y_t) / pi_b(y_t)`` that staleness (and the engine/learner mismatch) leaves:

- **importance weights** (:func:`rollout_correction`, ``is_level``): truncated importance
  sampling, TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
  RL training"; verl ``rollout_is``): ``min(W, cap)`` where ``W`` is the token's own weight
  (``token``) or a statistic of the weights of its turn or sequence (``turn``, ``sequence``):
  the product ``exp(sum log w)`` (``ratio``, the segment's likelihood ratio, verl's sequence
  IS) or the geometric mean ``exp(mean log w)`` (``geometric_mean``).
- **masks** (``mask_level``): masked importance sampling / rejection sampling, MIS (verl
  ``rollout_rs``; Geo-RS is the geometric mean over a sequence): a token, turn or sequence
  whose statistic leaves ``[mask_low, mask_high]`` gets weight 0. IcePop (Ling team,
  Ring-1T, 2025; OpenRLHF ``is_correction_type = icepop``) is the token mask ``[0.5, 5]``
  with the kept tokens weighted by ``w`` (token IS with a cap >= 5).
- **M2PO** (:func:`m2po_keep_mask`; Zheng et al. 2025, "Prosperity before Collapse: How Far
  Can Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161, Algorithm 1): the
  tokens with the largest squared log weight are masked until the second moment of the rest
  falls below a threshold.
- **the log-linear proximal approximation** (:func:`loglinear_proximal_logprobs`; AReaL
  ``docs/algorithms/prox_approx.md``, A-3PO): ``log pi_prox`` interpolated between the
  behaviour and the current log-probs by policy version, which saves the proximal forward.

A masked token stays in the loss's denominator (weight 0, as AReaL's rejection sampling and
OpenRLHF's IcePop count it; verl's rejection sampling removes it from the denominator).
Everything here runs under ``no_grad``: the weights are constants of the loss. Levels:
every statistic is defined per token, per turn (the turn ids of the rollout) and per
sequence; ``token`` ignores the statistic (a token's product and geometric mean are its
weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from learner.constants import LOG_RATIO_CLAMP
from learner.losses import masked_mean, segment_sum

CorrectionLevel = Literal["none", "token", "turn", "sequence"]
SegmentStatistic = Literal["ratio", "geometric_mean"]

_LEVELS = ("none", "token", "turn", "sequence")
_STATISTICS = ("ratio", "geometric_mean")


@dataclass
class RolloutCorrection:
    """Result of :func:`rollout_correction`.

    Attributes:
        weights: float [B, T], detached: the truncated importance weight times the keep
            mask; 0 off the loss mask. All 1 on the mask with both levels ``none``.
        keep: bool [B, T]: policy tokens the mask kept (all policy tokens without a mask).
        metrics: detached 0-dim tensors: ``behavior_weight_mean`` and
            ``behavior_weight_max`` (the raw importance weight at ``is_level``, over policy
            tokens; the token weight when ``is_level`` is ``none``),
            ``behavior_weight_capped`` (share of policy tokens whose weight the cap
            truncated), ``behavior_masked`` (share of policy tokens the mask dropped),
            ``behavior_log_ratio_abs_mean`` (mean ``|log w_t|`` per token, nats).
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, Tensor]


def segment_log_statistic(
    token_log_weight: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    level: Literal["token", "turn", "sequence"],
    statistic: SegmentStatistic,
) -> Tensor:
    """``log`` of a weight statistic per token, per turn or per sequence, broadcast to tokens.

    ``token``: ``log w_t`` itself. ``turn`` / ``sequence``, over the policy tokens S of the
    token's turn or sequence: ``sum_{s in S} log w_s`` (``ratio``: the product of the
    weights, the segment's likelihood ratio) or ``(1/|S|) sum_{s in S} log w_s``
    (``geometric_mean``). One ``scatter_add`` over flat segment ids; no loop over rows.

    Args:
        token_log_weight: float [B, T], ``log w_t`` (0 off the mask is not required).
        loss_mask: [B, T], 1 on policy tokens.
        turn_ids: int [B, T], turn index on policy tokens (ignored unless ``level="turn"``).
        level: ``"token"``, ``"turn"`` or ``"sequence"``.
        statistic: ``"ratio"`` or ``"geometric_mean"``.

    Returns:
        float [B, T]: the statistic's log on policy tokens, 0 elsewhere.

    Raises:
        ValueError: unknown level or statistic, or mismatched shapes.
    """
    if level not in ("token", "turn", "sequence"):
        raise ValueError(f"level must be token, turn or sequence, got {level!r}")
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {_STATISTICS}, got {statistic!r}")
    if token_log_weight.shape != loss_mask.shape or turn_ids.shape != loss_mask.shape:
        raise ValueError(
            f"token_log_weight {tuple(token_log_weight.shape)}, loss_mask "
            f"{tuple(loss_mask.shape)} and turn_ids {tuple(turn_ids.shape)} must match"
        )
    policy = loss_mask != 0
    log_w = torch.where(policy, token_log_weight, torch.zeros_like(token_log_weight))
    if level == "token":
        return log_w
    batch, width = log_w.shape
    row = torch.arange(batch, device=log_w.device).unsqueeze(1) * width
    within = turn_ids.long().clamp_min(0) if level == "turn" else torch.zeros_like(row)
    seg = torch.where(policy, row + within, torch.full_like(row, batch * width)).reshape(-1)
    num_segments = batch * width + 1
    sums = segment_sum(log_w.reshape(-1), seg, num_segments)
    if statistic == "geometric_mean":
        sizes = segment_sum(policy.reshape(-1).to(log_w.dtype), seg, num_segments)
        sums = sums / sizes.clamp_min(1.0)
    return torch.where(policy, sums.gather(0, seg).reshape(log_w.shape), torch.zeros_like(log_w))


@torch.no_grad()
def rollout_correction(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    is_level: CorrectionLevel = "token",
    is_statistic: SegmentStatistic = "ratio",
    is_cap: float = 2.0,
    mask_level: CorrectionLevel = "none",
    mask_statistic: SegmentStatistic = "geometric_mean",
    mask_low: float = 0.0,
    mask_high: float = float("inf"),
) -> RolloutCorrection:
    """Per-token weights that correct the behaviour/proximal mismatch (module docstring).

    With ``log w_t = log pi_prox(y_t) - log pi_b(y_t)`` clamped to +-``LOG_RATIO_CLAMP``:

        W_t    = exp(stat_is(log w)_t)                     (is_level, is_statistic)
        M_t    = exp(stat_mask(log w)_t)                   (mask_level, mask_statistic)
        keep_t = mask_low <= M_t <= mask_high              (all True with mask_level none)
        weight_t = min(W_t, is_cap) * keep_t               (W_t = 1 with is_level none)

    Sources: TIS (Yao et al. 2025; verl ``rollout_corr_helper.py``, token and sequence IS,
    upper truncation only); MIS / rejection sampling and Geo-RS (verl ``rollout_rs``
    ``token_k1`` / ``seq_sum_k1`` / ``seq_mean_k1``; note verl's k1 statistic is ``-log w``,
    so its window ``[log L, log U]`` keeps ``w`` in ``[1/U, 1/L]``: this function bounds
    ``w`` itself); IcePop (``mask_level = token``, bounds ``[0.5, 5]``, kept tokens weighted
    by ``w``: ``is_level = token`` with ``is_cap >= 5``). The turn level is the same formula
    over a turn's policy tokens (ROLL's segment ratios, SkyRL's step-wise GSPO).

    Args:
        proximal_logprobs: float [B, T]. Recomputed log-probs of the proximal policy (or
            their approximation, :func:`loglinear_proximal_logprobs`).
        behavior_logprobs: float [B, T]. Log-probs the engine recorded when sampling.
        loss_mask: [B, T]. 1 on policy tokens. turn_ids: int [B, T].
        is_level, is_statistic, is_cap: the importance weight (``is_cap`` > 1).
        mask_level, mask_statistic, mask_low, mask_high: the mask (0 <= low < high).

    Returns:
        :class:`RolloutCorrection` in float32 (float64 for float64 inputs).

    Raises:
        ValueError: mismatched shapes, an unknown level or statistic, ``is_cap <= 1``, or
            mask bounds that are not ``0 <= mask_low < mask_high``.

    Example (one token, ``log w = log 3``, the defaults: token TIS with cap 2): weight 2.
    """
    if proximal_logprobs.shape != behavior_logprobs.shape:
        raise ValueError(
            f"behavior_logprobs shape {tuple(behavior_logprobs.shape)} != "
            f"proximal_logprobs shape {tuple(proximal_logprobs.shape)}"
        )
    for name, value in (("is_level", is_level), ("mask_level", mask_level)):
        if value not in _LEVELS:
            raise ValueError(f"{name} must be one of {_LEVELS}, got {value!r}")
    if not is_cap > 1.0:
        raise ValueError(f"is_cap must be > 1, got {is_cap}")
    if not 0.0 <= mask_low < mask_high:
        raise ValueError(f"mask bounds must satisfy 0 <= low < high, got [{mask_low}, {mask_high}]")
    dtype = torch.float64 if proximal_logprobs.dtype == torch.float64 else torch.float32
    policy = loss_mask != 0
    maskf = policy.to(dtype)
    log_w = torch.where(
        policy, proximal_logprobs.to(dtype) - behavior_logprobs.to(dtype), torch.zeros_like(maskf)
    ).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if is_level == "none":
        raw = torch.exp(log_w) * maskf
        weights = maskf.clone()
        capped = torch.zeros_like(policy)
    else:
        stat = segment_log_statistic(
            log_w, loss_mask, turn_ids, level=is_level, statistic=is_statistic
        )
        raw = torch.exp(stat) * maskf
        capped = policy & (raw > is_cap)
        weights = raw.clamp(max=is_cap)
    keep = policy.clone()
    if mask_level != "none":
        stat = segment_log_statistic(
            log_w, loss_mask, turn_ids, level=mask_level, statistic=mask_statistic
        )
        value = torch.exp(stat)
        keep = policy & (value >= mask_low) & (value <= mask_high)
    metrics = {
        "behavior_weight_mean": masked_mean(raw, maskf),
        "behavior_weight_max": torch.where(policy, raw, torch.zeros_like(raw)).max(),
        "behavior_weight_capped": masked_mean(capped.to(dtype), maskf),
        "behavior_masked": masked_mean((policy & ~keep).to(dtype), maskf),
        "behavior_log_ratio_abs_mean": masked_mean(log_w.abs(), maskf),
    }
    return RolloutCorrection(weights=weights * keep.to(dtype), keep=keep, metrics=metrics)


@torch.no_grad()
def m2po_keep_mask(
    proximal_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor, *, threshold: float
) -> Tensor:
    """M2PO's second-moment mask (Zheng et al. 2025, arXiv 2510.01161, Algorithm 1).

    Over every policy token of the batch, ``M2_t = (log pi_prox(y_t) - log pi_b(y_t))^2``.
    While the mean of ``M2`` over the kept tokens is not below ``threshold``, the kept
    token with the largest ``M2`` is masked (ties: the first in row-major order first).
    Computed in one sort: with ``M2`` in descending order ``m_0 >= m_1 >= ...`` and the
    suffix means ``a_i = mean(m_i, ..., m_{n-1})``, the first ``k = min{i : a_i < threshold}``
    tokens are masked (``n - 1`` when no suffix qualifies: one token is always kept). This
    is AReaL's ``_get_m2po_loss_mask`` (``areal/trainer/ppo/actor.py``), over the whole
    batch as the paper defines it (AReaL applies it per micro-batch).

    Args:
        proximal_logprobs, behavior_logprobs: float [B, T].
        loss_mask: [B, T], 1 on policy tokens (at least one).
        threshold: > 0, the bound on the second moment (the paper: 0.04).

    Returns:
        bool [B, T]: the policy tokens kept.

    Raises:
        ValueError: mismatched shapes, no policy token, or ``threshold <= 0``.

    Example: ``M2 = [.0025, .01, .09, .0004, .25, .1225]``, threshold 0.04: the mean
    0.0792 -> drop 0.25 (mean 0.0451) -> drop 0.1225 (0.0257 < 0.04): tokens 4 and 5 masked.
    """
    if proximal_logprobs.shape != behavior_logprobs.shape or loss_mask.shape != (
        proximal_logprobs.shape
    ):
        raise ValueError("proximal_logprobs, behavior_logprobs and loss_mask must have one shape")
    if not threshold > 0.0:
        raise ValueError(f"M2PO threshold must be > 0, got {threshold}")
    policy = (loss_mask != 0).reshape(-1)
    count = int(policy.sum())
    if count == 0:
        raise ValueError("loss_mask selects no token: M2PO's second moment is undefined")
    delta = (proximal_logprobs.double() - behavior_logprobs.double()).reshape(-1)
    second = delta.square()[policy]
    order = torch.sort(second, descending=True, stable=True).indices
    ordered = second[order]
    suffix_sums = ordered.flip(0).cumsum(0).flip(0)
    suffix_means = suffix_sums / torch.arange(
        count, 0, -1, dtype=suffix_sums.dtype, device=suffix_sums.device
    )
    below = torch.nonzero(suffix_means < threshold)
    num_masked = int(below[0]) if len(below) else count - 1
    kept_flat = torch.ones(count, dtype=torch.bool, device=second.device)
    kept_flat[order[:num_masked]] = False
    keep = torch.zeros_like(policy)
    keep[policy.nonzero().squeeze(1)] = kept_flat
    return keep.reshape(loss_mask.shape)


def loglinear_proximal_alpha(
    token_versions: Tensor,
    proximal_version: int,
    *,
    updates_done: int,
    updates_per_version: int,
) -> Tensor:
    """The interpolation weight of :func:`loglinear_proximal_logprobs`, per token.

    Time is counted in optimizer updates: a token sampled by version ``v_b`` came from the
    weights after ``v_b * K`` updates (``K = updates_per_version``, a learner step's
    optimizer steps), the proximal policy is at ``P * K`` (``P = proximal_version``, the
    version at the start of this learner step) and the current policy at ``P * K + j``
    (``j = updates_done`` in this step). The proximal log-prob lies at the fraction

        alpha = (P - v_b) K / ((P - v_b) K + j)

    of the way from the behaviour to the current log-prob: 1 at ``j = 0`` (the current
    policy is the proximal one, the approximation is exact), 0 for a token of the current
    version (``v_b = P``: the behaviour policy is the proximal one). AReaL's
    ``compute_prox_logp_approximations`` counts versions as learner steps and takes
    ``v_prox = v_theta - 1``; this counts the updates inside a step, which our learner has.

    Args:
        token_versions: int [B, T], the version that sampled each token (< 0 off policy).
        proximal_version: the learner's version at the start of the step.
        updates_done: optimizer steps already taken in this learner step (>= 0).
        updates_per_version: optimizer steps per learner step (>= 1).

    Returns:
        float32 [B, T] in [0, 1]; 0 where the version is < 0.

    Raises:
        ValueError: ``updates_done < 0`` or ``updates_per_version < 1``.
    """
    if updates_done < 0 or updates_per_version < 1:
        raise ValueError(
            f"need updates_done >= 0 and updates_per_version >= 1, got {updates_done}, "
            f"{updates_per_version}"
        )
    gap = (proximal_version - token_versions.double()).clamp_min(0.0) * updates_per_version
    if updates_done == 0:
        alpha = torch.where(gap > 0, torch.ones_like(gap), torch.zeros_like(gap))
    else:
        alpha = gap / (gap + updates_done)
    return torch.where(token_versions >= 0, alpha, torch.zeros_like(alpha)).float()


def loglinear_proximal_logprobs(
    behavior_logprobs: Tensor, current_logprobs: Tensor, alpha: Tensor
) -> Tensor:
    """``log pi_prox ~ log pi_b + alpha (log pi_theta - log pi_b)`` (AReaL ``loglinear``).

    Args:
        behavior_logprobs: float [B, T]. current_logprobs: float [B, T] (detached inside:
            the approximation is a constant of the loss, like the recomputed proximal
            log-probs it replaces). alpha: float [B, T] in [0, 1]
            (:func:`loglinear_proximal_alpha`).

    Returns:
        float [B, T], detached, in the dtype of ``current_logprobs`` (at least float32).

    Raises:
        ValueError: mismatched shapes.

    Example: ``log pi_b = -1``, ``log pi_theta = -2``, alpha 0.5: ``-1.5``.
    """
    if not behavior_logprobs.shape == current_logprobs.shape == alpha.shape:
        raise ValueError("behavior_logprobs, current_logprobs and alpha must have one shape")
    dtype = torch.float64 if current_logprobs.dtype == torch.float64 else torch.float32
    behavior = behavior_logprobs.detach().to(dtype)
    current = current_logprobs.detach().to(dtype)
    return behavior + alpha.to(dtype) * (current - behavior)
