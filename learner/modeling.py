"""Model-side pieces of the learner: the critic and per-token log-probs of a causal LM.

The critic is a value head (``nn.Linear(hidden, 1)``) on a copy of the policy backbone
(Search-R1's PPO recipe, spec section 3). Both the policy and the critic are evaluated on a
:class:`learner.batch.TrainingBatch`, whose layout puts the response after a left-padded
prompt of common width P, so the positions that predict the T response tokens are the
contiguous columns ``P-1 .. P+T-2`` and only those go through the LM head / value head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from learner.batch import TrainingBatch


class ValueModel(nn.Module):
    """Critic: transformer backbone + scalar value head.

    ``forward`` returns V(s_t) for every response token t, where s_t is the prefix *before*
    token t (the state in which the policy chose token t), i.e. the hidden state at the
    column that predicts token t.

    Args:
        backbone: an HF base model (``AutoModel``, e.g. ``LlamaModel``) returning
            ``last_hidden_state`` [B, L, H].
        hidden_size: H.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, model_path: str | Path, dtype: torch.dtype) -> ValueModel:
        """Backbone weights from an HF folder (the policy's), zero-initialised value head
        (every value starts at 0, so the first GAE advantages equal the returns)."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(model_path, dtype=dtype)
        model = cls(backbone, int(backbone.config.hidden_size))
        return model.to(dtype)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute backbone activations in backward (HF gradient checkpointing)."""
        self.backbone.gradient_checkpointing_enable()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor,
        state_index: Tensor,
        **attention_kwargs: Any,
    ) -> Tensor:
        """Values of the states in which the policy chose each response token.

        Args:
            input_ids, attention_mask, position_ids: a micro-batch's forward inputs, padded
                or packed (:class:`learner.packing.ModelInputs`; int64 [R, W], the mask a
                prepared 4D one when packed).
            state_index: int64 [B, T], ``ModelInputs.state_index``: the flat column of each
                response token's state among the R * W outputs.
            attention_kwargs: passed to the backbone's attention (the varlen layout's
                segments, ``ModelInputs.forward_kwargs``).

        Returns:
            float32 [B, T]: ``values[b, t]`` = V(prefix before response token t).
        """
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,  # with a cache, transformers ignores packed positions
            **attention_kwargs,
        ).last_hidden_state
        states = hidden.reshape(-1, hidden.shape[-1])[state_index]
        return self.value_head(states).squeeze(-1).float()


