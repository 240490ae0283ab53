"""A turn generated across two policy versions (a weight update landed mid-turn) is
corrected exactly by the unchanged objectives: each token's behaviour log-prob is the
probability under the version that sampled it, so the token ratio, the turn's geometric
mean and decoupled PPO's behaviour weight are what they would be for any other trajectory.

The references below are computed by hand (plain ``math``), from the numbers in the
comments; the code path is Trajectory (validated, per-token versions) -> collate -> loss.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from actors.trajectory import Trajectory
from learner.batch import collate_trajectories
from learner.buffer import StalenessBuffer, token_staleness_counts
from learner.corrections import rollout_correction
from learner.losses import compute_policy_loss

# one prompt token, then one turn of 4 policy tokens: tokens 0-1 sampled by version 3,
# tokens 2-3 by version 4 (the update landed after the 2nd token), then 2 information
# tokens and a second 1-token turn sampled by version 4
BEHAVIOR = [-1.0, -2.0, -0.5, -1.5, 0.0, 0.0, -0.25]  # log pi_v3 (t0, t1), log pi_v4 (t2..)
LEARNER = [-0.9, -2.1, 0.0, -0.7, 0.0, 0.0, -0.25]  # log pi_theta of the same tokens
PROXIMAL = [-0.95, -2.05, -0.2, -1.0, 0.0, 0.0, -0.25]  # log pi_prox (decoupled PPO)
MASK = [1, 1, 1, 1, 0, 0, 1]
TURNS = [0, 0, 0, 0, -1, -1, 1]
VERSIONS = [3, 3, 4, 4, -1, -1, 4]


def mixed_trajectory(**changes) -> Trajectory:
    fields = dict(
        prompt_ids=np.asarray([7], dtype=np.int64),
        response_ids=np.asarray([11, 12, 13, 14, 20, 21, 15], dtype=np.int64),
        loss_mask=np.asarray(MASK, dtype=np.int8),
        turn_ids=np.asarray(TURNS, dtype=np.int32),
        behavior_logprobs=np.asarray(BEHAVIOR, dtype=np.float32),
        reward=1.0,
        success=True,
        num_searches=1,
        num_turns=2,
        policy_version_min=3,
        policy_version_max=4,
        group_id="g",
        question_id="q/0",
        data_source="single_hop",
        finish_reason="answer",
        token_versions=np.asarray(VERSIONS, dtype=np.int32),
    )
    fields.update(changes)
    return Trajectory(**fields).validate()


def batch_tensors():
    batch = collate_trajectories([mixed_trajectory()], pad_token_id=0)
    learner = torch.tensor([LEARNER], dtype=torch.float64)
    return batch, learner


def test_collated_batch_carries_each_tokens_version_and_probability():
    batch, _ = batch_tensors()
    assert batch.token_versions.tolist() == [VERSIONS]
    assert batch.behavior_logprobs.tolist() == [BEHAVIOR]
    assert batch.policy_version_min.tolist() == [3]


def test_turn_ratio_over_two_versions_matches_hand_reference():
    # turn 0: log r = (-0.9+1.0, -2.1+2.0, 0.0+0.5, -0.7+1.5) = (0.1, -0.1, 0.5, 0.8),
    # mean 0.325, rho_0 = exp(0.325) = 1.38403 > 1 + 0.2: clipped to 1.2 for A = +1.
    # turn 1: log r = 0, rho_1 = 1. Token-mean over N = 5 tokens, A = 1 everywhere:
    # L = -(4 * 1.2 + 1 * 1) / 5 = -1.16
    batch, learner = batch_tensors()
    out = compute_policy_loss(
        learner, batch.behavior_logprobs.double(), batch.loss_mask.double(),
        batch.loss_mask, batch.turn_ids,
        ratio_level="turn", clip_eps_low=0.2, clip_eps_high=0.2,
    )  # fmt: skip
    rho0 = math.exp((0.1 - 0.1 + 0.5 + 0.8) / 4)
    expected = -(4 * min(rho0, 1.2) + 1.0) / 5
    assert expected == pytest.approx(-1.16, abs=1e-12)
    # float32 behaviour log-probs (the wire dtype) bound the agreement
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_token_ratio_over_two_versions_matches_hand_reference():
    # r = exp(0.1, -0.1, 0.5, 0.8, 0) = (1.10517, 0.90484, 1.64872, 2.22554, 1), A = +1:
    # min(r, clip(r, 0.8, 1.2)) = (1.10517, 0.90484, 1.2, 1.2, 1); L = -sum / 5 = -1.08200
    batch, learner = batch_tensors()
    out = compute_policy_loss(
        learner, batch.behavior_logprobs.double(), batch.loss_mask.double(),
        batch.loss_mask, batch.turn_ids,
        ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2,
    )  # fmt: skip
    ratios = [math.exp(a - b) for a, b, m in zip(LEARNER, BEHAVIOR, MASK, strict=True) if m]
    expected = -sum(min(r, min(max(r, 0.8), 1.2)) for r in ratios) / 5
    assert expected == pytest.approx(-1.0820013, abs=1e-6)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_decoupled_behavior_weights_over_two_versions_match_hand_reference():
    # w_t = pi_prox / pi_b = exp(0.05, -0.05, 0.3, 0.5, 0) per token (each token against
    # the version that sampled it); u_t = pi_theta / pi_prox = exp(0.05, -0.05, 0.2, 0.3, 0)
    # clipped to [0.8, 1.2] for A = +1: (1.05127, 0.95123, 1.2, 1.2, 1).
    # L = -(1/5) sum_t w_t * min(u_t, clip(u_t))
    #   = -(1.10517 + 0.90484 + 1.34986 * 1.2 + 1.64872 * 1.2 + 1) / 5 = -1.32166
    batch, learner = batch_tensors()
    proximal = torch.tensor([PROXIMAL], dtype=torch.float64)
    weights = rollout_correction(
        proximal, batch.behavior_logprobs.double(), batch.loss_mask, batch.turn_ids,
        is_level="token", is_cap=5.0,
    )  # fmt: skip
    out = compute_policy_loss(
        learner, proximal, batch.loss_mask.double(), batch.loss_mask, batch.turn_ids,
        ratio_level="token", clip_eps_low=0.2, clip_eps_high=0.2,
        behavior_weights=weights.weights,
    )  # fmt: skip
    expected = 0.0
    for lt, p, b, m in zip(LEARNER, PROXIMAL, BEHAVIOR, MASK, strict=True):
        if m:
            w, u = math.exp(p - b), math.exp(lt - p)
            expected -= w * min(u, min(max(u, 0.8), 1.2)) / 5
    assert expected == pytest.approx(-1.3216609, abs=1e-6)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_staleness_is_the_oldest_tokens_and_per_token_histogram():
    t = mixed_trajectory()
    assert t.staleness(5) == 2  # oldest token: version 3
    assert t.token_staleness(5).tolist() == [2, 2, 1, 1, 1]
    assert t.version_counts() == {3: 2, 4: 3}
    assert token_staleness_counts([t, t], 5) == {1: 6, 2: 4}
    buf = StalenessBuffer.fixed(capacity=4, max_staleness=1)
    buf.put([t])
    # at learner version 5 the oldest token is 2 updates old: over the bound of 1, dropped
    # although most of its tokens are within it
    take = buf.take(1, learner_version=5)
    assert take.trajectories == [] and take.dropped_stale == 1
    buf.put([t])
    take = buf.take(1, learner_version=4)
    assert take.staleness == [1] and take.token_staleness == {0: 3, 1: 2}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(token_versions=np.asarray([3, 4, 3, 4, -1, -1, 4], dtype=np.int32)),
         "non-decreasing"),
        (dict(token_versions=np.asarray([3, 3, 4, 4, 4, -1, 4], dtype=np.int32)),
         "-1 on environment"),
        (dict(policy_version_min=2), "span 3..4"),
        (dict(policy_version_max=5), "span 3..4"),
        (dict(token_versions=np.asarray([3, 3, 4], dtype=np.int32)), "shape"),
    ],
)  # fmt: skip
def test_validate_rejects_inconsistent_token_versions(change, message):
    with pytest.raises(ValueError, match=message):
        mixed_trajectory(**change)


def test_unrecorded_token_versions_read_as_the_oldest():
    t = dataclasses.replace(mixed_trajectory(), token_versions=None).validate()
    assert t.policy_token_versions().tolist() == [3, 3, 3, 3, -1, -1, 3]
