"""Any local Hugging Face causal-LM folder: tiny random Llama (Llama-3 chat template) and
Qwen2 (Qwen2 chat template) folders go through the real rollout (HF engine, real retrieval
server) with their own template in the prompt, and one real DeepSpeed learner step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from actors.config import RolloutConfig
from actors.prompts import prompt_messages
from actors.rollout import RolloutWorker
from learner.config import LearnerConfig, STPPOConfig
from learner.trainer import Learner
from services.model_source import check_model_dir, resolve_model_path

pytestmark = pytest.mark.integration

# Meta-Llama-3-8B-Instruct's template (tokenizer_config.json), and Qwen2-0.5B-Instruct's
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

RECORDS = [
    {"id": "nq-0", "question": "what is the capital of peru", "golden_answers": ["Lima"],
     "data_source": "nq"},
    {"id": "hp-0", "question": "Which river flows through the capital of France?",
     "golden_answers": ["Seine"], "data_source": "hotpotqa"},
]  # fmt: skip


def build_tiny(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """A random 2-layer model of ``family`` with the family's chat template and special
    tokens on SmolLM2's vocabulary, saved as an HF folder."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if family == "llama3":
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
        tok.chat_template = LLAMA3_TEMPLATE
        config_cls, model_cls = LlamaConfig, LlamaForCausalLM
    else:
        tok.eos_token = "<|im_end|>"
        tok.chat_template = QWEN2_TEMPLATE
        config_cls, model_cls = Qwen2Config, Qwen2ForCausalLM
    config = config_cls(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model_cls(config).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("family", "markers"),
    [
        ("llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|eot_id|>"]),
        ("qwen2", ["<|im_start|>", "<|im_end|>"]),
    ],
)
def test_rollout_and_learner_step_on_a_model_family(
    family: str, markers: list[str], tmp_path: Path, model_dir: Path, retrieval_server_url: str
) -> None:
    folder = build_tiny(family, tmp_path / family, model_dir)
    assert resolve_model_path(folder) == check_model_dir(folder) == folder
    cfg = RolloutConfig(
        group_size=2, max_turns=2, max_new_tokens_per_turn=8, max_response_tokens=48
    )
    worker = RolloutWorker(str(folder), cfg, retrieval_server_url, seed=0)
    tok = worker.engine.tokenizer
    trajectories = worker.rollout(RECORDS)
    assert len(trajectories) == 4
    for record, traj in zip([r for r in RECORDS for _ in range(2)], trajectories, strict=True):
        traj.validate()
        # the prompt is the family's own chat template over our system + user messages
        expected = tok.apply_chat_template(
            prompt_messages(record), tokenize=False, add_generation_prompt=True
        )
        assert tok.decode(traj.prompt_ids) == expected
        ids = set(traj.prompt_ids.tolist())
        for marker in markers:  # each template marker is one special token
            assert tok.convert_tokens_to_ids(marker) in ids, marker
        assert traj.data_source == record["data_source"]
    worker.close()

    learner = Learner(
        folder,
        LearnerConfig(train_batch_size=4, mini_batch_size=2, micro_batch_size=1, actor_lr=1e-3),
        STPPOConfig(),
        seed=0,
    )
    metrics = learner.step(trajectories)
    assert metrics.policy_version == learner.policy_version == 1
    assert metrics.optimizer_steps >= 1 and metrics.skipped_steps == 0
    assert math.isfinite(metrics.pg_loss) and math.isfinite(metrics.grad_norm)
