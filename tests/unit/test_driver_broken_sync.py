"""After a broken collective broadcast the surviving engines get the weights at once.

A rollout is submitted with the version last pushed to its actor and waits for it to land
(``min_policy_version``). When the broadcast of that version breaks (an engine died), the
survivors never receive it; if their weights only came with the next sync, which needs a
learner step, which needs their trajectories, the run would stall for
``rollout.weight_wait_timeout_s``. The driver's ack handling is exercised with its Ray
calls replaced (the whole path, with real engines, is
``tests/integration/test_driver.py::test_collective_weight_sync_survives_an_engine_restart``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from services.driver import Driver, RolloutSlot  # noqa: E402


class _Sync:
    """The weight sync's recovery calls, recorded."""

    def __init__(self) -> None:
        self.pushed: list[list[str]] = []

    def on_broken_sync(self, error: Exception) -> bool:
        return "Connection closed by peer" in str(error)

    def push_to(self, handle, engines):
        self.pushed.append(list(engines))
        return [f"reload-{len(self.pushed)}-{e}" for e in engines]


def _driver() -> Driver:
    driver = Driver.__new__(Driver)
    driver.slots = [RolloutSlot("engine-0", 0, lost=True), RolloutSlot("engine-1", 1)]
    driver.weight_sync = _Sync()
    driver._sync = SimpleNamespace(policy_version=3, export_s=0.2)
    driver._pending_acks = {"ack-learner": (0.2, 0.0), "ack-engine-1": (0.2, 0.0)}
    driver._revival_acks = {}
    driver._resynced_sync = None
    driver.progress = SimpleNamespace(lines=[])
    driver.progress.say = driver.progress.lines.append
    return driver


def _broken(monkeypatch: pytest.MonkeyPatch) -> None:
    error = ray.exceptions.RayTaskError(
        "receive_weights",
        "Traceback ...\nRuntimeError: [gloo] Connection closed by peer",
        RuntimeError("[gloo] Connection closed by peer"),
    )

    def get(ref, *args, **kwargs):
        raise error

    monkeypatch.setattr(ray, "get", get)


def test_the_survivors_of_a_broken_broadcast_are_re_sent_the_weights_once(monkeypatch):
    driver = _driver()
    _broken(monkeypatch)
    driver._on_sync_ack("ack-learner")  # the learner's side of the broadcast broke
    driver._on_sync_ack("ack-engine-1")  # and the survivor's (the same broken sync)
    assert driver.weight_sync.pushed == [["engine-1"]]  # the live engine only, once
    assert "reload-1-engine-1" in driver._pending_acks  # its load is awaited like a sync's
    assert "re-sending policy_version 3 to 1 engine(s)" in driver.progress.lines[0]


def test_the_next_broken_sync_is_re_sent_again(monkeypatch):
    driver = _driver()
    _broken(monkeypatch)
    driver._on_sync_ack("ack-learner")
    driver._sync = SimpleNamespace(policy_version=4, export_s=0.2)
    driver._pending_acks["ack-learner-4"] = (0.2, 0.0)
    driver._on_sync_ack("ack-learner-4")
    assert driver.weight_sync.pushed == [["engine-1"], ["engine-1"]]


def test_an_unrelated_error_is_raised_not_recovered(monkeypatch):
    driver = _driver()
    error = ray.exceptions.RayTaskError(
        "receive_weights", "Traceback ...\nValueError: shape mismatch", ValueError("shape mismatch")
    )
    monkeypatch.setattr(ray, "get", lambda *a, **k: (_ for _ in ()).throw(error))
    with pytest.raises(ray.exceptions.RayTaskError):
        driver._on_sync_ack("ack-learner")
    assert driver.weight_sync.pushed == []
