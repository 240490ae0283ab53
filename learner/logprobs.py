"""Token log-probs and entropy through the LM head in chunks of tokens, never [N x V] at once.

The full-vocabulary path (:func:`learner.modeling.response_logits` then
:func:`learner.modeling.token_logprobs`) materialises the logits of every response column
([B, T, V] in the model's dtype, then again in float32, then softmax-sized temporaries for
the log-sum-exp and the entropy), and keeps them for backward. Here the policy's last hidden
states at the positions that predict the wanted tokens (the policy tokens only: everything
the learner does with log-probs is masked by ``loss_mask``) go through the LM head
``chunk_tokens`` rows at a time: each chunk's float32 logits live only inside that chunk,
forward keeps only the hidden states and one log-sum-exp per token, and backward recomputes
each chunk's logits (one extra LM-head matmul) to form the gradient.

Per token, with z = (h W^T + b) / temperature, lse = logsumexp(z), p = softmax(z)::

    logprob = z[y] - lse                 d logprob / dz = onehot(y) - p
    entropy = lse - sum_v p_v z_v        d entropy / dz = -p * (z - lse + entropy)

The same formulas as the full path, in the same float32, so the two agree to rounding
(``tests/unit/learner/test_chunked_logprobs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from learner.batch import TrainingBatch
from learner.losses import entropy_from_logits
from learner.modeling import response_logits, token_logprobs
from learner.packing import model_inputs

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""HF config fields of models whose logits are not just ``lm_head(hidden)``: those keep the
full path."""


