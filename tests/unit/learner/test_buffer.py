"""Staleness-tagged buffer: drop-and-count, keep-and-record, capacity, admission control."""

from __future__ import annotations

import numpy as np
import pytest

from actors.trajectory import Trajectory
from learner.buffer import BufferLimits, StalenessBuffer, is_too_stale, staleness_of


def make_traj(
    version: int, qid: str = "q", *, version_max: int | None = None, failed: bool = False
) -> Trajectory:
    return Trajectory(
        prompt_ids=np.array([1, 2, 3]),
        response_ids=np.array([4, 5, 6, 7]),
        loss_mask=np.array([1, 1, 0, 1], dtype=np.int8),
        turn_ids=np.array([0, 0, -1, 1], dtype=np.int32),
        behavior_logprobs=np.array([-0.5, -1.0, 0.0, -0.2], dtype=np.float32),
        reward=1.0,
        success=True,
        num_searches=1,
        num_turns=2,
        policy_version_min=version,
        policy_version_max=version if version_max is None else version_max,
        group_id="g",
        question_id=qid,
        data_source="single_hop",
        finish_reason="answer",
        retrieval_failed=failed,
    ).validate()


def test_staleness_uses_oldest_version_and_rejects_future():
    t = make_traj(3, version_max=5)
    assert staleness_of(t, 5) == 2
    with pytest.raises(ValueError, match="policy_version_min=3 > learner_version=2"):
        staleness_of(t, 2)


def test_bound_is_inclusive():
    assert not is_too_stale(1, max_staleness=1)
    assert is_too_stale(2, max_staleness=1)
    assert not is_too_stale(0, max_staleness=0)
    assert is_too_stale(1, max_staleness=0)


def test_take_is_oldest_version_first_and_drops_and_counts_stale():
    buf = StalenessBuffer.fixed(capacity=10, max_staleness=1)
    buf.put([make_traj(v, f"q{i}") for i, v in enumerate([2, 1, 2, 0, 1, 0])])
    # learner at version 2: q3 and q5 (version 0) are over the bound and met first
    res = buf.take(3, learner_version=2)
    assert [t.question_id for t in res.trajectories] == ["q1", "q4", "q0"]  # ties: arrival
    assert res.staleness == [1, 1, 0]
    assert res.dropped_stale == 2
    assert buf.stats().depth == 1
    res2 = buf.take(3, learner_version=2)
    assert [t.question_id for t in res2.trajectories] == ["q2"] and res2.dropped_stale == 0
    s = buf.stats()
    assert (s.taken_total, s.dropped_stale_total, s.depth) == (4, 2, 0)


class LiveLimits:
    """The run's live config as the buffer sees it: one value, changed in place."""

    def __init__(self, **kwargs) -> None:
        self.now = BufferLimits(**kwargs)

    def __call__(self) -> BufferLimits:
        return self.now


def test_ready_counts_by_version_exclude_stale_and_failed():
    limits = LiveLimits(capacity=10, max_staleness=1)
    buf = StalenessBuffer(limits)
    buf.put([make_traj(0), make_traj(1), make_traj(1), make_traj(2, failed=True), make_traj(2)])
    assert buf.ready_counts(2) == {1: 2, 2: 1}
    assert buf.stats().depth == 5  # no side effects
    limits.now = BufferLimits(capacity=3, max_staleness=1)  # never drops what is held
    assert buf.free_slots() == 0 and buf.put([make_traj(2)]) == 0
    assert buf.stats().depth == 5


def test_keep_policy_consumes_and_records_staleness():
    buf = StalenessBuffer.fixed(capacity=10, max_staleness=0, stale_policy="keep")
    buf.put([make_traj(0, "a"), make_traj(3, "b")])
    res = buf.take(5, learner_version=3)
    assert [t.question_id for t in res.trajectories] == ["a", "b"]
    assert res.staleness == [3, 0]
    assert res.dropped_stale == 0


def test_max_staleness_zero_is_on_policy():
    buf = StalenessBuffer.fixed(capacity=10, max_staleness=0)
    buf.put([make_traj(4, "old"), make_traj(5, "new")])
    assert buf.num_ready(5) == 1
    res = buf.take(2, learner_version=5)
    assert [t.question_id for t in res.trajectories] == ["new"]
    assert res.dropped_stale == 1


def test_retrieval_failed_trajectories_are_never_trained_on():
    buf = StalenessBuffer.fixed(capacity=10, max_staleness=5)
    buf.put([make_traj(0, "bad", failed=True), make_traj(0, "ok")])
    assert buf.num_ready(0) == 1
    res = buf.take(2, learner_version=0)
    assert [t.question_id for t in res.trajectories] == ["ok"]
    assert res.dropped_retrieval_failed == 1
    assert buf.stats().dropped_retrieval_failed_total == 1


def test_capacity_backpressure_rejects_and_counts_overflow():
    buf = StalenessBuffer.fixed(capacity=3, max_staleness=1)
    assert buf.put([make_traj(0, f"q{i}") for i in range(5)]) == 3
    assert buf.free_slots() == 0
    s = buf.stats()
    assert (s.depth, s.put_total, s.rejected_full_total) == (3, 3, 2)


def test_live_bound_change_applies_to_next_take():
    """The buffer keeps no copy of the bound: a change of the live value applies at once."""
    limits = LiveLimits(capacity=10, max_staleness=0)
    buf = StalenessBuffer(limits)
    buf.put([make_traj(1, "a")])
    assert buf.ready_counts(3) == {}
    limits.now = BufferLimits(capacity=10, max_staleness=2)
    assert buf.ready_counts(3) == {1: 1} and buf.stats().max_staleness == 2
    assert [t.question_id for t in buf.take(1, learner_version=3).trajectories] == ["a"]
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        BufferLimits(capacity=10, max_staleness=-1)
    with pytest.raises(ValueError, match="stale_policy must be 'drop' or 'keep'"):
        StalenessBuffer.fixed(capacity=10, max_staleness=1, stale_policy="maybe")


def test_purge_stale_counts():
    buf = StalenessBuffer.fixed(capacity=10, max_staleness=1)
    buf.put([make_traj(0, "a"), make_traj(2, "b")])
    assert buf.purge_stale(learner_version=3) == 1
    assert buf.stats().dropped_stale_total == 1


def test_capacity_bounds_stats_and_clear():
    buf = StalenessBuffer.fixed(capacity=1, max_staleness=1)  # the smallest legal capacity
    assert buf.stats().capacity == 1 and buf.free_slots() == 1
    assert buf.stats().max_staleness == 1
    with pytest.raises(ValueError, match=r"^capacity must be >= 1, got 0$"):
        BufferLimits(capacity=0, max_staleness=1)
    assert buf.put([make_traj(0), make_traj(0)]) == 1
    assert buf.stats().rejected_full_total == 1
    assert buf.clear() == 1 and buf.stats().depth == 0 and buf.clear() == 0


def test_purge_stale_counts_across_calls_and_keep_drops_nothing():
    keep = StalenessBuffer.fixed(capacity=10, max_staleness=0, stale_policy="keep")
    keep.put([make_traj(0), make_traj(0)])
    assert keep.purge_stale(5) == 0 and keep.stats().depth == 2
    assert keep.stats().dropped_stale_total == 0
    drop = StalenessBuffer.fixed(capacity=10, max_staleness=1)
    drop.put([make_traj(0), make_traj(2)])
    assert drop.purge_stale(2) == 1
    drop.put([make_traj(3)])
    assert drop.purge_stale(5) == 2
    assert drop.stats().dropped_stale_total == 3  # accumulated, not the last call's count
