"""Variable-length attention over packed trajectories, registered as a transformers attention.

The packed layout of :mod:`learner.packing` gives each forward a few rows holding several
trajectories each. With transformers' ``sdpa`` attention the trajectories are kept apart by
a dense block-diagonal causal mask built from the positions: every row computes W x W
attention scores (W the row's width) whatever its trajectories' lengths, and the masked
kernels cannot skip the masked blocks. In the 1.7B benchmark batch on an H200 attention
took 0.13 of the packed step's CUDA time.

Variable-length attention (FlashAttention's ``varlen`` interface; Dao, 2023,
"FlashAttention-2", section 3.1 and its ``flash_attn_varlen_func``) instead takes all the
micro-batch's tokens as one sequence of T tokens with the cumulative lengths of its
trajectories, ``cu_seq_lens = [0, n_0, n_0 + n_1, ..., T]``, and computes each
trajectory's causal attention alone: ``sum(n_i^2) / 2`` scores instead of ``rows * W^2``,
no mask in memory. This is what verl and OpenRLHF do with ``flash_attn`` installed
(``use_remove_padding``, ``packing_samples``); here the kernel is torch's own
(``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2 in torch since 2.10), so
nothing more is installed.

:data:`VARLEN` is registered with transformers' ``AttentionInterface`` (and its mask
interface) under the name ``"stppo_varlen"``; :func:`set_varlen_attention` switches a
model to it and back. A forward that passes ``cu_seq_lens_q`` (and ``max_length_q``: the
keyword arguments transformers' own flash-attention path takes; :class:`ModelInputs` of
the varlen layout passes them) runs :func:`varlen_attention_forward`; any other forward
(padded with a mask, or one plain sequence) runs transformers' ``sdpa`` attention with the
usual mask, so a model switched to varlen stays correct on the padded paths the learner
keeps (the full-vocabulary log-probs, ``bias_norm = "param"``).

Where torch has no CUDA varlen kernel (the CPU, a CPU-only build, a torch older than
2.10, float32: FlashAttention computes in 16 bits), each trajectory's causal attention is computed by ``scaled_dot_product_attention``
in a loop over the segments: the same result to rounding (the CPU twin the unit tests
check against the padded layout, losses within 1e-5 in float32).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN = "stppo_varlen"
"""The attention implementation name this module registers with transformers."""

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _resolve_varlen_kernel() -> Callable[..., Tensor] | None:
    """torch's FlashAttention varlen function as ``f(q, k, v, cu, max_len, scale) -> out``
    ([T, H, D] each, causal), or None where this torch has none.

    torch 2.10 and 2.11 take ``is_causal=True``; later versions ``window_size=(-1, 0)``
    (the signature is read once, at import). Grouped-query attention: the key and value
    heads are repeated to the query heads before the call where the kernel takes no
    ``enable_gqa``.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:  # a signature this module does not know: no kernel rather than a wrong mask
        return None
    gqa = "enable_gqa" in params

    def kernel(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale) -> Tensor:
        if k.shape[1] != q.shape[1]:
            if gqa:
                return varlen_attn(
                    q, k, v, cu, cu, max_len, max_len, scale=scale, enable_gqa=True, **causal
                )
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)

    return kernel


_VARLEN_KERNEL = _resolve_varlen_kernel()  # a module global: compiled attention reads it


def varlen_kernel() -> Callable[..., Tensor] | None:
    """The varlen kernel (:func:`_resolve_varlen_kernel`), None where torch has none."""
    return _VARLEN_KERNEL


def uses_varlen_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether varlen attention on ``device`` in ``dtype`` runs torch's FlashAttention
    kernel (CUDA, 16-bit, a torch that has it) rather than :func:`segment_attention`."""
    return device.type == "cuda" and dtype in _KERNEL_DTYPES and _VARLEN_KERNEL is not None


def segment_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale) -> Tensor:
    """Causal attention of each segment alone, one ``scaled_dot_product_attention`` per
    segment: the CPU twin of the varlen kernel.

    Args:
        q: [T, H, D] queries of all segments one after the other; k, v: [T, H_kv, D]
            (H a multiple of H_kv).
        cu: int [S + 1] cumulative segment lengths, 0 first and T last.
        scale: the softmax scale (None: 1 / sqrt(D)).

    Returns:
        [T, H, D].
    """
    bounds = cu.tolist()
    gqa = k.shape[1] != q.shape[1]
    outputs = []
    for start, end in itertools.pairwise(bounds):
        # [1, H, n, D] per segment
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function: varlen over ``cu_seq_lens_q`` when given, else
    transformers' ``sdpa`` attention (module docstring).

    Args:
        module: the attention module (transformers passes itself).
        query: [B, H, L, D]; key, value: [B, H_kv, L, D]. With ``cu_seq_lens_q`` the B rows
            are read as one sequence of B * L tokens (the varlen layout has B = 1).
        attention_mask: the mask transformers built or was given (the varlen layout's is
            empty, :class:`learner.packing.ModelInputs`, and not read).
        dropout: must be 0 with ``cu_seq_lens_q`` (training here uses none).
        scaling: the softmax scale.
        kwargs: ``cu_seq_lens_q`` (int32 [S + 1], cumulative segment lengths over the B * L
            tokens, 0 first and B * L last: not checked, which would wait for the GPU) and
            ``max_length_q`` (int, the longest segment), or neither.

    Returns:
        ``(output [B, L, H, D], None)``, as transformers' attention functions return.

    Raises:
        ValueError: ``cu_seq_lens_q`` with dropout.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(f"varlen attention has no dropout (got {dropout})")
    rows, heads, width, head_dim = query.shape
    # [B, H, L, D] -> [B * L, H, D]: the rows one after the other
    q, k, v = (
        x.transpose(1, 2).reshape(rows * width, x.shape[1], head_dim) for x in (query, key, value)
    )
    # FlashAttention computes in 16 bits only: float32 takes the per-segment loop
    if uses_varlen_kernel(q.device, q.dtype):  # (max_length_q as given: symbolic when compiled)
        out = _VARLEN_KERNEL(q, k, v, cu, kwargs["max_length_q"], scaling)
    else:
        out = segment_attention(q, k, v, cu, scaling)
    return out.reshape(rows, width, heads, head_dim), None


@cache
def register() -> str:
    """Register :data:`VARLEN` with transformers' attention and mask interfaces (once);
    returns the name."""
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    # the masks of the forwards that fall back to sdpa; the varlen layout passes a prepared
    # (empty) 4D mask, which transformers neither builds nor checks
    AttentionMaskInterface.register(VARLEN, sdpa_mask)
    return VARLEN


def set_varlen_attention(models: list[nn.Module], enabled: bool, default: str = "sdpa") -> None:
    """Switch the HF models in ``models`` (and their HF submodels, e.g. a critic's backbone)
    to :data:`VARLEN` (True) or to ``default`` (False); idempotent.

    Raises:
        ValueError: a model holding no HF model.
    """
    name = register() if enabled else default
    for model in models:
        hf = [m for m in model.modules() if hasattr(m, "set_attn_implementation")]
        if not hf:
            raise ValueError(f"{type(model).__name__} holds no HF model to set attention on")
        for sub in hf:
            if sub.config._attn_implementation != name:
                sub.set_attn_implementation(name)