def _chunk_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float
) -> Tensor:
    """float32 [C, V] logits of one chunk of hidden states [C, H] (model dtype matmul)."""
    z = nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        z = z / temperature
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    """Autograd function behind :func:`chunked_logprobs` (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temperature: float,
        chunk_tokens: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        num = hidden.shape[0]
        logprobs = torch.empty(num, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_zeros(0)
        for start in range(0, num, chunk_tokens):
            stop = min(start + chunk_tokens, num)
            z = _chunk_logits(hidden[start:stop], weight, bias, temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[start:stop] = chunk_lse
            picked = z.gather(1, labels[start:stop].unsqueeze(1)).squeeze(1)
            logprobs[start:stop] = picked - chunk_lse
            if with_entropy:
                probs = (z - chunk_lse.unsqueeze(1)).exp_()
                entropy[start:stop] = chunk_lse - probs.mul_(z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = (
            temperature,
            chunk_tokens,
            with_entropy,
        )
        ctx.set_materialize_grads(False)  # an unused entropy gets None, not a zero tensor
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None) -> tuple:
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        if not ctx.with_entropy:
            grad_entropy = None
        num = hidden.shape[0]
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        # the weight gradient sums over chunks: accumulate it in float32
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need_weight
            else None
        )
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if need_bias and bias is not None
            else None
        )
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        for start in range(0, num, chunk_tokens):
            stop = min(start + chunk_tokens, num)
            h = hidden[start:stop]
            z = _chunk_logits(h, weight, bias, temperature)
            chunk_lse = lse[start:stop].unsqueeze(1)
            g_lp = grad_logprobs[start:stop].unsqueeze(1)
            probs = (z - chunk_lse).exp_()
            if grad_entropy is not None:
                # d/dz = g_lp * (onehot - p) - g_H * p * (z - lse + H)
                g_h = grad_entropy[start:stop].unsqueeze(1)
                shift = chunk_lse - entropy[start:stop].unsqueeze(1)
                grad_z = z.sub_(shift).mul_(g_h).add_(g_lp).mul_(probs).neg_()
            else:
                grad_z = probs.mul_(g_lp).neg_()
            grad_z.scatter_add_(1, labels[start:stop].unsqueeze(1), g_lp)
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_logits = grad_z.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight
            if grad_weight is not None:
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight += grad_logits.t() @ h
            if grad_bias is not None:
                grad_bias += grad_z.sum(dim=0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each label (and the entropy) under ``softmax((h W^T + b) / T)``.

    Float32 logits exist for one chunk of ``chunk_tokens`` rows at a time, in forward and in
    backward (which recomputes them); differentiable in ``hidden``, ``weight`` and ``bias``.

    Args:
        hidden: [N, H] last hidden states (model dtype), one row per predicted token.
        weight: [V, H] LM-head weight (same dtype); ``bias``: [V] or None.
        labels: int64 [N], values in [0, V).
        temperature: > 0; logits are divided by it (the sampling temperature).
        chunk_tokens: rows per chunk (>= 1): peak extra memory ~ 3 x chunk_tokens x V x 4 B.
        with_entropy: also return the entropy (one more pass over each chunk; its gradient
            is computed only when it is used).

    Returns:
        (logprobs float32 [N] (natural log, <= 0), entropy float32 [N] in nats, or None).

    Raises:
        ValueError: ``chunk_tokens < 1``, ``temperature <= 0``, or shapes that disagree.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [N={hidden.shape[0]}], got {tuple(labels.shape)}")
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden, weight, bias, labels, float(temperature), int(chunk_tokens), bool(with_entropy)
    )
    return logprobs, entropy if with_entropy else None


@dataclass
class TokenStats:
    """Per-token outputs of a policy forward on a batch.

    Attributes:
        logprobs: float32 [B, T]; 0 where ``mask`` is 0 (chunked path) or the full-path
            value there.
        entropy: float32 [B, T] in nats, or None when not asked for.
    """

    logprobs: Tensor
    entropy: Tensor | None


def lm_head_of(model: nn.Module) -> nn.Linear | None:
    """The LM head of an HF causal LM (or a DeepSpeed engine around one) when the chunked
    path can replace it: a plain ``nn.Linear`` whose logits are not transformed afterwards
    (no soft-capping or scaling in the config) and whose parameters are not ZeRO-3
    partitions (those exist only inside the engine's forward). None otherwise."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    get_head = getattr(module, "get_output_embeddings", None)
    if config is None or get_head is None:
        return None
    if any(getattr(config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    head = get_head()
    if not isinstance(head, nn.Linear):
        return None
    if any(hasattr(p, "ds_id") for p in head.parameters()):
        return None
    return head


def masked_token_stats(
    model: nn.Module,
    batch: TrainingBatch,
    positions: tuple[Tensor, Tensor],
    head: nn.Linear,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    with_entropy: bool = False,
    packed: bool = False,
    varlen: bool = False,
) -> TokenStats:
    """Log-probs (and entropy) of the response tokens at ``positions``, chunked.

    One forward of ``model`` (the engine, so DeepSpeed's hooks run) with
    ``output_hidden_states`` and no LM-head column (``logits_to_keep`` = an empty index),
    then :func:`chunked_logprobs` on the last hidden states at the columns that predict the
    wanted response tokens t (``P - 1 + t`` padded; packed: :mod:`learner.packing`).

    Args:
        model: an HF causal LM or a DeepSpeed engine wrapping one; ``head`` its LM head
            (:func:`lm_head_of`).
        batch: the collated micro-batch (prompt width P, response width T), on the model's
            device.
        positions: ``(rows, columns)``, int64 [N] each: the [B, T] entries wanted, e.g.
            the policy tokens (:meth:`TrainingBatch.policy_token_positions`, found on the
            host: a ``nonzero`` here would make the host wait for the forward).
        temperature, chunk_tokens, with_entropy: as in :func:`chunked_logprobs`.
        packed: run the forward on the trajectories packed without padding
            (:func:`learner.packing.packed_inputs`) instead of the padded batch; the values
            agree to rounding.
        varlen: with ``packed``, the varlen layout (every trajectory in one row, kept apart
            by the varlen attention of :mod:`learner.attention`, to which ``model`` must be
            switched: :func:`learner.attention.set_varlen_attention`).

    Returns:
        :class:`TokenStats` with [B, T] tensors, zero off ``positions``.
    """
    inputs = model_inputs(batch, packed, varlen)
    out = model(
        **inputs.forward_kwargs(),
        logits_to_keep=torch.empty(0, dtype=torch.long, device=batch.input_ids.device),
        output_hidden_states=True,
        use_cache=False,
    )
    rows, cols = positions
    hidden = inputs.states(out.hidden_states[-1], inputs.state_index[rows, cols])
    labels = batch.response_ids[rows, cols]
    logprobs, entropy = chunked_logprobs(
        hidden,
        head.weight,
        labels,
        bias=head.bias,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
    )
    shape = batch.response_ids.shape

    def scattered(values: Tensor) -> Tensor:
        return values.new_zeros(shape).index_put((rows, cols), values)

    return TokenStats(scattered(logprobs), scattered(entropy) if entropy is not None else None)


def token_stats(
    engine: Any,
    micro: TrainingBatch,
    *,
    chunk_tokens: int,
    temperature: float,
    packed: bool,
    varlen: bool,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> TokenStats:
    """Per-token log-probs (and entropy) of ``micro``'s response under ``engine``.

    Chunked through the LM head on the policy tokens only (:func:`masked_token_stats`;
    values off ``loss_mask`` are 0) when ``chunk_tokens > 0`` and the model allows it
    (:func:`lm_head_of`), else the full-vocabulary logits (values everywhere; the entropy
    differentiable only with ``entropy_grad``). Both are differentiable in the policy where
    grad is enabled. ``packed``, ``varlen``: the layout (:func:`masked_token_stats`); the
    full-vocabulary path runs the padded batch.

    Returns:
        :class:`TokenStats` with float32 [B, T] tensors (entropy None without
        ``with_entropy``).
    """
    head = lm_head_of(engine) if chunk_tokens > 0 else None
    if head is not None:
        return masked_token_stats(
            engine, micro, micro.policy_token_positions(), head, temperature=temperature,
            chunk_tokens=chunk_tokens, with_entropy=with_entropy, packed=packed, varlen=varlen,
        )  # fmt: skip
    logits = response_logits(engine, micro, temperature)
    logprobs = token_logprobs(logits, micro.response_ids)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad):
            entropy = entropy_from_logits(logits)
    return TokenStats(logprobs, entropy)
