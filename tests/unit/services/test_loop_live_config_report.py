"""A new config into effect (services.loop.live_config) and the step record
(services.loop.report), with fake handles and outputs: Ray-free parts."""

from __future__ import annotations

import math
from types import SimpleNamespace

from services.config import load_config, update_config
from services.loop.checkpoint import DriverState
from services.loop.fleet import FleetWindow
from services.loop.live_config import Targets, apply_config, restore_live_fields
from services.loop.report import Report, token_staleness_summary


class Handle:
    """An actor handle whose ``x.remote(*args)`` records ``(x, args)`` and returns it."""

    def __init__(self, calls: list) -> None:
        self._calls = calls

    def __getattr__(self, name):
        return SimpleNamespace(remote=lambda *args: self._calls.append((name, args)) or 7)


class FakeFleet:
    def __init__(self, n: int) -> None:
        self.slots, self.interrupts = list(range(n)), []

    def set_interrupt(self, slots, every):
        self.interrupts.append((len(slots), every))

    def resize(self, n):
        added = list(range(len(self.slots), n))
        self.slots = list(range(n))
        return added


class Buffer:
    """The driver's buffer as live changes see it: only a lowered bound calls it."""

    def __init__(self, calls: list) -> None:
        self._calls = calls

    def purge_stale(self, policy_version):
        self._calls.append(("purge_stale", (policy_version,)))
        return 7


def targets(calls, fleet):
    return Targets(Buffer(calls), Handle(calls), fleet, wait=lambda ref: ref)


def test_a_live_change_pushes_only_what_changed_and_purges_on_a_lower_bound():
    old = load_config(None, ["buffer.max_staleness=4", "rollout.num_actors=1"])
    new = update_config(old, {"buffer": {"max_staleness": 2}, "learner": {"actor_lr": 1e-4}})
    calls: list = []
    applied = apply_config(old, new, targets(calls, FakeFleet(1)), policy_version=9)
    names = [name for name, _ in calls]
    # the buffer reads the bound itself: only the purge of what is over the lower bound
    assert names == ["purge_stale", "set_lr"]
    assert ("purge_stale", (9,)) in calls and applied.purged == 7  # the fake "returns" 7
    assert "buffer.max_staleness" in applied.fields and "learner.actor_lr" in applied.fields
    assert applied.new_slots == []
    # more actors: the new slots come back (they need the current weights)
    more = update_config(new, {"rollout": {"num_actors": 3}})
    assert apply_config(new, more, targets([], FakeFleet(1)), 9).new_slots == [1, 2]


def test_a_resume_pushes_everything_and_restores_the_live_fields():
    cli = load_config(None, ['algorithm.variant="ppo"', "buffer.max_staleness=1"])
    saved = update_config(cli, {"algorithm": {"variant": "gspo"}, "buffer": {"max_staleness": 3}})
    restored = restore_live_fields(cli, saved.model_dump(mode="json"))
    assert restored.algorithm.variant == "gspo" and restored.buffer.max_staleness == 3
    calls: list = []
    fleet = FakeFleet(1)
    apply_config(None, restored, targets(calls, fleet), policy_version=0)
    names = {name for name, _ in calls}
    assert names == {"set_algorithm", "set_lr"}  # the buffer reads the restored config
    assert fleet.interrupts == [(1, restored.rollout.interrupt_every_tokens)]


def test_a_checkpoint_of_an_earlier_version_resumes_under_the_behaviour_objective():
    """Earlier versions dumped the decoupled objective's default correction with every
    config, ``behavior`` ones too, where it did nothing and may no longer be set."""
    cli = load_config(None, ['algorithm.variant="ppo"'])
    saved = cli.model_dump(mode="json")
    saved["algorithm"]["rollout_correction"] = {"is_level": "token", "is_cap": 2.0}
    assert saved["algorithm"]["off_policy"] == "behavior"
    restored = restore_live_fields(cli, saved)
    assert restored.algorithm.rollout_correction is None
    # a decoupled run's correction is its own: restored as it was
    decoupled = update_config(
        cli, {"algorithm": {"off_policy": "decoupled", "rollout_correction": {"is_cap": 3.0}}}
    )
    again = restore_live_fields(cli, decoupled.model_dump(mode="json"))
    assert again.algorithm.rollout_correction.is_cap == 3.0


class Recorder:
    def __init__(self):
        self.lines, self.steps = [], []

    def append(self, name, record):
        self.lines.append((name, record))

    def say(self, message):
        self.steps.append(message)

    def step(self, record):
        self.steps.append(record)


def test_the_step_record_has_the_learner_metrics_and_the_loop_fields():
    records = Recorder()
    metrics = SimpleNamespace(
        **{name: SimpleNamespace(inc=lambda *a: None, set=lambda *a: None) for name in (
            "nonfinite_steps_total", "trajectories_per_s", "rollout_tokens_per_s",
            "trajectories_consumed_total")},
    )  # fmt: skip
    run = load_config(None, ["run.samples_per_step=0"]).run
    report = Report(records, metrics, records, None, None, run)
    take = SimpleNamespace(
        trajectories=[SimpleNamespace(malformed_reason="", extra={}, transcript=None)] * 2,
        staleness=[1, 3], token_staleness={1: 10, 3: 30},
    )  # fmt: skip
    state = DriverState(learner_step=5, policy_version=5, trajectories_generated=10,
                        trajectories_dropped_stale=1)  # fmt: skip
    record = report.step_record(
        {"clip_ratio": 0.1, "variant": "st_ppo", "turn_advantages": []}, take, state,
        variant="st_ppo", wall_s=2.0, elapsed_s=9.0,
        window=FleetWindow(busy_s=1.5, calls_running_max=2, durations_s=[1.0, 3.0]),
        buffer_stats=SimpleNamespace(dropped_stale_total=1, depth=4),
    )  # fmt: skip
    assert record["clip_ratio"] == 0.1 and "turn_advantages" not in record
    assert (record["step"], record["staleness_mean"], record["staleness_max"]) == (5, 2.0, 3)
    assert record["staleness_token_mean"] == 2.5  # (1 * 10 + 3 * 30) / 40
    assert record["rollout_s_mean"] == 2.0 and record["rollout_busy_s"] == 1.5
    assert record["waste_fraction"] == 0.1 and record["trained_variant"] == "st_ppo"
    summary = token_staleness_summary({})
    assert math.isnan(summary["staleness_token_mean"]) and summary["staleness_token_max"] == -1
