"""The weight-sync coordinator (services.loop.sync) with its Ray calls and transport faked.

After a broken collective broadcast the surviving engines get the weights at once: a rollout
is submitted with the version last pushed to its actor and waits for it to land
(``min_policy_version``); if the survivors' weights only came with the next sync, which
needs a learner step, which needs their trajectories, the run would stall for
``rollout.weight_wait_timeout_s``. The whole path with real engines is
``tests/integration/test_driver.py::test_collective_weight_sync_survives_an_engine_restart``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from services.config import load_config  # noqa: E402
from services.loop import sync as sync_module  # noqa: E402
from services.loop.fleet import Fleet, RolloutSlot  # noqa: E402
from services.loop.sync import SyncCoordinator  # noqa: E402


class Transport:
    """The weight sync's calls, recorded; every push returns one ack per engine."""

    def __init__(self) -> None:
        self.pushed: list[list[str]] = []
        self.lost: list[str] = []

    def push(self, learner, engines, version):
        self.pushed.append(list(engines))
        return SimpleNamespace(
            policy_version=version, export_s=0.2, acks=[f"ack-{e}" for e in engines]
        )

    def push_to(self, handle, engines):
        self.pushed.append(list(engines))
        return [f"reload-{len(self.pushed)}-{e}" for e in engines]

    def on_member_lost(self, handle, reason):
        self.lost.append(reason)

    def on_broken_sync(self, error) -> bool:
        return "Connection closed by peer" in str(error)


def coordinator(lines: list[str]) -> SyncCoordinator:
    cfg = load_config(None, [])
    fleet = Fleet(cfg, create_actor=lambda i: f"engine-{i}")
    fleet.slots = [RolloutSlot("engine-0", 0, lost=True), RolloutSlot("engine-1", 1)]
    fleet.set_interrupt = lambda slots, every: None
    return SyncCoordinator(lambda: cfg, fleet, "learner", Transport(), lines.append)


def broken(monkeypatch: pytest.MonkeyPatch) -> None:
    error = ray.exceptions.RayTaskError(
        "receive_weights",
        "Traceback ...\nRuntimeError: [gloo] Connection closed by peer",
        RuntimeError("[gloo] Connection closed by peer"),
    )
    monkeypatch.setattr(sync_module.ray, "get", lambda *a, **k: (_ for _ in ()).throw(error))


def test_a_push_reaches_the_live_engines_and_versions_them():
    lines: list[str] = []
    sync = coordinator(lines)
    sync.push(3, blocking=False)
    assert sync.weight_sync.pushed == [["engine-1"]]  # the lost one is left out
    assert [s.engine_version for s in sync.fleet.slots] == [-1, 3]
    assert sync.refs() == ["ack-engine-1"] and sync.owns("ack-engine-1")


def test_the_survivors_of_a_broken_broadcast_are_re_sent_the_weights_once(monkeypatch):
    lines: list[str] = []
    sync = coordinator(lines)
    sync.push(3, blocking=False)
    sync.pending["ack-learner"] = 0.2
    broken(monkeypatch)
    sync.on_ack("ack-learner")  # the learner's side of the broadcast broke
    sync.on_ack("ack-engine-1")  # and the survivor's (the same broken sync)
    assert sync.weight_sync.pushed == [["engine-1"], ["engine-1"]]  # the push, one re-send
    assert "reload-2-engine-1" in sync.pending  # its load is awaited like a sync's
    assert "re-sending policy_version 3 to 1 engine(s)" in lines[0]
    # the next broken sync is re-sent again
    sync.push(4, blocking=False)
    sync.pending["ack-learner-4"] = 0.2
    sync.on_ack("ack-learner-4")
    assert sync.weight_sync.pushed[-1] == ["engine-1"] and len(sync.weight_sync.pushed) == 4


def test_an_unrelated_error_is_raised_not_recovered(monkeypatch):
    sync = coordinator([])
    sync.push(3, blocking=False)
    error = ray.exceptions.RayTaskError(
        "receive_weights", "Traceback ...\nValueError: shape mismatch", ValueError("shape mismatch")
    )
    monkeypatch.setattr(sync_module.ray, "get", lambda *a, **k: (_ for _ in ()).throw(error))
    with pytest.raises(ray.exceptions.RayTaskError):
        sync.on_ack("ack-engine-1")
    assert sync.weight_sync.pushed == [["engine-1"]]


def test_a_lost_engine_gets_a_queued_load_and_comes_back_with_the_current_version(monkeypatch):
    lines: list[str] = []
    sync = coordinator(lines)
    sync.push(3, blocking=False)
    survivor = sync.fleet.slots[1]
    sync.mark_lost(survivor, "rollout actor 1 lost")
    assert survivor.lost and "reload-2-engine-1" in sync.revivals
    monkeypatch.setattr(
        sync_module.ray,
        "get",
        lambda ref, *a, **k: 0.5 if "ack" in str(ref) or "reload" in str(ref) else "10.0.0.2",
    )
    monkeypatch.setattr(
        "services.weight_sync.engine_weights_call",
        lambda handle, name: SimpleNamespace(remote=lambda *a: f"{name}-{handle}"),
    )
    sync.on_ack("reload-2-engine-1")
    assert not survivor.lost and survivor.engine_version == 3
    assert lines[-1] == "rollout actor 1 is back on 10.0.0.2 with policy_version 3"


def test_the_final_push_loads_the_learners_version_under_a_fixed_lag_without_exporting_again(
    monkeypatch,
):
    """``sync.fixed_lag`` holds the engines ``max_staleness`` versions behind; the final
    evaluation's push (``push_final``: an exact push) gives them the learner's own version,
    reusing the export the lagged push of that version made (red if the end evaluation answers with the
    lagged weights: ``tests/integration/test_stability.py``)."""
    from services import lagged_sync

    exported: list[int] = []
    loads: list[tuple[str, int]] = []
    monkeypatch.setattr(
        lagged_sync,
        "export_to_object_store",
        lambda learner, v: (exported.append(v), (f"weights-{v}", 0.1))[1],
    )
    monkeypatch.setattr(
        lagged_sync,
        "engine_weights_call",
        lambda engine, name: SimpleNamespace(
            remote=lambda ref, v: (loads.append((engine, v)), f"ack-{engine}-{v}")[1]
        ),
    )
    cfg = load_config(None, ["sync.fixed_lag=true", "buffer.max_staleness=2"])
    fleet = Fleet(cfg, create_actor=lambda i: f"engine-{i}")
    fleet.slots = [RolloutSlot("engine-0", 0)]
    sync = SyncCoordinator(lambda: cfg, fleet, "learner", Transport(), [].append)
    for version in range(6):
        sync.push(version, blocking=False)
    assert [v for _, v in loads] == [0, 0, 0, 1, 2, 3]  # two versions behind
    assert fleet.slots[0].engine_version == 3
    monkeypatch.setattr(sync_module.ray, "get", lambda ref, *a, **k: 0.1)  # every load lands
    sync.push_final(5)
    assert loads[-1] == ("engine-0", 5) and fleet.slots[0].engine_version == 5
    assert exported == [0, 1, 2, 3, 4, 5]  # version 5 was exported once
    assert sync.refs() == []  # the end evaluation starts after every load
    sync.push_final(5)
    assert len(loads) == 7  # an engine at the final version gets nothing more
