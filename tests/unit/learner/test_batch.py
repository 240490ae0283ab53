"""Collation of trajectories into the learner's padded layout (learner/batch.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_factories import make_trajectory
from tiny_models import tiny_llama_config
from transformers import LlamaForCausalLM

from actors.trajectory import Trajectory
from learner.batch import collate_trajectories
from learner.modeling import response_logits, token_logprobs

PAD = 0


def _two_trajectories() -> list[Trajectory]:
    # row 0: prompt [5, 6], response [8, 9, 10, 11]: turn 0 = [8], env = [9, 10], turn 1 = [11]
    # row 1: prompt [7],    response [12, 13]:       turn 0 = [12, 13]
    return [
        make_trajectory([5, 6], [8, 9, 10, 11], [1, 0, 0, 1], [-0.1, 0, 0, -0.4], group_id="a"),
        make_trajectory([7], [12, 13], [1, 1], [-0.2, -0.3], reward=0.0, group_id="b"),
    ]


def test_collate_hand_checked_layout():
    batch = collate_trajectories(_two_trajectories(), pad_token_id=PAD)
    # P = max(2, 1) = 2, T = max(4, 2) = 4, L = 6
    assert batch.prompt_width == 2
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 10, 11], [PAD, 7, 12, 13, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    # positions count real tokens only: row 1 starts at 0 in column 1
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 2, 2]]
    assert batch.response_ids.tolist() == [[8, 9, 10, 11], [12, 13, PAD, PAD]]
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.turn_ids.tolist() == [[0, -1, -1, 1], [0, 0, -1, -1]]
    torch.testing.assert_close(
        batch.behavior_logprobs, torch.tensor([[-0.1, 0, 0, -0.4], [-0.2, -0.3, 0, 0]])
    )
    assert batch.last_policy_index.tolist() == [3, 1]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.group_ids.tolist() == [0, 1]
    assert batch.num_policy_tokens == 4
    assert batch.num_tokens == 6 + 3


def test_select_trims_padding_columns():
    batch = collate_trajectories(_two_trajectories(), pad_token_id=PAD)
    row1 = batch.select([1])
    # only row 1: P = 1, T = 2
    assert row1.input_ids.tolist() == [[7, 12, 13]]
    assert row1.position_ids.tolist() == [[0, 1, 2]]
    assert row1.loss_mask.tolist() == [[1, 1]]
    assert row1.turn_ids.tolist() == [[0, 0]]
    torch.testing.assert_close(row1.behavior_logprobs, torch.tensor([[-0.2, -0.3]]))
    assert row1.last_policy_index.tolist() == [1]
    swapped = batch.select([1, 0])
    assert swapped.input_ids.tolist() == [[PAD, 7, 12, 13, PAD, PAD], [5, 6, 8, 9, 10, 11]]


def test_a_moved_batch_carries_its_policy_token_positions():
    """``to`` finds the policy tokens where the batch is (the host: no wait for a GPU) and
    carries them; ``select`` drops them (other rows, other columns)."""
    batch = collate_trajectories(_two_trajectories(), pad_token_id=PAD)
    assert batch.policy_positions is None
    rows, cols = batch.policy_token_positions()  # computed from the mask
    assert rows.tolist() == [0, 0, 1, 1] and cols.tolist() == [0, 3, 0, 1]
    moved = batch.to("cpu")
    assert [t.tolist() for t in moved.policy_positions] == [[0, 0, 1, 1], [0, 3, 0, 1]]
    assert moved.policy_token_positions() is moved.policy_positions
    row1 = moved.select([1])
    assert row1.policy_positions is None
    assert [t.tolist() for t in row1.to("cpu").policy_token_positions()] == [[0, 0], [0, 1]]


def test_group_ids_first_seen_order():
    trajs = [
        make_trajectory([1], [2], [1], group_id="x"),
        make_trajectory([1], [2], [1], group_id="y"),
        make_trajectory([1], [2], [1], group_id="x"),
    ]
    assert collate_trajectories(trajs, PAD).group_ids.tolist() == [0, 1, 0]


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        collate_trajectories([], PAD)
    no_policy = make_trajectory([1], [2, 3], [1, 0])
    no_policy.loss_mask[:] = 0
    no_policy.turn_ids[:] = -1
    no_policy.behavior_logprobs[:] = 0.0
    with pytest.raises(ValueError, match="no policy tokens"):
        collate_trajectories([no_policy], PAD)
    broken = make_trajectory([1], [2, 3], [1, 1])
    broken.turn_ids[1] = -1  # mask says policy token, turn id says environment
    with pytest.raises(ValueError, match="trajectory 0"):
        collate_trajectories([broken], PAD)


def test_response_logprobs_match_unpadded_shifted_forward():
    """The [B, T] log-probs of the padded batch equal the textbook per-sequence computation
    logits[:-1] -> tokens[1:] on each unpadded sequence, at every real response token."""
    torch.manual_seed(0)
    config = tiny_llama_config(
        32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    trajs = [
        make_trajectory([5, 6, 1], [8, 9, 10, 11], [1, 0, 0, 1]),
        make_trajectory([7], [12, 13], [1, 1]),
    ]
    batch = collate_trajectories(trajs, pad_token_id=PAD)
    with torch.no_grad():
        batched = token_logprobs(response_logits(model, batch), batch.response_ids)
        for b, traj in enumerate(trajs):
            seq = torch.from_numpy(np.concatenate([traj.prompt_ids, traj.response_ids]))[None]
            logp = torch.log_softmax(model(input_ids=seq).logits[0, :-1].float(), dim=-1)
            expected = logp.gather(-1, seq[0, 1:, None]).squeeze(-1)[-traj.num_response_tokens :]
            got = batched[b, : traj.num_response_tokens]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_turn_advantages_follow_the_input_order_and_skip_the_excluded() -> None:
    """StepMetrics.turn_advantages: row i of the collated batch is kept[i]; the summaries
    come back per input trajectory, None for one the step excluded."""
    from learner.step_metrics import turn_advantages

    a = make_trajectory([5], [11, 12, 90, 13], [1, 1, 0, 1])  # turns 0, 0, env, 1
    excluded = make_trajectory([5], [11], [1])
    b = make_trajectory([5, 6], [14, 15, 16], [1, 1, 1])  # one turn
    batch = collate_trajectories([b, a], pad_token_id=0)  # kept in another order
    batch.advantages = torch.tensor([[0.5, 1.5, -2.0, 0.0], [1.0, 3.0, 7.0, -1.0]])
    out = turn_advantages([a, excluded, b], [b, a], batch)
    # a: turn 0 = (1, 3) -> mean 2; the environment token 7 is not a turn's; turn 1 = -1
    assert [(s.mean, s.min, s.max) for s in out[0]] == [(2.0, 1.0, 3.0), (-1.0, -1.0, -1.0)]
    assert out[1] is None
    # b: one turn over its 3 tokens, the padding column left out: mean(0.5, 1.5, -2) = 0
    assert [(s.mean, s.min, s.max) for s in out[2]] == [(0.0, -2.0, 1.5)]


def test_token_budget_micro_batches_longest_first_within_budget():
    from learner.micro_batches import token_budget_micro_batches

    prompts = [10, 10, 10, 30, 5]
    responses = [90, 20, 80, 300, 10]  # totals 100, 30, 90, 330, 15
    # longest first: 3 (330 > 200: alone), 0 (100), 2 (90: 2 * (10 + 90) = 200 fits),
    # 1 (3 * 100 = 300 > 200: new), 4 (2 * (10 + 20) = 60 fits)
    assert token_budget_micro_batches(range(5), prompts, responses, 200) == [
        [3], [0, 2], [1, 4]
    ]  # fmt: skip
    # width is max prompt + max response: rows 0 (10 + 90) and 4 (5 + 10) pad to 100 each
    assert token_budget_micro_batches([4, 0], prompts, responses, 199) == [[0], [4]]
    assert token_budget_micro_batches([4, 0], prompts, responses, 200) == [[0, 4]]
    # ties keep the given order; every row exactly once
    groups = token_budget_micro_batches([2, 1, 0], [1, 1, 1], [4, 4, 4], 10)
    assert groups == [[2, 1], [0]]
    with pytest.raises(ValueError, match="budget"):
        token_budget_micro_batches([0], prompts, responses, 0)


def test_memory_token_budget_by_hand():
    from types import SimpleNamespace

    from learner.micro_batches import activation_bytes_per_token, memory_token_budget

    cfg = SimpleNamespace(hidden_size=100, intermediate_size=300, num_hidden_layers=10)
    per_layer = 2 * (6 * 100 + 4 * 300)  # 3,600 bytes per layer and token
    assert activation_bytes_per_token(cfg, gradient_checkpointing=False) == 10 * per_layer
    # checkpointed: every layer's input and residual (4 H bytes), one layer's set twice
    assert activation_bytes_per_token(cfg, gradient_checkpointing=True) == 10 * 400 + 2 * per_layer
    assert memory_token_budget(36_000_000, cfg, gradient_checkpointing=False, fraction=1.0) == 1000
    # 0.6 of what is left once the optimizer states exist
    budget = memory_token_budget(72_000_000, cfg, gradient_checkpointing=False, pending_bytes=36e6)
    assert budget == 600
    assert memory_token_budget(1000, cfg, gradient_checkpointing=False) == 256  # the floor
    with pytest.raises(ValueError, match="fraction"):
        memory_token_budget(1, cfg, gradient_checkpointing=False, fraction=0.0)


def test_memory_probe_and_settled_budget_by_hand():
    """The first step's measurements: the states are the most held before a micro-batch or
    after an optimizer step (during one that was not applied); bytes per token come from
    each model's largest micro-batch (more per token breaks a tie), its largest accumulating
    one where it had any, the larger of the two models'."""
    from learner.micro_batches import MemoryProbe, settled_token_budget

    probe = MemoryProbe()
    probe.micro_batch("policy", start=1000, peak=1000 + 400 * 10, tokens=400)  # 10 B/token
    probe.micro_batch("policy", start=1200, peak=1200 + 100 * 50, tokens=100)  # smaller: no
    assert (probe.state_bytes, probe.bytes_per_token) == (1200, 10.0)
    probe.micro_batch("policy", start=900, peak=900 + 400 * 12, tokens=400)  # tie: 12 wins
    probe.micro_batch("critic", start=1100, peak=1100 + 800 * 11, tokens=800)
    assert probe.largest == {"policy": (400, 12.0), "critic": (800, 11.0)}
    assert probe.bytes_per_token == 12.0 and probe.optimizer_steps == 0
    # an optimizer step's temporaries are gone before the next micro-batch: what stays
    # after it (the AdamW states) is held, its peak is kept apart
    probe.optimizer_step(peak=5000, after=1500)
    assert (probe.state_bytes, probe.optimizer_peak_bytes, probe.optimizer_steps) == (1500, 5000, 1)
    probe.micro_batch("critic", start=4000, peak=3000, tokens=0)  # no tokens: states only
    assert (probe.state_bytes, probe.bytes_per_token) == (4000, 12.0)
    probe.optimizer_step(peak=4500, after=1000, applied=False)  # its states may come later
    assert (probe.state_bytes, probe.optimizer_peak_bytes, probe.optimizer_steps) == (4500, 5000, 2)
    # a micro-batch accumulating into held gradients measures the policy's own bytes per
    # token, even from fewer tokens: the first's peak also held the gradients it allocated
    probe.micro_batch("policy", start=1300, peak=1300 + 300 * 7, tokens=300, accumulating=True)
    assert probe.largest_accumulating == {"policy": (300, 7.0)}
    assert probe.largest["policy"] == (400, 12.0)  # every micro-batch's, for the report
    assert probe.bytes_per_token == 11.0  # the critic's first micro-batch, none accumulating
    probe.micro_batch("critic", start=1300, peak=1300 + 200 * 6, tokens=200, accumulating=True)
    assert probe.bytes_per_token == 7.0
    # 0.8 of what is left, per measured token, at least 256
    assert settled_token_budget(12_000_000, 12.0) == 800_000
    assert settled_token_budget(12_000_000, 12.0, fraction=0.5) == 500_000
    assert settled_token_budget(1000, 12.0) == 256
    assert settled_token_budget(-5, 12.0) == 256 and settled_token_budget(10**9, 0.0) == 256
    with pytest.raises(ValueError, match="fraction"):
        settled_token_budget(1, 1.0, fraction=1.5)


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_learner_tells_the_probe_which_micro_batches_accumulate(
    tiny_llama_dir, monkeypatch, fraction
):
    """The learner step's side of the probe (measured on CUDA; here the CUDA memory counters
    are stand-ins): every training micro-batch is measured, the first of each mini-batch as
    allocating the gradients and the rest as accumulating into them, and the budget settles
    after the step from what was recorded, within ``gpu_memory_fraction`` of the device."""
    from learner_factories import make_batch, make_tiny_learner

    from learner.config import PPOConfig
    from learner.micro_batches import settled_token_budget

    learner = make_tiny_learner(  # 2 micro-batches per mini-batch
        tiny_llama_dir, PPOConfig(), zero_stage=2, gpu_memory_fraction=fraction
    )
    learner.micro_batches.budget_settled = False  # as on CUDA before the first RL step
    counter, returned = iter(range(1000, 10**9, 1000)), []
    gib = 2**30
    monkeypatch.setattr(
        torch.cuda,
        "memory_allocated",
        lambda device=None: returned.append(next(counter)) or returned[-1],
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    peak = 64 * 2**20
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    # 20 GiB device, 10 GiB free, 3 GiB reserved by this process: 7 GiB held by others
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 20 * gib))
    seen = []
    record = learner.micro_batches.memory_probe.micro_batch
    monkeypatch.setattr(
        learner.micro_batches.memory_probe,
        "micro_batch",
        lambda model, start, peak, tokens, accumulating: (
            seen.append((model, accumulating)),
            record(model, start, peak, tokens, accumulating),
        ),
    )
    learner.step(make_batch(0))
    assert seen == [("policy", False), ("critic", False), ("policy", True), ("critic", True)]
    probe = learner.micro_batches.memory_probe
    assert set(probe.largest_accumulating) == {"policy", "critic"}
    assert probe.optimizer_steps == 2 and learner.micro_batches.budget_settled
    # held: the most allocated before a micro-batch or after an optimizer step, not the
    # optimizer steps' peak
    assert (probe.state_bytes, probe.optimizer_peak_bytes) == (max(returned), peak)
    # the device less the others' 7 GiB (13 GiB), or 5 GiB at a quarter; less the states
    device = 13 * gib if fraction == 1.0 else 5 * gib
    want = settled_token_budget(device - max(returned), probe.bytes_per_token)
    assert learner.micro_batches.auto_micro_batch_tokens == want > 256
