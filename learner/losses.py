"""Losses of the ST-PPO family as pure functions over tensors.

Source: Li et al., "ST-PPO: Stabilized Off-Policy Proximal Policy Optimization for Multi-Turn
Agents" (arXiv 2511.20718) and its revision (SO-PPO / SO-GRPO, "clipping-triggered
normalization"); the objectives are written out in ``docs/algorithms.md``, whose notation
is used here:

    logr_t  = logp_theta(y_t) - logp_old(y_t)                    token log-ratio
    log rho_k = (1/|T_k|) sum_{t in T_k} logr_t                  turn log-ratio (geometric mean)
    L_base  = -sum_t w_t min(ratio_t A_t, clip(ratio_t, 1-eps_low, 1+eps_high) A_t)
    Clip    = {t : (A_t > 0 and ratio_t > 1+eps_high) or (A_t < 0 and ratio_t < 1-eps_low)}
    C       = grad (sum_{t in Clip} w_t ratio_t A_t)              the clipping bias
    L       = s * L_base,  s = stop_grad(scale(||C||))

``ratio_t`` is ``r_t = exp(logr_t)`` (token level: PPO, S-PPO, GRPO) or ``rho_k`` of the turn
holding t (turn level: Turn-PPO, ST-PPO, SO-GRPO).

Stabilisers of spec section 6 (each off by default in these functions, so the objectives
above hold bit for bit; the run config chooses the defaults):

- token bound ``delta`` (turn ratios only): each token's log-ratio is bounded in the
  direction the turn's mean advantage pushes it before the turn mean (GMPO):
  ``logr_t <- min(logr_t, delta)`` where that advantage is > 0, ``max(logr_t, -delta)``
  where it is < 0. A bounded token carries no gradient, so one token cannot drift far
  inside an unclipped turn. Token ratios ignore it: the PPO clip already bounds them.
- dual clip ``c`` (Ye et al. 2020, verl ``clip_ratio_c``): for A_t < 0 the per-token loss is
  capped at ``-c A_t``, so a ratio above ``c`` carries no gradient; those tokens join Clip.
- behaviour weights ``b_t`` (decoupled PPO, AReaL): the ratio is taken against a proximal
  policy and ``b_t``, a correction of ``pi_prox / pi_behaviour`` (truncated or masked:
  :mod:`learner.corrections`), multiplies each token's weight:
  ``w_t <- w_t b_t`` in the loss and in C. ``w_t`` are the aggregation weights:
``m_t / N`` for ``token-mean`` and ``m_t / (n_i S)`` for ``seq-mean-token-mean`` (n_i masked
tokens of sequence i, S sequences). The same weights define the loss and the clipped-token
surrogate behind ||C||, so ``C`` is exactly the gradient the clip removes from the loss.

Turn ratios cost O(tokens): every masked token is mapped to a flat segment index
``i * T + turn_id`` (one segment per (sequence, turn), plus one sink segment for
non-policy tokens) and reduced with a single ``scatter_add``; no Python loop over turns or
sequences. The functions take scalars and tensors, never config objects; metrics are
computed under ``no_grad`` and returned as 0-dim tensors (no ``.item()``, so no host sync
beyond the input validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from learner.constants import DEFAULT_TAU, LOG_RATIO_CLAMP, LOW_VAR_KL_BOUND

RatioLevel = Literal["token", "turn", "sequence"]
SegmentGradient = Literal["mean", "token"]
PolicyObjective = Literal["clip", "cispo"]
TurnAdvantage = Literal["token", "turn_mean"]
NormalizeMode = Literal["triggered", "divide"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean"]
KLEstimator = Literal["k1", "k3", "low_var_kl"]

_RATIO_LEVELS = ("token", "turn", "sequence")
_SEGMENT_GRADIENTS = ("mean", "token")
_OBJECTIVES = ("clip", "cispo")
_TURN_ADVANTAGES = ("token", "turn_mean")
_NORMALIZE_MODES = ("triggered", "divide")
_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


# --------------------------------------------------------------------------- outputs


@dataclass
class PolicyLossOutput:
    """Result of :func:`compute_policy_loss`.

    Attributes:
        loss: 0-dim tensor, differentiable. ``clip_bias_scale * L_base`` (no KL, no entropy).
        metrics: detached 0-dim float tensors, keyed by the exported metric names:
            ``pg_loss`` (L_base, unscaled), ``clip_ratio`` (masked tokens in Clip / N),
            ``clip_ratio_high``, ``clip_ratio_low`` (the two sides of Clip),
            ``clip_ratio_turn`` (turns with at least one token in Clip / turns),
            ``approx_kl`` (k1: masked mean of logp_old - logp_theta, token level),
            ``clip_bias_norm`` (||C||), ``clip_bias_norm_sq`` (||C||^2, adds up across
            micro-batches that share one aggregation denominator), ``clip_bias_scale`` (s),
            ``ratio_mean``, ``ratio_max``, ``ratio_min`` (of the ratio used, over masked
            tokens), ``num_tokens`` (N), ``num_turns``.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass
