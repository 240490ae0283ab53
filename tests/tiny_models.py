"""Tiny randomly initialised Llamas for tests: one place for their shapes.

``tiny_llama_config`` is the shape every test starts from (2 layers, hidden 64, 4 heads of
16, 2 KV heads); a test that needs another says so with keyword overrides. ``peaked_llama``
is the engine tests' model: head_dim 64 (vLLM's CPU attention needs it), an untied output
layer and scaled embeddings, so its logits are peaked and depend on the prompt (the default
0.02-std init is near uniform and, tied, greedily repeats a newline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config


def tiny_llama_config(vocab_size: int, tok: Any = None, **overrides: Any) -> LlamaConfig:
    """The tiny Llama's config for ``vocab_size`` tokens (``tok``'s special token ids when
    given); ``overrides`` replace any field."""
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )  # fmt: skip
    if tok is not None:
        fields.update(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    return LlamaConfig(**{**fields, **overrides})


def tiny_qwen2_config(vocab_size: int, tok: Any = None, **overrides: Any) -> Qwen2Config:
    """A Qwen2-shaped model of the tiny Llama's size: the q/k/v projections carry biases
    and the embedding is tied to the LM head, as in Qwen2.5-0.5B to 3B (the shapes the 7B
    recipe's tests stand in for); ``overrides`` replace any field."""
    llama = tiny_llama_config(vocab_size, tok).to_dict()
    fields = {k: llama[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    )}  # fmt: skip
    return Qwen2Config(**{**fields, **overrides})


def peaked_llama(tok: Any, seed: int) -> LlamaForCausalLM:
    """The engine tests' model (module docstring), float32, seeded."""
    cfg = tiny_llama_config(
        len(tok), tok, hidden_size=128, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20.0)
        model.lm_head.weight.mul_(30.0)
    return model


def save_model(model: torch.nn.Module, tok: Any, out: Path) -> Path:
    """``model`` and ``tok`` saved as an HF folder at ``out``."""
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
