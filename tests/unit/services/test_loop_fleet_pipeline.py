"""The rollout fleet and the pipeline (services.loop.fleet, services.loop.pipeline) with fake
actors and the real in-process buffer: admission keeps the staleness bound, a step starts
only when it may, nothing is taken twice, crashes are judged, busy time is counted once."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from learner_factories import make_trajectory

pytest.importorskip("ray")

from services.config import load_config, update_config
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


def at_version(version: int, n: int) -> list:
    """``n`` valid trajectories generated at ``version``."""
    t = make_trajectory([1, 2], [3, 4], [1, 1])
    return [dataclasses.replace(t, policy_version_min=version, policy_version_max=version,
                                extra={}) for _ in range(n)]  # fmt: skip


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
    pipeline = Pipeline(lambda: cfg, fleet, learner=None, sampler=sampler)
    # staleness 0, batch 4, 4 trajectories per call: one call at version 0 fills the batch
    assert pipeline.admit(policy_version=0) == 4
    assert [len(a.calls) for a in (s.handle for s in fleet.slots)] == [1, 0]
    assert fleet.slots[0].handle.calls[0][1] == 0  # waits for its version to land
    assert pipeline.admit(policy_version=0) == 0  # in flight counts: no second call
    assert fleet.in_flight_counts(4) == {0: 4}
    # the call finishes: its trajectories are stamped and buffered, the slot is free
    slot, call = fleet.owner("ref-0-1")
    results["ref-0-1"] = at_version(0, 4)
    outcome = fleet.finish(slot, call)
    assert outcome.crash is None and not outcome.died
    trajectories = outcome.trajectories
    assert pipeline.accept(trajectories, call.first_draw, attempt=2) == 4
    assert [t.extra["trajectory_id"] for t in trajectories] == [
        "a2-d0-g0", "a2-d0-g1", "a2-d1-g0", "a2-d1-g1"
    ]  # fmt: skip
    window = fleet.take_window()
    assert window.calls_running_max == 1 and len(window.durations_s) == 1
    # buffered counts as unconsumed: still no second call at staleness 0
    assert pipeline.buffer_stats().depth == 4 and pipeline.admit(policy_version=0) == 0


def test_a_step_starts_only_with_a_full_batch_and_nothing_older_in_flight(results):
    cfg = config(**{"learner.train_batch_size": 4})
    fleet = Fleet(cfg, Actor)
    sent: list = []
    learner = SimpleNamespace(step=SimpleNamespace(remote=lambda t: sent.append(t) or "step-ref"))
    pipeline = Pipeline(lambda: cfg, fleet, learner, sampler=None)
    pipeline.buffer.put(at_version(1, 3))
    assert pipeline.start_step(1) is None  # too few
    pipeline.buffer.put(at_version(1, 2))
    fleet.resize(1)
    fleet.slots[0].engine_version = 0
    fleet.submit(fleet.slots[0], [{"question": "q"}], 0)  # an older call (version 0) runs
    assert pipeline.start_step(1) is None  # oldest first
    fleet.abandon_running()
    take = pipeline.start_step(1)
    assert take is not None and pipeline.refs() == ["step-ref"] and pipeline.owns("step-ref")
    assert len(sent) == 1 and len(sent[0]) == 4 and take.staleness == [0] * 4
    assert pipeline.start_step(1) is None  # one step at a time
    stats = pipeline.buffer_stats()
    assert (stats.depth, stats.taken_total, stats.put_total) == (1, 4, 5)  # taken once
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


def test_the_buffer_reads_the_live_bound_and_accounts_for_every_trajectory(results):
    """The one copy of ``buffer.max_staleness`` is the live config: a change applies at the
    next call with nothing pushed. Every accepted trajectory is taken once, dropped and
    counted, or still held (what the buffer actor guaranteed, now in the driver's process)."""
    live = {"cfg": config(**{"learner.train_batch_size": 4, "buffer.max_staleness": 2})}
    fleet = Fleet(live["cfg"], Actor)
    learner = SimpleNamespace(step=SimpleNamespace(remote=lambda t: "step-ref"))
    pipeline = Pipeline(lambda: live["cfg"], fleet, learner, sampler=None)
    batches = [at_version(v, 4) for v in (0, 1, 2)]
    for k, batch in enumerate(batches):
        assert pipeline.accept(batch, first_draw=2 * k, attempt=1) == 4
    assert pipeline.buffer.ready_counts(2) == {0: 4, 1: 4, 2: 4}
    assert pipeline.buffer_stats().capacity == 64  # max(64, (2 + 1) * 4)
    live["cfg"] = update_config(live["cfg"], {"buffer": {"max_staleness": 1, "capacity": 1}})
    assert pipeline.buffer.ready_counts(2) == {1: 4, 2: 4}  # version 0 is over the new bound
    assert pipeline.buffer_stats().capacity == 8  # (1 + 1) * 4: admission's need
    take = pipeline.start_step(2)
    assert take.dropped_stale == 4 and {t.policy_version_min for t in take.trajectories} == {1}
    ids = [t.extra["trajectory_id"] for batch in batches for t in batch]
    assert len(set(ids)) == 12
    s = pipeline.buffer_stats()
    assert s.put_total == s.taken_total + s.dropped_stale_total + s.depth == 12


def test_one_place_tells_a_dead_actor_and_lost_weights_from_a_good_result():
    """:func:`services.loop.fleet.rollout_outcome`, what the training loop and the
    evaluations both read a rollout through."""
    import ray

    from services.loop.fleet import rollout_outcome

    good = rollout_outcome(lambda: at_version(3, 2), expected_version=3)
    assert good.crash is None and not good.died and len(good.trajectories) == 2
    restarted = rollout_outcome(lambda: at_version(0, 2), expected_version=3)
    assert not restarted.died and len(restarted.trajectories) == 2  # stamped, kept
    assert "lost its weights" in str(restarted.crash)

    def dead():
        raise ray.exceptions.RayActorError()

    died = rollout_outcome(dead, expected_version=3)
    assert died.died and died.trajectories == []
    assert isinstance(died.crash, ray.exceptions.RayActorError)