class ValueLossOutput:
    """Result of :func:`compute_value_loss`.

    Attributes:
        loss: 0-dim tensor, differentiable w.r.t. ``values``.
        metrics: detached 0-dim tensors: ``value_loss``, ``value_clip_ratio`` (masked tokens
            where the clipped branch is the larger one), ``value_mean``, ``return_mean``.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass
class ImportanceRatios:
    """Per-token importance ratios, see :func:`importance_log_ratios`.

    Attributes:
        log_ratio: float [B, T]. ``logr_t`` (token level) or ``log rho_k`` broadcast to the
            tokens of turn k (turn level); 0 on unmasked tokens; clamped to
            +-``LOG_RATIO_CLAMP``. Differentiable w.r.t. the learner log-probs.
        token_log_ratio: float [B, T]. ``logr_t`` masked (0 off-mask), unclamped.
        segment_ids: int64 [B*T]. Flat (sequence, turn) segment of each token; the sink
            segment ``B*T`` holds every unmasked token.
        segment_sizes: float [B*T + 1]. Masked tokens per segment (|T_k|); sink entry 0.
        token_bounded: bool [B, T]. Masked tokens whose log-ratio the token bound replaced
            (they carry no gradient); all False without a bound.
        per_token_gradient: True when a segment ratio's gradient reaches each token as
            ``ratio * grad log pi(y_t)`` (``segment_gradient="token"``, GSPO-token) rather
            than through the segment mean.
    """

    log_ratio: Tensor
    token_log_ratio: Tensor
    segment_ids: Tensor
    segment_sizes: Tensor
    token_bounded: Tensor
    per_token_gradient: bool = False


# --------------------------------------------------------------------------- small helpers


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero (weighted by ``mask``).

    Args:
        x: float tensor, any shape.
        mask: same shape as ``x``; 0/1 (bool, int or float).
        dim: reduce over this dimension only; ``None`` reduces everything to a 0-dim tensor.

    Returns:
        ``sum(x * mask) / sum(mask)``; where ``sum(mask) == 0`` the denominator is clamped to
        1, so an empty selection gives 0 (not NaN). Callers that must not see an empty mask
        validate it first (as :func:`compute_policy_loss` does).

    Example: ``masked_mean(tensor([1., 2., 9.]), tensor([1, 1, 0]))`` is ``1.5``.
    """
    if x.shape != mask.shape:
        raise ValueError(f"masked_mean: x shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def _compute_dtype(logprobs: Tensor) -> torch.dtype:
    # bf16 log-ratios lose ~3 significant digits; do the ratio arithmetic in >= fp32.
    return torch.float64 if logprobs.dtype == torch.float64 else torch.float32


def _check_mode(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _check_policy_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    objective: PolicyObjective = "clip",
    check_values: bool = True,
) -> None:
    """Shape/dtype/option checks of the policy-loss inputs and, with ``check_values``, the
    checks that read their values (one host read); raises ValueError naming the problem."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = {
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "loss_mask": loss_mask,
        "turn_ids": turn_ids,
    }
    for name, tensor in named.items():
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != logprobs shape {tuple(logprobs.shape)}"
            )
    if turn_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"turn_ids must be int64 (or int32), got {turn_ids.dtype}")
    _check_mode("objective", objective, _OBJECTIVES)
    if objective == "clip" and not 0.0 < clip_eps_low < 1.0:
        raise ValueError(f"clip_eps_low must be in (0, 1), got {clip_eps_low}")
    if objective == "cispo" and not clip_eps_low > 0.0:
        raise ValueError(f"clip_eps_low must be > 0 (>= 1: no lower bound), got {clip_eps_low}")
    if clip_eps_high <= 0.0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if not check_values:
        return
    policy = loss_mask != 0
    seq_len = logprobs.shape[1]
    # One host sync for all value checks.
    no_tokens, untagged, too_large = torch.stack(
        [~policy.any(), (policy & (turn_ids < 0)).any(), (turn_ids >= seq_len).any()]
    ).tolist()
    if no_tokens:
        raise ValueError("loss_mask selects no token: the policy loss is undefined")
    if untagged:
        raise ValueError("turn_ids must be >= 0 on every token where loss_mask is 1")
    if too_large:
        raise ValueError(f"turn_ids must be < T = {seq_len} (one turn needs at least one token)")


# --------------------------------------------------------------------------- segments


def segment_ids_from_turns(turn_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """Flat (sequence, turn) segment index of every token.

    Args:
        turn_ids: int [B, T]. Turn index per token (0, 1, ...), -1 outside turns; < T.
        loss_mask: [B, T]. 1 on policy tokens.

    Returns:
        int64 [B*T]: ``i * T + turn_ids[i, t]`` on masked tokens, the sink ``B*T`` elsewhere.
        There are ``B*T + 1`` segments (an upper bound that needs no host sync).
    """
    batch, seq_len = turn_ids.shape
    row = torch.arange(batch, device=turn_ids.device).unsqueeze(1) * seq_len
    policy = (loss_mask != 0) & (turn_ids >= 0)
    seg = torch.where(policy, row + turn_ids.long(), torch.full_like(row, batch * seq_len))
    return seg.reshape(-1)


def segment_sum(values: Tensor, segment_ids: Tensor, num_segments: int) -> Tensor:
    """Sum of a flat tensor's entries per segment (one ``scatter_add``; differentiable).

    Args:
        values: float [M]. segment_ids: int64 [M], each in [0, num_segments).

    Returns:
        float [num_segments].
    """
    out = values.new_zeros(num_segments)
    return out.scatter_add(0, segment_ids, values)


def segment_broadcast_mean(
    values: Tensor, weights: Tensor, segment_ids: Tensor, num_segments: int
) -> Tensor:
    """Per-segment weighted mean ``sum(w x) / sum(w)`` broadcast back to every entry.

    Args:
        values, weights: float [B, T]. segment_ids: int64 [B*T].

    Returns:
        float [B, T]; entries of empty-weight segments get 0.
    """
    shape = values.shape
    sums = segment_sum((values * weights).reshape(-1), segment_ids, num_segments)
    sizes = segment_sum(weights.reshape(-1), segment_ids, num_segments)
    means = sums / sizes.clamp_min(1e-30)
    return means.gather(0, segment_ids).reshape(shape)


# --------------------------------------------------------------------------- ratios


def importance_log_ratios(
    logprobs: Tensor,
    old_logprobs: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    ratio_level: RatioLevel,
    token_log_ratio_bound: float | None = None,
    bound_direction: Tensor | None = None,
    segment_gradient: SegmentGradient = "mean",
) -> ImportanceRatios:
    """Token (``r_t``), turn-level (``rho_k``) or sequence-level (``s_i``) log ratios.

    Spec section 2: ``log rho_k = (1/|T_k|) sum_{t in T_k} logr_t``; the gradient flows
    through rho_k (no stop-gradient), so each token of the turn receives 1/|T_k| of it.
    ``"sequence"`` is the turn ratio with one turn per sequence (every policy token of a
    row in turn 0): GSPO's ``s_i = exp(mean_t logr_t)`` (Zheng et al. 2025, "Group Sequence
    Policy Optimization", arXiv 2507.18071, eq. 7).
    ``segment_gradient="token"`` is GSPO-token's form (eq. 13; verl
    ``compute_policy_loss_gspo``): ``log s_{i,t} = sg(log s_i) + logr_t - sg(logr_t)``, the
    same value with the gradient ``s_i grad log pi(y_t)`` at each token, so per-token
    advantages each weigh their own token. With one advantage per segment both forms give
    the same gradient.
    With ``token_log_ratio_bound = delta`` (spec section 6, GMPO) each token's log-ratio is
    first bounded in the direction of ``bound_direction``: ``min(logr_t, delta)`` where it
    is > 0, ``max(logr_t, -delta)`` where it is < 0, unchanged where it is 0.

    Args:
        logprobs: float [B, T]. Learner log-probs of the taken tokens (may require grad).
        old_logprobs: float [B, T]. Behaviour, proximal or recomputed log-probs; not
            differentiated.
        loss_mask: [B, T]. 1 on policy tokens.
        turn_ids: int [B, T]. Turn index, -1 outside turns.
        ratio_level: ``"token"``, ``"turn"`` or ``"sequence"``.
        token_log_ratio_bound: delta > 0 in nats, or ``None`` (no bound: today's ratios
            bit for bit).
        bound_direction: float [B, T], the advantage whose sign picks the bounded side
            (required with a bound).
        segment_gradient: ``"mean"`` (through the segment mean) or ``"token"``
            (GSPO-token); ignored at token level.

    Returns:
        :class:`ImportanceRatios`, in float32 (float64 if ``logprobs`` is float64). At
        sequence level ``segment_ids`` name sequences.

    Raises:
        ValueError: unknown level or gradient form, a bound that is not > 0, or a bound
            without a direction.
    """
    _check_mode("ratio_level", ratio_level, _RATIO_LEVELS)
    _check_mode("segment_gradient", segment_gradient, _SEGMENT_GRADIENTS)
    if ratio_level == "sequence":
        turn_ids = sequence_turn_ids(loss_mask)
    dtype = _compute_dtype(logprobs)
    mask = (loss_mask != 0).to(dtype)
    # where(), not multiplication: off-mask log-probs may be -inf or garbage.
    token_log_ratio = torch.where(
        mask > 0, logprobs.to(dtype) - old_logprobs.detach().to(dtype), torch.zeros_like(mask)
    )
    bounded_log_ratio, token_bounded = _bound_token_log_ratio(
        token_log_ratio, mask, token_log_ratio_bound, bound_direction
    )
    segment_ids = segment_ids_from_turns(turn_ids, loss_mask)
    num_segments = logprobs.numel() + 1
    segment_sizes = segment_sum(mask.reshape(-1), segment_ids, num_segments)
    per_token_gradient = ratio_level != "token" and segment_gradient == "token"
    if ratio_level == "token":
        log_ratio = bounded_log_ratio
    else:
        log_ratio = (
            segment_broadcast_mean(bounded_log_ratio, mask, segment_ids, num_segments) * mask
        )
        if per_token_gradient:
            log_ratio = log_ratio.detach() + (bounded_log_ratio - bounded_log_ratio.detach())
    return ImportanceRatios(
        log_ratio=log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
        token_log_ratio=token_log_ratio,
        segment_ids=segment_ids,
        segment_sizes=segment_sizes,
        token_bounded=token_bounded,
        per_token_gradient=per_token_gradient,
    )


def sequence_turn_ids(loss_mask: Tensor) -> Tensor:
    """Turn ids with one turn per sequence: 0 on every policy token, -1 elsewhere.

    Args:
        loss_mask: [B, T].

    Returns:
        int64 [B, T].
    """
    zeros = torch.zeros(loss_mask.shape, dtype=torch.int64, device=loss_mask.device)
    return torch.where(loss_mask != 0, zeros, zeros - 1)


def _bound_token_log_ratio(
    token_log_ratio: Tensor, mask: Tensor, bound: float | None, direction: Tensor | None
) -> tuple[Tensor, Tensor]:
    """(bounded log-ratio [B, T], bool [B, T] where the bound replaced it); see
    :func:`importance_log_ratios`. ``min``/``max`` against a constant pass no gradient to
    the replaced entries, which is the point."""
    if bound is None:
        return token_log_ratio, torch.zeros_like(mask, dtype=torch.bool)
    if not bound > 0.0:
        raise ValueError(f"token_log_ratio_bound must be > 0 (nats), got {bound}")
    if direction is None:
        raise ValueError("token_log_ratio_bound needs bound_direction (the advantages)")
    up = (direction > 0) & (mask > 0)
    down = (direction < 0) & (mask > 0)
    bounded = torch.where(up, token_log_ratio.clamp(max=bound), token_log_ratio)
    bounded = torch.where(down, bounded.clamp(min=-bound), bounded)
    replaced = (up & (token_log_ratio > bound)) | (down & (token_log_ratio < -bound))
    return bounded, replaced


def effective_advantages(
    advantages: Tensor, loss_mask: Tensor, segment_ids: Tensor, *, turn_advantage: TurnAdvantage
) -> Tensor:
    """Advantage that multiplies the ratio: per-token ``A_t`` or the turn's mean advantage.

    Args:
        advantages: float [B, T]. loss_mask: [B, T]. segment_ids: int64 [B*T] from
            :func:`segment_ids_from_turns`.
        turn_advantage: ``"token"`` (A_t, default) or ``"turn_mean"`` (mean of A over the
            turn's masked tokens, broadcast; RECONSTRUCTED option of the spec).

    Returns:
        float [B, T], detached, 0 off the mask.
    """
    _check_mode("turn_advantage", turn_advantage, _TURN_ADVANTAGES)
    mask = (loss_mask != 0).to(advantages.dtype)
    adv = torch.where(mask > 0, advantages.detach(), torch.zeros_like(mask))
    if turn_advantage == "token":
        return adv
    return segment_broadcast_mean(adv, mask, segment_ids, advantages.numel() + 1) * mask


def aggregation_weights(
    loss_mask: Tensor,
    *,
    loss_agg_mode: LossAggMode,
    agg_denominator: float | Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token weights ``w`` such that the aggregated loss is ``sum(w * per_token_loss)``.

    Args:
        loss_mask: [B, T]. 1 on policy tokens.
        loss_agg_mode: ``"token-mean"``: ``w_t = m_t / N`` (N = masked tokens);
            ``"seq-mean-token-mean"``: ``w_t = m_t / (n_i S)`` (n_i masked tokens of the
            token's sequence, S sequences with n_i > 0).
        agg_denominator: overrides N (token-mean) or S (seq-mean-token-mean), e.g. the
            mini-batch total when a mini-batch is split into micro-batches whose gradients
            are accumulated; ``None`` uses this batch's own count.
        dtype: float dtype of the result.

    Returns:
        float [B, T], no grad.
    """
    _check_mode("loss_agg_mode", loss_agg_mode, _LOSS_AGG_MODES)
    mask = (loss_mask != 0).to(dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum() if agg_denominator is None else agg_denominator
        return mask / _device_scalar(denom, dtype, mask.device).clamp_min(1.0)
    per_seq = mask.sum(dim=1, keepdim=True)
    if agg_denominator is None:
        agg_denominator = (per_seq > 0).sum()
    denom = _device_scalar(agg_denominator, dtype, mask.device).clamp_min(1.0)
    return mask / (per_seq.clamp_min(1.0) * denom)


def _device_scalar(value: Tensor | float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as a 0-dim ``dtype`` tensor on ``device``. A number is written by a fill
    kernel (``torch.full``), not copied from the host: ``torch.as_tensor(number,
    device=cuda)`` is a blocking host-to-device copy, which waits for the GPU's queue."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.full((), value, dtype=dtype, device=device)


@dataclass
class ClipSet:
    """The two sides of the Clip set, bool [B, T] each.

    Attributes:
        high: ``m & A > 0 & ratio > 1 + eps_high`` (the upper clip is active).
        low: ``m & A < 0 & ratio < 1 - eps_low`` (the lower clip is active).
        dual: ``m & A < 0 & ratio > clip_ratio_c`` (the dual clip is active); all False
            without a dual clip.
    """

    high: Tensor
    low: Tensor
    dual: Tensor

    def any_side(self) -> Tensor:
        """bool [B, T]: the whole Clip set (the three sides are disjoint)."""
        return self.high | self.low | self.dual


def clipped_token_mask(
    ratio: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    clip_ratio_c: float | None = None,
    objective: PolicyObjective = "clip",
) -> ClipSet:
    """Where the clipped branch of the PPO min (or the dual clip) is active: those tokens
    carry no gradient. With ``objective="cispo"``: where CISPO's weight is truncated (the
    ratio outside ``[1 - eps_low, 1 + eps_high]``, whatever the advantage's sign); those
    tokens keep a gradient, scaled by the bound.

    Args:
        ratio: float [B, T] (r_t or rho_k per token). advantages: float [B, T].
        loss_mask: [B, T]. clip_eps_low, clip_eps_high: the clip range.
        clip_ratio_c: dual-clip bound (> 1 + clip_eps_high) or ``None``.
        objective: ``"clip"`` (PPO) or ``"cispo"``.

    Returns:
        :class:`ClipSet`. With ``"clip"``, tokens with A = 0 are never clipped.
    """
    policy = loss_mask != 0
    if objective == "cispo":
        high = policy & (ratio > 1.0 + clip_eps_high)
        low = policy & (ratio < 1.0 - clip_eps_low)
        return ClipSet(high=high, low=low, dual=torch.zeros_like(high))
    high = policy & (advantages > 0) & (ratio > 1.0 + clip_eps_high)
    low = policy & (advantages < 0) & (ratio < 1.0 - clip_eps_low)
    if clip_ratio_c is None:
        dual = torch.zeros_like(high)
    else:
        dual = policy & (advantages < 0) & (ratio > clip_ratio_c)
    return ClipSet(high=high, low=low, dual=dual)


# --------------------------------------------------------------------------- clipping bias


def _clip_bias_logprob_grad_from_parts(
    ratios: ImportanceRatios,
    advantages: Tensor,
    clipped: Tensor,
    weights: Tensor,
    *,
    ratio_level: RatioLevel,
) -> Tensor:
    """Closed form of :func:`clip_bias_logprob_grad` from already computed parts.

    ``S = sum_{t in Clip} w_t ratio_t A_t``. Token level (and segment ratios with the
    GSPO-token gradient): ``dS/dlogp_t = w_t ratio_t A_t 1[t in Clip]``. Turn level (``d rho_k / d logp_s = rho_k / |T_k|`` for s in T_k):
    ``dS/dlogp_s = (sum_{t in T_k cap Clip} w_t rho_k A_t) / |T_k|``; with token-mean weights
    that is the spec's ``(1/N) rho_k (sum of A over clipped tokens of turn k) / |T_k|``.
    Tokens whose log ratio hit ``LOG_RATIO_CLAMP`` get no gradient (as with autograd).

    Args:
        ratios: from :func:`importance_log_ratios`. advantages: float [B, T], effective
            advantages. clipped: bool [B, T], the Clip set. weights: float [B, T].
        ratio_level: ``"token"`` or ``"turn"``.

    Returns:
        float [B, T], detached.
    """
    with torch.no_grad():
        log_ratio = ratios.log_ratio.detach()
        in_range = (log_ratio.abs() < LOG_RATIO_CLAMP).to(log_ratio.dtype)
        free = (~ratios.token_bounded).to(log_ratio.dtype)  # bounded tokens: no gradient
        per_token = weights * clipped.to(log_ratio.dtype) * torch.exp(log_ratio) * advantages
        per_token = per_token * in_range
        if ratio_level == "token" or ratios.per_token_gradient:
            return per_token * free
        num_segments = per_token.numel() + 1
        turn_sum = segment_sum(per_token.reshape(-1), ratios.segment_ids, num_segments)
        turn_grad = turn_sum / ratios.segment_sizes.clamp_min(1.0)
        mask = (ratios.segment_ids < per_token.numel()).to(per_token.dtype)
        grad = (turn_grad.gather(0, ratios.segment_ids) * mask).reshape(per_token.shape)
        return grad * free


def clip_bias_scale(
    clip_bias_norm: Tensor,
    any_clipped: Tensor,
    *,
    normalize_mode: NormalizeMode,
    tau: float = DEFAULT_TAU,
    delta: float = 1e-8,
) -> Tensor:
    """The clipping-bias scale ``s`` (a constant multiplier of the loss; never differentiated).

    ``triggered``: ``s = 1 / max(1, ||C|| / tau)`` (so s == 1 while ||C|| <= tau).
    ``divide``: ``s = 1 / (||C|| + delta)`` if some token is clipped, else 1.

    Choice of the default ``tau = 0.01`` (RECONSTRUCTED; the paper does not give one). Under
    the ``logprob`` norm with token-mean weights, ``||C|| = (1/N) sqrt(sum_{Clip} (ratio
    A)^2)``. With whitened (or group-normalised) advantages, E[A^2] ~ 1, and clipped ratios
    sit near ``1 + eps`` ~ 1.2, so for a clipped fraction c of N tokens
    ``||C|| ~ 1.2 sqrt(c N) / N = 1.2 sqrt(c / N)``. SmolLM2-scale mini-batches (4
    trajectories x 250-500 policy tokens, N ~ 1-2k) near on-policy clip c ~ 0.5-2% of tokens,
    giving ||C|| ~ 0.002-0.005: untouched (s = 1). tau = 0.01 triggers at c ~ 7% (N = 1k) to
    ~14% (N = 2k), the regime of stale batches where the clipped part of the gradient starts
    to dominate, and halves the step at 4x that fraction. Turn ratios average token noise
    within a turn (geometric mean), so they clip less and trigger less at the same tau.
    A simulation at these sizes (N = 1680, token log-ratio noise 0.1-0.4, whitened A) gave
    ||C|| = 0.008-0.017 at clip ratios of 4-30%, within 30% of the estimate. Because ||C||
    scales as 1/sqrt(N), a much larger mini-batch needs a smaller tau
    (tau ~ 0.3 / sqrt(N) keeps the trigger at c ~ 6%).

    Args:
        clip_bias_norm: 0-dim float tensor, ||C|| >= 0.
        any_clipped: 0-dim bool tensor, Clip non-empty (used by ``divide``).
        normalize_mode: ``"triggered"`` or ``"divide"``. tau: > 0. delta: > 0.

    Returns:
        0-dim float tensor in (0, 1] for ``triggered``; in (0, inf) for ``divide``.

    Raises:
        ValueError: unknown mode or non-positive tau/delta.
    """
    _check_mode("normalize_mode", normalize_mode, _NORMALIZE_MODES)
    if tau <= 0.0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if delta <= 0.0:
        raise ValueError(f"delta must be > 0, got {delta}")
    norm = clip_bias_norm.detach()
    if normalize_mode == "triggered":
        return 1.0 / torch.clamp(norm / tau, min=1.0)
    return torch.where(any_clipped, 1.0 / (norm + delta), torch.ones_like(norm))


# --------------------------------------------------------------------------- policy loss


@dataclass
class _SurrogateParts:
    ratios: ImportanceRatios
    ratio: Tensor
    advantages: Tensor
    weights: Tensor
    clip: ClipSet
    objective: PolicyObjective = "clip"

    def gradient_removed(self) -> Tensor:
        """bool [B, T]: tokens whose gradient the clip removes, the set behind C. CISPO
        truncates a weight but keeps every token's gradient: none."""
        if self.objective == "cispo":
            return torch.zeros_like(self.clip.high)
        return self.clip.any_side()


def _surrogate_parts(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    ratio_level: RatioLevel,
    clip_eps_low: float,
    clip_eps_high: float,
    turn_advantage: TurnAdvantage,
    loss_agg_mode: LossAggMode,
    agg_denominator: float | Tensor | None,
    token_log_ratio_bound: float | None,
    clip_ratio_c: float | None,
    behavior_weights: Tensor | None,
    segment_gradient: SegmentGradient,
    objective: PolicyObjective,
    check_values: bool,
) -> _SurrogateParts:
    _check_policy_inputs(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        turn_ids,
        clip_eps_low,
        clip_eps_high,
        objective,
        check_values,
    )
    if ratio_level == "sequence":
        turn_ids = sequence_turn_ids(loss_mask)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0 + clip_eps_high:
        raise ValueError(
            f"clip_ratio_c must be > 1 + clip_eps_high = {1.0 + clip_eps_high}, got {clip_ratio_c}"
        )
    if behavior_weights is not None and behavior_weights.shape != logprobs.shape:
        raise ValueError(
            f"behavior_weights shape {tuple(behavior_weights.shape)} != "
            f"logprobs shape {tuple(logprobs.shape)}"
        )
    dtype = _compute_dtype(logprobs)
    segment_ids = segment_ids_from_turns(turn_ids, loss_mask)
    adv = effective_advantages(
        advantages.to(dtype), loss_mask, segment_ids, turn_advantage=turn_advantage
    )
    direction = None
    if ratio_level == "token":
        # a token ratio is its own turn: the PPO clip (log 1.2 < any useful delta) bounds it
        token_log_ratio_bound = None
    elif token_log_ratio_bound is not None:
        # the sign that moves the turn's tokens: the turn's mean advantage
        direction = effective_advantages(adv, loss_mask, segment_ids, turn_advantage="turn_mean")
    ratios = importance_log_ratios(
        logprobs,
        old_logprobs,
        loss_mask,
        turn_ids,
        ratio_level=ratio_level,
        token_log_ratio_bound=token_log_ratio_bound,
        bound_direction=direction,
        segment_gradient=segment_gradient,
    )
    ratio = torch.exp(ratios.log_ratio)
    clip_set = clipped_token_mask(
        ratio.detach(),
        adv,
        loss_mask,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        clip_ratio_c=clip_ratio_c,
        objective=objective,
    )
    weights = aggregation_weights(
        loss_mask, loss_agg_mode=loss_agg_mode, agg_denominator=agg_denominator, dtype=dtype
    )
    if behavior_weights is not None:
        weights = weights * torch.where(
            loss_mask != 0, behavior_weights.detach().to(dtype), torch.zeros_like(weights)
        )
    return _SurrogateParts(ratios, ratio, adv, weights, clip_set, objective)


def clip_bias_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    ratio_level: RatioLevel,
    clip_eps_low: float,
    clip_eps_high: float,
    turn_advantage: TurnAdvantage = "token",
    loss_agg_mode: LossAggMode = "token-mean",
    agg_denominator: float | Tensor | None = None,
    token_log_ratio_bound: float | None = None,
    clip_ratio_c: float | None = None,
    behavior_weights: Tensor | None = None,
    segment_gradient: SegmentGradient = "mean",
    objective: PolicyObjective = "clip",
    check_values: bool = True,
) -> Tensor:
    """The clipped-token surrogate ``S = sum_{t in Clip} w_t ratio_t A_t`` (differentiable).

    Its gradient is the clipping bias C of spec section 2 (with token-mean weights,
    ``w_t = 1/N``; times ``b_t`` with behaviour weights). For ``bias_norm: param`` the
    trainer takes ``torch.autograd.grad(S, params)`` (one extra backward) and passes the
    norm to :func:`compute_policy_loss` as ``clip_bias_norm``; for ``bias_norm: logprob``
    the gradient w.r.t. a detached leaf copy of ``logprobs`` equals
    :func:`clip_bias_logprob_grad`. The Clip set (with the dual-clip side) is an indicator
    (not differentiated).

    Args: as :func:`compute_policy_loss` (same shapes, same clip and aggregation options).

    Returns:
        0-dim float tensor (float32, or float64 for float64 inputs).

    Raises:
        ValueError: as :func:`compute_policy_loss`.
    """
    parts = _surrogate_parts(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        turn_ids,
        ratio_level=ratio_level,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        turn_advantage=turn_advantage,
        loss_agg_mode=loss_agg_mode,
        agg_denominator=agg_denominator,
        token_log_ratio_bound=token_log_ratio_bound,
        clip_ratio_c=clip_ratio_c,
        behavior_weights=behavior_weights,
        segment_gradient=segment_gradient,
        objective=objective,
        check_values=check_values,
    )
    clipped = parts.gradient_removed().to(parts.ratio.dtype)
    return (parts.weights * clipped * parts.ratio * parts.advantages).sum()


def clip_bias_logprob_grad(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    ratio_level: RatioLevel,
    clip_eps_low: float,
    clip_eps_high: float,
    turn_advantage: TurnAdvantage = "token",
    loss_agg_mode: LossAggMode = "token-mean",
    agg_denominator: float | Tensor | None = None,
    token_log_ratio_bound: float | None = None,
    clip_ratio_c: float | None = None,
    behavior_weights: Tensor | None = None,
    segment_gradient: SegmentGradient = "mean",
    objective: PolicyObjective = "clip",
    check_values: bool = True,
) -> Tensor:
    """The clipping bias C under ``bias_norm: logprob``, per token, in closed form.

    Gradient of :func:`clip_bias_surrogate` w.r.t. the [B, T] token log-probs, without
    autograd: token level ``w_t r_t A_t`` on clipped tokens; turn level
    ``(sum_{t in T_k cap Clip} w_t rho_k A_t) / |T_k|`` on every masked token of turn k
    (spec section 2: ``(1/N) rho_k (sum of A over the clipped tokens of turn k) / |T_k|``);
    0 on tokens the token bound replaced. ``||C||`` is its L2 norm; squared norms of
    micro-batches sharing one ``agg_denominator`` add up to the mini-batch's.

    Args: as :func:`compute_policy_loss`.

    Returns:
        float [B, T], detached, 0 off the mask. Equals ``torch.autograd.grad`` of
        :func:`clip_bias_surrogate` w.r.t. a detached leaf copy of ``logprobs`` (tested).

    Raises:
        ValueError: as :func:`compute_policy_loss`.
    """
    parts = _surrogate_parts(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        turn_ids,
        ratio_level=ratio_level,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        turn_advantage=turn_advantage,
        loss_agg_mode=loss_agg_mode,
        agg_denominator=agg_denominator,
        token_log_ratio_bound=token_log_ratio_bound,
        clip_ratio_c=clip_ratio_c,
        behavior_weights=behavior_weights,
        segment_gradient=segment_gradient,
        objective=objective,
        check_values=check_values,
    )
    return _clip_bias_logprob_grad_from_parts(
        parts.ratios,
        parts.advantages,
        parts.gradient_removed(),
        parts.weights,
        ratio_level=ratio_level,
    )


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    turn_ids: Tensor,
    *,
    ratio_level: RatioLevel,
    clip_eps_low: float,
    clip_eps_high: float,
    turn_advantage: TurnAdvantage = "token",
    bias_correction: bool = False,
    normalize_mode: NormalizeMode = "triggered",
    tau: float = DEFAULT_TAU,
    delta: float = 1e-8,
    loss_agg_mode: LossAggMode = "token-mean",
    clip_bias_norm: Tensor | None = None,
    agg_denominator: float | Tensor | None = None,
    token_log_ratio_bound: float | None = None,
    clip_ratio_c: float | None = None,
    behavior_weights: Tensor | None = None,
    segment_gradient: SegmentGradient = "mean",
    objective: PolicyObjective = "clip",
    check_values: bool = True,
) -> PolicyLossOutput:
    """Clipped PPO surrogate (or CISPO) with token, turn or sequence ratios and the
    clipping-bias scale.

    Covers every variant (spec section 2 table): ``ratio_level="token"`` for ppo, s_ppo,
    grpo and cispo; ``"turn"`` for turn_ppo, st_ppo, so_grpo; ``"sequence"`` with
    ``segment_gradient="token"`` for gspo; ``bias_correction=True`` for s_ppo, st_ppo,
    so_grpo. ``||C||`` is always computed and logged (the paper's diagnostic); it scales the
    loss only with ``bias_correction``. The stabilisers of spec section 6 (token bound, dual
    clip, behaviour weights; module docstring) are off by default, and with them off the
    loss is bit-identical to the section 2 objective.

    ``objective="cispo"`` (Chen et al. 2025, "MiniMax-M1", arXiv 2506.13585, eq. 4; verl
    ``compute_policy_loss_cispo``): the per-token loss is
    ``-sg(clip(ratio_t, 1 - eps_low, 1 + eps_high)) A_t log pi_theta(y_t)``: the importance
    weight is truncated and detached, and every token keeps its gradient through its
    log-prob (``eps_low >= 1``: no lower bound, the paper's choice). Its value is not a PPO
    surrogate (it is positive for A > 0); its gradient is ``-w_t sg(clip(ratio_t)) A_t grad
    log pi``. No token loses its gradient, so ``C = 0``; ``clip_ratio`` counts the
    truncated weights. The dual clip does not apply to it.

    Args:
        logprobs: float [B, T]. Learner log-probs of the taken tokens (requires grad).
            bf16/fp16 inputs are upcast to float32 for the ratio arithmetic.
        old_logprobs: float [B, T]. The policy the ratio is taken against: behaviour
            log-probs, or the proximal policy's for decoupled PPO; detached inside.
        advantages: float [B, T]. Per-token advantages; detached inside.
        loss_mask: [B, T]. 1 on policy tokens, 0 on prompt/environment/padding. Values off
            the mask (in any input) are ignored, including inf/NaN log-probs.
        turn_ids: int64 [B, T]. Turn index per token (0..K-1 per sequence, < T), -1 outside
            turns; must be >= 0 wherever ``loss_mask`` is 1. Only masked tokens count
            towards a turn. Used for turn ratios, ``turn_mean`` advantages and
            ``clip_ratio_turn``.
        ratio_level: ``"token"`` (r_t) or ``"turn"`` (geometric mean rho_k per turn).
        clip_eps_low, clip_eps_high: asymmetric clip range [1 - eps_low, 1 + eps_high].
        turn_advantage: ``"token"`` (A_t) or ``"turn_mean"`` (turn-mean advantage).
        bias_correction: multiply the loss by s (S-PPO / ST-PPO / SO-GRPO).
        normalize_mode, tau, delta: see :func:`clip_bias_scale`.
        loss_agg_mode: ``"token-mean"`` or ``"seq-mean-token-mean"``.
        clip_bias_norm: precomputed ||C|| (0-dim), e.g. the norm over a whole optimizer
            step's micro-batches, or the parameter-space norm for ``bias_norm: param``;
            ``None`` computes this batch's ``logprob`` norm in closed form.
        agg_denominator: see :func:`aggregation_weights` (micro-batch accumulation).
        token_log_ratio_bound: delta (nats) of the token bound inside turns, or ``None``;
            ignored with ``ratio_level="token"``.
        clip_ratio_c: dual-clip bound (> 1 + clip_eps_high), or ``None``.
        behavior_weights: float [B, T] ``b_t`` (decoupled PPO, see
            :func:`learner.corrections.rollout_correction`), or ``None`` (all 1).
        segment_gradient: ``"mean"`` or ``"token"`` (GSPO-token), see
            :func:`importance_log_ratios`.
        objective: ``"clip"`` (PPO's clipped surrogate) or ``"cispo"``.
        check_values: ``False`` skips the checks that read the inputs' values (an empty
            ``loss_mask``, ``turn_ids`` out of range): they read back to the host, which on
            a GPU waits for every kernel queued before. For callers whose inputs hold them
            by construction: the learner's rows come from
            :func:`learner.batch.collate_trajectories`, which validates each trajectory and
            keeps only those with a policy token. Shapes, dtypes and options are always
            checked.

    Returns:
        :class:`PolicyLossOutput`: ``loss = s * L_base`` and detached metrics.

    Raises:
        ValueError: mismatched shapes, non-integer ``turn_ids``, an empty ``loss_mask``, a
            masked token with ``turn_ids < 0``, ``turn_ids >= T`` (these three only with
            ``check_values``), unknown modes, bad eps/tau/delta/bound/clip_ratio_c.

    Example (one token, A = 1, ratio e^0.1 inside the clip range):
        ``compute_policy_loss(tensor([[0.1]], requires_grad=True), tensor([[0.]]),
        tensor([[1.]]), tensor([[1]]), tensor([[0]]), ratio_level="token",
        clip_eps_low=0.2, clip_eps_high=0.2).loss`` is ``-exp(0.1) = -1.1052``.
    """
    parts = _surrogate_parts(
        logprobs,
        old_logprobs,
        advantages,
        loss_mask,
        turn_ids,
        ratio_level=ratio_level,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        turn_advantage=turn_advantage,
        loss_agg_mode=loss_agg_mode,
        agg_denominator=agg_denominator,
        token_log_ratio_bound=token_log_ratio_bound,
        clip_ratio_c=clip_ratio_c,
        behavior_weights=behavior_weights,
        segment_gradient=segment_gradient,
        objective=objective,
        check_values=check_values,
    )
    ratio, adv = parts.ratio, parts.advantages
    if objective == "cispo":
        per_token_loss = _cispo_token_loss(
            logprobs, ratio, adv, loss_mask, clip_eps_low, clip_eps_high
        )
    else:
        clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
        per_token_loss = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        if clip_ratio_c is not None:
            # dual clip (verl): for A < 0 the loss is capped at -c A, so ratio > c has no grad
            per_token_loss = torch.where(
                adv < 0, torch.minimum(per_token_loss, -adv * clip_ratio_c), per_token_loss
            )
    pg_loss = (parts.weights * per_token_loss).sum()

    clipped = parts.clip.any_side()
    if clip_bias_norm is None:
        grad = _clip_bias_logprob_grad_from_parts(
            parts.ratios, adv, parts.gradient_removed(), parts.weights, ratio_level=ratio_level
        )
        norm_sq = grad.square().sum()
        norm = norm_sq.sqrt()
    else:
        norm = torch.as_tensor(clip_bias_norm).detach().to(pg_loss.dtype).reshape(())
        norm_sq = norm.square()
    if bias_correction:
        scale = clip_bias_scale(
            norm, clipped.any(), normalize_mode=normalize_mode, tau=tau, delta=delta
        )
    else:
        scale = torch.ones_like(norm)
    loss = scale * pg_loss
    metrics = _policy_metrics(parts, clipped, pg_loss, norm, norm_sq, scale)
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _cispo_token_loss(
    logprobs: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> Tensor:
    """CISPO's per-token loss ``-sg(clip(ratio, 1 - eps_low, 1 + eps_high)) A log pi`` [B, T],
    0 off the mask (where log-probs may be -inf)."""
    low = max(1.0 - clip_eps_low, 0.0)
    weight = torch.clamp(ratio.detach(), low, 1.0 + clip_eps_high)
    logp = logprobs.to(ratio.dtype)
    logp = torch.where(loss_mask != 0, logp, torch.zeros_like(logp))
    return -weight * advantages * logp


def _policy_metrics(
    parts: _SurrogateParts,
    clipped: Tensor,
    pg_loss: Tensor,
    norm: Tensor,
    norm_sq: Tensor,
    scale: Tensor,
) -> dict[str, Tensor]:
    with torch.no_grad():
        ratios = parts.ratios
        mask = ratios.segment_ids.reshape(clipped.shape) < clipped.numel()
        maskf = mask.to(pg_loss.dtype)
        ratio = parts.ratio.detach()
        num_segments = clipped.numel() + 1
        clipped_per_turn = segment_sum(
            clipped.to(pg_loss.dtype).reshape(-1), ratios.segment_ids, num_segments
        )
        turns = ratios.segment_sizes[:-1] > 0
        num_turns = turns.sum().to(pg_loss.dtype)
        clipped_turns = (clipped_per_turn[:-1] > 0).sum().to(pg_loss.dtype)
        token_log_ratio = ratios.token_log_ratio.detach()
        return {
            "pg_loss": pg_loss.detach(),
            "clip_ratio": masked_mean(clipped.to(pg_loss.dtype), maskf),
            "clip_ratio_high": masked_mean(parts.clip.high.to(pg_loss.dtype), maskf),
            "clip_ratio_low": masked_mean(parts.clip.low.to(pg_loss.dtype), maskf),
            "clip_ratio_dual": masked_mean(parts.clip.dual.to(pg_loss.dtype), maskf),
            "clip_ratio_turn": clipped_turns / num_turns.clamp_min(1.0),
            "token_bound_ratio": masked_mean(ratios.token_bounded.to(pg_loss.dtype), maskf),
            "approx_kl": masked_mean(-token_log_ratio, maskf),
            "token_log_ratio_abs_max": torch.where(
                mask, token_log_ratio.abs(), torch.zeros_like(token_log_ratio)
            ).max(),
            "clip_bias_norm": norm.detach(),
            "clip_bias_norm_sq": norm_sq.detach(),
            "clip_bias_scale": scale.detach(),
            "ratio_mean": masked_mean(ratio, maskf),
            "ratio_max": torch.where(mask, ratio, torch.full_like(ratio, -torch.inf)).max(),
            "ratio_min": torch.where(mask, ratio, torch.full_like(ratio, torch.inf)).min(),
            "num_tokens": maskf.sum(),
            "num_turns": num_turns,
        }


# --------------------------------------------------------------------------- value, KL, entropy


def compute_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    *,
    value_clip: float,
    loss_agg_mode: LossAggMode = "token-mean",
    agg_denominator: float | Tensor | None = None,
) -> ValueLossOutput:
    """Clipped value loss (PPO2 / Search-R1 recipe).

    ``v_clip = old + clamp(v - old, -value_clip, value_clip)``;
    per token ``0.5 * max((v - R)^2, (v_clip - R)^2)``, aggregated like the policy loss.

    Args:
        values: float [B, T]. Critic values (requires grad).
        old_values: float [B, T]. Values at rollout/recompute time (detached inside).
        returns: float [B, T]. GAE returns (detached inside).
        loss_mask: [B, T]. 1 on policy tokens.
        value_clip: > 0, clip range around ``old_values`` (spec: 0.5).
        loss_agg_mode, agg_denominator: see :func:`aggregation_weights`.

    Returns:
        :class:`ValueLossOutput`.

    Raises:
        ValueError: mismatched shapes or ``value_clip <= 0``.
    """
    for name, tensor in {
        "old_values": old_values,
        "returns": returns,
        "loss_mask": loss_mask,
    }.items():
        if tensor.shape != values.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != values shape {tuple(values.shape)}"
            )
    if value_clip <= 0.0:
        raise ValueError(f"value_clip must be > 0, got {value_clip}")
    dtype = _compute_dtype(values)
    v = values.to(dtype)
    old = old_values.detach().to(dtype)
    ret = returns.detach().to(dtype)
    v_clipped = old + torch.clamp(v - old, -value_clip, value_clip)
    loss_unclipped = (v - ret).square()
    loss_clipped = (v_clipped - ret).square()
    per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    per_token = torch.where(loss_mask != 0, per_token, torch.zeros_like(per_token))
    weights = aggregation_weights(
        loss_mask, loss_agg_mode=loss_agg_mode, agg_denominator=agg_denominator, dtype=dtype
    )
    loss = (weights * per_token).sum()
    with torch.no_grad():
        maskf = (loss_mask != 0).to(dtype)
        metrics = {
            "value_loss": loss.detach(),
            "value_clip_ratio": masked_mean((loss_clipped > loss_unclipped).to(dtype), maskf),
            "value_mean": masked_mean(v.detach(), maskf),
            "return_mean": masked_mean(ret, maskf),
        }
    return ValueLossOutput(loss=loss, metrics=metrics)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate on sampled tokens (Schulman, "Approximating
    KL divergence", 2020).

    ``k1 = logp - logp_ref``; ``k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1`` (>= 0,
    unbiased; the log-ratio is clamped to +-``LOG_RATIO_CLAMP`` before ``exp``, so one
    token 12 nats away gives 1.6e5); ``low_var_kl`` is k3 clamped to
    [-``LOW_VAR_KL_BOUND``, ``LOW_VAR_KL_BOUND``] (verl's ``low_var_kl``): bounded, so no
    single token can outweigh every reward of a batch (spec section 6).

    Args:
        logprobs: float [B, T]. Policy log-probs (may require grad: KL as a loss).
        ref_logprobs: float [B, T]. Frozen reference log-probs (detached inside).
        estimator: ``"k1"``, ``"k3"`` or ``"low_var_kl"``.

    Returns:
        float [B, T] (unmasked; mask with ``masked_mean``).

    Raises:
        ValueError: mismatched shapes or unknown estimator.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != "
            f"logprobs shape {tuple(logprobs.shape)}"
        )
    _check_mode("estimator", estimator, ("k1", "k3", "low_var_kl"))
    log_ratio = logprobs - ref_logprobs.detach()
    if estimator == "k1":
        return log_ratio
    ref_minus = torch.clamp(-log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(ref_minus) - ref_minus - 1.0
    if estimator == "k3":
        return k3
    return torch.clamp(k3, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution given by logits, per position.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

    Args:
        logits: float [B, T, V].

    Returns:
        float [B, T] in nats (dtype of the logits, at least float32).

    Raises:
        ValueError: if ``logits`` is not 3-D.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    z = logits.to(_compute_dtype(logits))
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
