"""Shared fixtures. Tests run against the assets built by ``stppo prepare`` (the README test
command builds them first); a missing asset is an error naming the command, not a skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.env import PROJECT_ROOT, configure_local_caches

configure_local_caches()

DATA_DIR = Path(os.environ.get("STPPO_DATA_DIR", PROJECT_ROOT / "data"))
MODEL_DIR = DATA_DIR / "model" / "smollm2-135m-instruct"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: run `stppo prepare` (the README test command does)")
    return path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder (bf16 safetensors + tokenizer)."""
    return _require(MODEL_DIR)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The built data folder (corpus, QA sets, indexes)."""
    return _require(DATA_DIR)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama (hidden 64) with SmolLM2's tokenizer, saved as
    an HF folder. Fast stand-in for the real policy where weights do not matter."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
