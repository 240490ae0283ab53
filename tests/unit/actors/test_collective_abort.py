"""The collective weight sync never leaves a member waiting on a group it has given up on.

A real TCP store stands for the group's (rank 0's); the group's members are placeholders,
since only the abort signal through the store is under test (the whole path across pods is
``tests/integration/test_cluster_faults.py``)."""

from __future__ import annotations

import pytest

from actors.rendezvous import bind_master_store
from actors.weight_group import ABORT_KEY
from services.weight_sync import CollectiveWeightSync


@pytest.fixture
def formed():
    """A sync whose group (store on loopback, one engine) has been formed."""
    store = bind_master_store(timeout_s=10.0)
    sync = CollectiveWeightSync(say=lambda line: None)
    sync._members = ["engine-1"]
    sync._store_address = ("127.0.0.1", store.port)
    return sync, store


def test_a_broken_broadcast_aborts_the_group_for_the_members_still_waiting(formed):
    """The learner's side of a broadcast broke (a peer died): a surviving engine is still
    in its receive. Forgetting the group alone left it there until collective_timeout_s
    (30 min), with its next rollout queued behind it: a run that hung after a partition."""
    sync, store = formed
    assert sync.on_broken_sync(RuntimeError("[gloo] Connection closed by peer [10.0.0.8]"))
    assert store.check([ABORT_KEY])
    assert "broadcast broke" in store.get(ABORT_KEY).decode()
    assert sync._members == []  # formed again at the next push


def test_an_unrelated_error_is_not_recovered_from_and_aborts_nothing(formed):
    sync, store = formed
    assert not sync.on_broken_sync(RuntimeError("shape mismatch for model.embed_tokens"))
    assert not store.check([ABORT_KEY])
    assert sync._members == ["engine-1"]


def test_a_lost_member_aborts_once(formed):
    sync, store = formed
    sync.on_member_lost(None, "an engine died")
    assert store.get(ABORT_KEY).decode() == "an engine died"
    sync.on_member_lost(None, "again")  # the group is already forgotten: nothing more
    assert store.get(ABORT_KEY).decode() == "an engine died"
