"""The rollout loop with the real HF engine and the real retrieval server.

Checks the token accounting against what the engine actually received, and the behaviour
log-probs against one learner forward pass over ``prompt + response`` (multi-turn
alignment: information tokens in between must not shift anything).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.config import RolloutConfig
from actors.engines.hf import HFEngine
from actors.engines.protocol import GenerationResult, SamplingParams
from actors.rollout import RolloutWorker
from actors.trajectory import Trajectory

pytestmark = pytest.mark.integration

RECORDS = [
    {
        "id": "t/0",
        "question": "What is the capital of Peru?",
        "golden_answers": ["Lima"],
        "data_source": "single_hop",
    },
    {
        "id": "t/1",
        "question": "Which gene is mutated in Marfan syndrome?\nA. FBN1\nB. CFTR\nC. HTT\nD. DMD",
        "golden_answers": ["A"],
        "data_source": "medical_mc",
        "metadata": {"options": {"A": "FBN1", "B": "CFTR", "C": "HTT", "D": "DMD"}},
    },
]


class RecordingEngine:
    """Wraps a real engine and keeps every prompt it was given (the engine's view)."""

    def __init__(self, inner: HFEngine):
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.inputs: list[list[int]] = []
        self.batch_sizes: list[int] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def load_weights(self, state_dict, policy_version: int) -> None:
        self.inner.load_weights(state_dict, policy_version)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        self.inputs += [list(p) for p in prompts]
        self.batch_sizes.append(len(prompts))
        return self.inner.generate(prompts, params)


def check_engine_view(traj: Trajectory, seen: list[list[int]]) -> None:
    """Turn k was generated from exactly prompt + response[:start of turn k]."""
    full = traj.prompt_ids.tolist() + traj.response_ids.tolist()
    for k in range(traj.num_turns):
        start = int((traj.turn_ids == k).argmax())
        assert full[: len(traj.prompt_ids) + start] in seen, (
            f"turn {k} input not seen by the engine"
        )


def check_logprobs(traj: Trajectory, model, mean_atol: float, max_atol: float) -> None:
    """Behaviour log-probs vs one bf16 learner forward (tolerances: see test_engines_contract)."""
    p = traj.prompt_ids.tolist()
    ids = torch.tensor([p + traj.response_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(p) - 1 : -1].float()
    ref = (
        torch.log_softmax(logits, -1).gather(1, torch.tensor(traj.response_ids)[:, None]).squeeze(1)
    )
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    gap = (torch.tensor(traj.behavior_logprobs)[mask] - ref[mask]).abs()
    assert gap.mean().item() < mean_atol and gap.max().item() < max_atol, gap


def test_worker_rollout_on_tiny_llama(tiny_llama_dir, retrieval_server_url):
    cfg = RolloutConfig(
        group_size=3, max_turns=2, max_new_tokens_per_turn=12, max_response_tokens=64
    )
    engine = RecordingEngine(HFEngine(tiny_llama_dir, seed=1))
    worker = RolloutWorker(str(tiny_llama_dir), cfg, retrieval_server_url, seed=1, engine=engine)
    trajs = worker.rollout(RECORDS)
    assert len(trajs) == 6
    assert [t.group_id for t in trajs] == ["s1-b0-q0"] * 3 + ["s1-b0-q1"] * 3
    assert engine.batch_sizes[0] == 6  # all episodes in one generate call
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    for t in trajs:
        t.validate()
        check_engine_view(t, engine.inputs)
        check_logprobs(t, model, mean_atol=0.06, max_atol=0.4)
        # a random model never closes a tag: every episode runs out of its 12-token turn
        assert (t.finish_reason, t.num_turns, t.num_response_tokens) == ("max_tokens", 1, 12)
        assert (t.reward, t.malformed_reason) in ((0.0, "no_answer"), (0.0, "unclosed_answer"))
    assert worker.last_stats.num_generated_tokens == 6 * 12
    greedy = worker.rollout(RECORDS[:1], greedy=True)
    assert len(greedy) == 1 and greedy[0].group_id == "s1-b1-q0"
