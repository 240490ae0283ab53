"""The expected wall time printed at the start of a CPU run (services/estimate.py)."""

from __future__ import annotations

import pytest

from services import estimate
from services.config import load_config

PARAMS = 134_515_008  # SmolLM2-135M


@pytest.fixture
def demo():
    return load_config("deploy/configs/cpu_demo.toml")


def by_name(phases: list[estimate.Phase]) -> dict[str, float]:
    return {p.name.split(" ")[-1] if p.name[0].isdigit() else p.name: p.seconds for p in phases}


def test_a_kept_warm_start_is_loaded_not_trained(demo):
    kept = by_name(estimate.expected_phases(demo, PARAMS, 0.3, warm_start_kept=True))
    trained = by_name(estimate.expected_phases(demo, PARAMS, 0.3, warm_start_kept=False))
    assert kept["warm start"] == estimate.WARM_START_LOAD_S
    assert trained["warm start"] > 3 * kept["warm start"]  # 6 SFT steps at 0.3 TFLOP/s
    assert {k: v for k, v in kept.items() if k != "warm start"} == {
        k: v for k, v in trained.items() if k != "warm start"
    }


def test_compute_phases_scale_inversely_with_the_cpu_speed(demo):
    slow = by_name(estimate.expected_phases(demo, PARAMS, 0.1, warm_start_kept=False))
    fast = by_name(estimate.expected_phases(demo, PARAMS, 0.4, warm_start_kept=False))
    assert slow["step(s)"] == pytest.approx(4 * fast["step(s)"])
    assert slow["evaluation(s)"] == pytest.approx(4 * fast["evaluation(s)"])
    assert slow["start-up"] == fast["start-up"]


def test_a_critic_and_a_recomputed_proximal_cost_learner_time(demo):
    from services.config import update_config

    def rl_seconds(cfg) -> float:
        # a synchronous run (bound 0) adds the rollout to the learner step instead of
        # overlapping them, so the learner's share shows whatever the rollout costs
        cfg = update_config(cfg, {"buffer": {"max_staleness": 0}})
        return by_name(estimate.expected_phases(cfg, PARAMS, 0.3, True))["step(s)"]

    grpo = update_config(demo, {"algorithm": {"variant": "grpo"}})
    ppo = update_config(demo, {"algorithm": {"variant": "ppo", "off_policy": "behavior"}})
    decoupled = update_config(demo, {"algorithm": {"variant": "ppo", "off_policy": "decoupled"}})
    assert rl_seconds(grpo) < rl_seconds(ppo) < rl_seconds(decoupled)


def test_evaluations_are_counted_as_the_driver_runs_them(demo):
    from services.config import update_config

    assert estimate.evaluations(demo) == 2 - 0  # start of RL and the end
    every = update_config(demo, {"run": {"eval_every": 4, "num_steps": 10}})
    assert estimate.evaluations(every) == 2 + 2  # after steps 4 and 8
    before = update_config(demo, {"run": {"eval_before_warm_start": True}})
    assert estimate.evaluations(before) == 3
    sampled = update_config(demo, {"run": {"eval_sampled": True}})
    assert estimate.evaluations(sampled) == 2 * (1 + demo.rollout.group_size)
    assert estimate.evaluations(update_config(demo, {"run": {"eval_questions": 0}})) == 0


def test_the_line_states_the_total_and_each_phase(demo):
    phases = [estimate.Phase("start-up", 45.0), estimate.Phase("warm start", 30.0, "kept")]
    line = estimate.render(phases, "fp32", 0.14)
    assert line == (
        "expected on this CPU (fp32 matmul 0.14 TFLOP/s): about 1 min 15 s: "
        "start-up 45 s, warm start 30 s (kept)"
    )
    assert estimate.fmt_minutes(462) == "7 min 40 s"
    assert estimate.fmt_minutes(600) == "10 min"


def test_the_matmul_is_timed_on_this_cpu():
    assert 0.0 < estimate.matmul_tflops("fp32", threads=1, seconds=0.05) < 100.0