def response_logits(model: nn.Module, batch: TrainingBatch, temperature: float = 1.0) -> Tensor:
    """Logits predicting each response token: [B, T, V], in the model's dtype at temperature
    1 and in float32 otherwise.

    Runs the causal LM once with ``logits_to_keep = T + 1`` (only the response region goes
    through the LM head) and drops the last column, which predicts past the end. The division
    by the temperature is done in float32, as the engines and the chunked path
    (:mod:`learner.logprobs`) do: dividing bf16 logits in bf16 rounds them again, a mean
    log-prob gap of 0.026 against the engine's on CUDA in bf16 (1e-6 in float32).

    Args:
        model: an HF causal LM (or a DeepSpeed engine wrapping one).
        batch: the collated batch (prompt width P, response width T).
        temperature: the sampling temperature the behaviour policy used (> 0); logits are
            divided by it so learner log-probs match the engine's.

    Raises:
        ValueError: if ``temperature <= 0``.
    """
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    num_response = batch.response_ids.shape[1]
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=num_response + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1, :]
    if temperature != 1.0:
        logits = logits.float() / temperature
    return logits


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under its logits, in float32.

    Args:
        logits: float [B, T, V].
        labels: int64 [B, T], values in [0, V).

    Returns:
        float32 [B, T]: ``log softmax(logits)[b, t, labels[b, t]]`` (natural log, <= 0).
    """
    logits32 = logits.float()
    picked = torch.gather(logits32, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits32, dim=-1)


COMPILE_BACKEND = "inductor"
"""The ``torch.compile`` backend of :class:`LayerCompiler` (TorchInductor: Triton kernels on
CUDA, C++ on CPU). The CPU tests swap in ``aot_eager``, which traces the same graphs and
runs them with eager kernels (inductor's C++ build takes minutes on 2 cores)."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an HF model (or of a model holding one, e.g. the critic or a
    DeepSpeed engine): every submodule whose class is named in an HF model's
    ``_no_split_modules`` (``LlamaDecoderLayer`` for the SmolLM2 and Llama families).

    Raises:
        ValueError: ``model`` holds no HF model or no such block.
    """
    names = {
        name
        for module in model.modules()
        for name in (getattr(module, "_no_split_modules", None) or [])
    }
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} holds no decoder layer to compile (no HF model with "
            f"_no_split_modules among its submodules)"
        )
    return layers


class LayerCompiler:
    """Regional ``torch.compile`` of the blocks of every decoder layer, switchable.

    The blocks are each decoder layer's direct children (Llama: the attention, the MLP and
    the two RMSNorms). Each block's ``forward`` is shadowed by
    ``torch.compile(block.forward, dynamic=True)`` while on; off deletes the shadow (the
    class's eager forward again), keeping the compiled function for the next switch on. The
    layer's own forward (two residual adds) stays eager: transformers hooks the attention
    to capture its outputs, the hook reads a context variable TorchDynamo cannot trace, and
    a compiled layer broke its graph there (two graphs per layer, resumed in between); a
    block's hooks run outside its compiled forward. Dynamo caches graphs on the block
    class's code and, with nn modules inlined (torch's default since 2.5), treats
    parameters as inputs, so every layer of every model shares a block's graphs (regional
    compilation, as torchtitan compiles each TransformerBlock). Graphs differ by autograd
    mode (with and without grad), by one row against several (sizes 0 and 1 are
    specialised) and, for the attention, by the keyword arguments a model passes (8 at
    most, seen on the learner's step; dynamo's limit is raised to 32); dynamic shapes keep
    other widths and row counts from compiling again.

    What it buys: inductor fuses the RMSNorm (float32 upcast, mean of squares, scale), the
    rotary embedding and SiLU x up-projection into a few kernels; matmuls and attention
    stay cuBLAS / SDPA. The values are the eager ones to rounding
    (``tests/unit/learner/test_compile_layers.py`` checks the graphs and the wiring on the CPU,
    ``tests/gpu/test_learner_cuda.py`` inductor's kernels on CUDA).

    Args:
        models: the models whose layers to compile (:func:`decoder_layers` of each).
        backend: the ``torch.compile`` backend; default :data:`COMPILE_BACKEND` read when
            switched on.

    Raises:
        ValueError: a model with no decoder layer (:func:`decoder_layers`).
    """

    def __init__(self, models: list[nn.Module], backend: str | None = None) -> None:
        self.layers = [layer for model in models for layer in decoder_layers(model)]
        self.blocks = [block for layer in self.layers for block in layer.children()]
        self.backend = backend
        self.enabled = False
        self._compiled: list | None = None  # per block, made at the first switch on

    def set(self, enabled: bool) -> None:
        """Switch every block to its compiled (True) or eager (False) forward; idempotent."""
        if enabled == self.enabled:
            return
        if enabled and self._compiled is None:
            backend = self.backend or COMPILE_BACKEND
            # the attention's graphs: 2 autograd modes x 1 or more rows x the policy's and
            # the critic's keyword arguments (output_hidden_states) = 8, dynamo's default
            # limit, past which a new case would run eagerly
            from torch._dynamo import config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 32)
            self._compiled = [
                torch.compile(block.forward, dynamic=True, backend=backend) for block in self.blocks
            ]
        for index, block in enumerate(self.blocks):
            if enabled:
                block.forward = self._compiled[index]
            else:
                del block.forward  # the instance attribute: the class's forward again
        self.enabled = enabled
