"""The rollout fleet and the pipeline (services.loop.fleet, services.loop.pipeline) with fake
actors: admission keeps the staleness bound, a step starts only when it may, crashes are
judged, busy time is counted once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from services.config import load_config
from services.loop import fleet as fleet_module
from services.loop import pipeline as pipeline_module
from services.loop.fleet import Fleet, RolloutActorLost
from services.loop.pipeline import Pipeline, stamp_ids


class Actor:
    """A rollout actor whose calls return the name of their result."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.calls: list[tuple[list, int]] = []
        self.rollout = SimpleNamespace(remote=self._rollout)

    def _rollout(self, records, min_policy_version):
        self.calls.append((records, min_policy_version))
        return f"ref-{self.index}-{len(self.calls)}"


class Results(dict):
    """``ray.get`` over named results (a list of refs gets a list)."""

    def get(self, ref, *args, **kwargs):
        return [self[r] for r in ref] if isinstance(ref, list) else self[ref]


@pytest.fixture
def results(monkeypatch) -> Results:
    results = Results()
    monkeypatch.setattr(fleet_module.ray, "get", results.get)
    monkeypatch.setattr(pipeline_module.ray, "get", results.get)
    monkeypatch.setattr(fleet_module.ray, "kill", lambda handle, no_restart: None)
    return results


def config(**overrides):
    pairs = [f"{k}={v}" for k, v in overrides.items()]
    return load_config(None, ["rollout.prompts_per_batch=2", "rollout.group_size=2", *pairs])


class Buffer:
    """The buffer actor's calls: ready counts per version, takes, puts."""

    def __init__(self, results: Results) -> None:
        self.results, self.ready, self.put_calls = results, {}, []
        for name in ("ready_counts", "take", "put", "stats"):
            setattr(self, name, SimpleNamespace(remote=getattr(self, f"_{name}")))

    def _ready_counts(self, version):
        self.results["ready"] = dict(self.ready)
        return "ready"

    def _take(self, n, version):
        traj = [SimpleNamespace(without_transcript=lambda: "t") for _ in range(n)]
        self.results["take"] = SimpleNamespace(trajectories=traj, dropped_stale=0)
        return "take"

    def _put(self, trajectories):
        self.put_calls.append(trajectories)
        self.results["put"] = len(trajectories)
        return "put"

    def _stats(self):
        return None


def test_admission_keeps_the_bound_and_submits_to_the_least_recently_started(results):
    cfg = config(
        **{"buffer.max_staleness": 0, "learner.train_batch_size": 4, "rollout.num_actors": 2}
    )
    fleet = Fleet(cfg, Actor)
    fleet.resize(2)
    for slot in fleet.slots:
        slot.engine_version = 0
    sampler = SimpleNamespace(num_drawn=0)

    def sample(n):
        sampler.num_drawn += n
        return [{"question": f"q{sampler.num_drawn - n + i}"} for i in range(n)]

    sampler.sample = sample
    buffer = Buffer(results)
    pipeline = Pipeline(lambda: cfg, fleet, buffer, learner=None, sampler=sampler)
    # staleness 0, batch 4, 4 trajectories per call: one call at version 0 fills the batch
    assert pipeline.admit(policy_version=0) == 4
    assert [len(a.calls) for a in (s.handle for s in fleet.slots)] == [1, 0]
    assert fleet.slots[0].handle.calls[0][1] == 0  # waits for its version to land
    assert pipeline.admit(policy_version=0) == 0  # in flight counts: no second call
    assert fleet.in_flight_counts(4) == {0: 4}
    # the call finishes: its trajectories are stamped and buffered, the slot is free
    slot, call = fleet.owner("ref-0-1")
    results["ref-0-1"] = [SimpleNamespace(extra={}) for _ in range(4)]
    trajectories = fleet.finish(slot, call)
    assert pipeline.accept(trajectories, call.first_draw, attempt=2) == 4
    assert [t.extra["trajectory_id"] for t in trajectories] == [
        "a2-d0-g0", "a2-d0-g1", "a2-d1-g0", "a2-d1-g1"
    ]  # fmt: skip
    window = fleet.take_window()
    assert window.calls_running_max == 1 and len(window.durations_s) == 1


def test_a_step_starts_only_with_a_full_batch_and_nothing_older_in_flight(results):
    cfg = config(**{"learner.train_batch_size": 4})
    fleet = Fleet(cfg, Actor)
    buffer = Buffer(results)
    learner = SimpleNamespace(step=SimpleNamespace(remote=lambda trajectories: "step-ref"))
    pipeline = Pipeline(lambda: cfg, fleet, buffer, learner, sampler=None)
    buffer.ready = {0: 3}
    assert pipeline.start_step(0) is None  # too few
    buffer.ready = {1: 4}
    fleet.resize(1)
    fleet.slots[0].engine_version = 0
    fleet.submit(fleet.slots[0], [{"question": "q"}], 0)  # an older call (version 0) runs
    assert pipeline.start_step(1) is None  # oldest first
    fleet.abandon_running()
    take = pipeline.start_step(1)
    assert take is not None and pipeline.refs() == ["step-ref"] and pipeline.owns("step-ref")
    assert pipeline.start_step(1) is None  # one step at a time
    results["step-ref"] = SimpleNamespace(
        to_dict=lambda: {"policy_version": 2, "variant": "st_ppo"}
    )
    metrics, step = pipeline.finish_step(2, "st_ppo")
    assert metrics["policy_version"] == 2 and step.take is take and pipeline.step is None
    pipeline.step = step
    with pytest.raises(RuntimeError, match="learner trained st_ppo but the live config says ppo"):
        pipeline.finish_step(2, "ppo")


def test_crashes_are_judged_and_end_the_busy_interval(results):
    cfg = config(**{"ray.max_actor_restarts": 1})
    fleet = Fleet(cfg, Actor)
    fleet.resize(1)
    slot = fleet.slots[0]
    slot.engine_version = 0
    fleet.submit(slot, [{"question": "q"}], 0)
    assert slot.busy_since is not None
    fleet.on_crash(slot, RuntimeError("killed"))  # 1 of max_restarts + 1 = 2: survived
    assert slot.running == [] and slot.busy_since is None
    fleet.on_crash(slot, RuntimeError("killed"))
    with pytest.raises(RolloutActorLost, match="crashed 3 times in a row"):
        fleet.on_crash(slot, RuntimeError("killed"))
    init_failed = RuntimeError("Traceback\nAttributeError: no attribute 'x'")
    init_failed.actor_init_failed = True
    with pytest.raises(RolloutActorLost, match="failed to start: AttributeError: no attribute 'x'"):
        fleet.on_crash(slot, init_failed)


def test_stamp_ids_are_unique_across_attempts():
    first = [SimpleNamespace(extra={}) for _ in range(4)]
    stamp_ids(first, first_draw=6, group_size=2, attempt=1)
    assert [t.extra["trajectory_id"] for t in first] == [
        "a1-d6-g0",
        "a1-d6-g1",
        "a1-d7-g0",
        "a1-d7-g1",
    ]
