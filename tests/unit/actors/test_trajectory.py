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

from actors.trajectory import Trajectory, Transcript, TurnTranscript, per_turn_summary


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


def transcript(*turns: TurnTranscript) -> Transcript:
    return Transcript("Capital of Peru?", ("Lima",), turns, "exact_match", "lima", ("lima",))


SEARCHED = TurnTranscript("<search> Peru </search>", "Peru", (("p1", "Lima"),))
ANSWERED = TurnTranscript("<answer> Lima </answer>")


def test_a_matching_transcript_passes_and_is_stripped_for_the_learner():
    t = corrupted(transcript=transcript(SEARCHED, ANSWERED)).validate()
    stripped = t.without_transcript()
    assert stripped.transcript is None and t.transcript is not None
    assert stripped.response_ids is t.response_ids  # a shallow copy: no array copied


TRANSCRIPT_CASES = {
    "a turn missing": (transcript(SEARCHED), "transcript has 1 turns, num_turns is 2"),
    "a search not counted": (
        transcript(SEARCHED, TurnTranscript("<search> x </search>", "x")),
        "transcript has 2 search queries, num_searches is 1"),
    "passages without a search": (
        transcript(TurnTranscript("<search></search>", "", (("p1", "Lima"),)), SEARCHED),
        "transcript: passages on a turn that sent no search query"),
}  # fmt: skip


@pytest.mark.parametrize(("value", "message"), TRANSCRIPT_CASES.values(), ids=TRANSCRIPT_CASES)
def test_a_transcript_that_disagrees_with_the_tokens_is_rejected(value, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        corrupted(transcript=value).validate()


def test_per_turn_summary():
    # turn 0: 1 and 3 -> mean 2; turn 1: 5; the environment token (-1) is left out
    (t0, t1) = per_turn_summary(np.array([1.0, 3.0, 9.0, 5.0]), np.array([0, 0, -1, 1]))
    assert (t0.mean, t0.min, t0.max) == (2.0, 1.0, 3.0)
    assert (t1.mean, t1.min, t1.max) == (5.0, 5.0, 5.0)
    assert per_turn_summary(np.zeros(2), np.array([-1, -1])) == []
    with pytest.raises(ValueError, match="differ"):
        per_turn_summary(np.zeros(3), np.zeros(2, np.int32))
