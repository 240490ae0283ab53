"""The evaluations ``run.eval_every`` adds between learner steps (services.loop.phases), with
the fleet, the weight sync and Ray's wait faked. The whole path with real engines is
``tests/integration/test_driver.py::test_async_run_with_live_variant_change_and_actor_crash``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from services.config import load_config  # noqa: E402
from services.loop import phases as phases_module  # noqa: E402
from services.loop.phases import Phases  # noqa: E402


def phases_for(**run: int) -> Phases:
    cfg = load_config(None, [f"run.{k}={v}" for k, v in run.items()])
    return Phases(lambda: cfg, None, None, None, "", None)


@pytest.mark.parametrize(
    ("run", "due"),
    [
        ({"eval_every": 4, "num_steps": 10}, [4, 8]),  # 10 is not a multiple: the end's
        ({"eval_every": 5, "num_steps": 10}, [5]),  # 10 is the last step: the end's
        ({"eval_every": 1, "num_steps": 3}, [1, 2]),
        ({"eval_every": 20, "num_steps": 10}, []),
        ({"eval_every": 0, "num_steps": 10}, []),  # only at start and end
        ({"eval_every": 2, "num_steps": 10, "eval_questions": 0}, []),  # no evaluation at all
    ],
)
def test_an_evaluation_is_due_after_every_multiple_before_the_last_step(run, due):
    phases = phases_for(**run)
    assert [n for n in range(0, 11) if phases.eval_due(n)] == due


def test_the_rollouts_in_flight_land_then_the_weights_then_the_evaluation(monkeypatch):
    events: list[tuple] = []
    running = ["r1", "r2", "r3"]  # the training rollout calls in flight

    def route(ref):  # the driver's: buffers the call's trajectories
        events.append(("route", ref))
        running.remove(ref)

    fleet = SimpleNamespace(refs=lambda: list(running))
    sync = SimpleNamespace(push_final=lambda version: events.append(("push_final", version)))
    report = SimpleNamespace(pause_window=lambda s: events.append(("pause_window",)))
    monkeypatch.setattr(phases_module.ray, "wait", lambda refs, num_returns: (refs[-1:], []))
    cfg = load_config(None, ["run.eval_every=2", "run.num_steps=6"])
    phases = Phases(lambda: cfg, fleet, sync, None, "", report)

    def evaluate(tag, step, version, extra):
        events.append(("evaluate", tag, step, version, sorted(extra)))
        return 1  # an actor crashed in it

    monkeypatch.setattr(phases, "evaluate", evaluate)
    crashes = phases.evaluate_midway(SimpleNamespace(learner_step=4, policy_version=7), route)
    assert crashes == 1
    assert events == [
        ("route", "r3"), ("route", "r2"), ("route", "r1"),  # every one, as each finished
        ("push_final", 7),  # the step's weights, every load waited for
        ("evaluate", "step_4", 4, 7, ["wait_s"]),
        ("pause_window",),  # the evaluation is not rollout time
    ]  # fmt: skip
