"""``Trajectory.validate``: every token-accounting invariant rejects its own corruption.

Each case corrupts one field of a valid two-turn trajectory (turn 0, an environment block,
turn 1) and expects the message of the check it violates; the valid trajectory and the edge
cases that are legal (a trajectory with no policy tokens, equal versions) pass. Deleting
any one check in ``actors/trajectory.py`` turns its case red (issue 21: four checks could
be deleted with every test still green).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from learner_factories import make_trajectory

from actors.trajectory import Trajectory


def two_turns() -> Trajectory:
    #          turn 0 | environment | turn 1
    mask = [1, 1, 1, 0, 0, 0, 1, 1]
    return make_trajectory([5, 6, 7], [11, 12, 13, 90, 91, 92, 14, 15], mask).validate()


def corrupted(**fields) -> Trajectory:
    return dataclasses.replace(two_turns(), **fields)


def test_a_valid_trajectory_passes_and_chains():
    t = two_turns()
    assert t.validate() is t
    assert t.turn_ids.tolist() == [0, 0, 0, -1, -1, -1, 1, 1]
    assert t.num_policy_tokens == 5 and t.num_response_tokens == 8


def test_legal_edge_cases_pass():
    only_env = make_trajectory([5], [90, 91], [0, 0])  # e.g. a failed first search
    assert only_env.validate().num_policy_tokens == 0
    one_version = corrupted(policy_version_min=3, policy_version_max=3)
    assert one_version.validate() is one_version


T = two_turns()
CASES = {
    "mask shorter than the response": (
        {"loss_mask": T.loss_mask[:-1]}, "loss_mask has shape (7,), expected (8,)"),
    "turn ids of the wrong length": (
        {"turn_ids": T.turn_ids[:-1]}, "turn_ids has shape"),
    "behaviour log-probs of the wrong length": (
        {"behavior_logprobs": np.zeros(9, np.float32)}, "behavior_logprobs has shape"),
    "2-D mask": ({"loss_mask": T.loss_mask.reshape(2, 4)}, "loss_mask has shape (2, 4)"),
    "empty prompt": ({"prompt_ids": np.zeros(0, np.int64)}, "prompt_ids must be a non-empty"),
    "2-D prompt": ({"prompt_ids": np.ones((1, 3), np.int64)}, "prompt_ids must be a non-empty"),
    "an environment token in the loss": (
        {"loss_mask": np.array([1, 1, 1, 1, 0, 0, 1, 1], np.int8)},
        "loss_mask must be 1 exactly where turn_ids >= 0"),
    "a policy token outside the loss": (
        {"loss_mask": np.array([1, 0, 1, 0, 0, 0, 1, 1], np.int8)},
        "loss_mask must be 1 exactly where turn_ids >= 0"),
    "a log-prob on an environment token": (
        {"behavior_logprobs": np.array([-.5, -.5, -.5, -.1, 0, 0, -.5, -.5], np.float32)},
        "behavior_logprobs must be 0 on environment tokens"),
    "a positive log-prob": (
        {"behavior_logprobs": np.array([-.5, .1, -.5, 0, 0, 0, -.5, -.5], np.float32)},
        "behavior_logprobs must be <= 0"),
    "turns starting at 1": (
        {"turn_ids": np.array([1, 1, 1, -1, -1, -1, 2, 2], np.int32)},
        "turn ids must start at 0"),
    "a turn skipped": (
        {"turn_ids": np.array([0, 0, 0, -1, -1, -1, 2, 2], np.int32)},
        "turn ids must start at 0 and increase by at most 1"),
    "turn ids going back": (
        {"turn_ids": np.array([0, 1, 0, -1, -1, -1, 1, 1], np.int32)},
        "turn ids must start at 0 and increase by at most 1"),
    "one turn split by an environment block": (
        {"turn_ids": np.array([0, 0, 0, -1, -1, -1, 0, 0], np.int32)},
        "each turn must be one contiguous run"),
    "versions out of order": (
        {"policy_version_min": 4, "policy_version_max": 3},
        "policy_version_min must be <= policy_version_max"),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), CASES.values(), ids=CASES.keys())
def test_each_invariant_rejects_its_corruption(fields, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        corrupted(**fields).validate()
