"""The stability guard (services/loop/guard.py): scripted signal sequences, Ray-free.

A forced fall (the decoupled objective's behaviour log-ratio rising from step 12, then the
rollouts' malformed share) must make the guard act at the step its rules say, through the
control plane, along the ladder; a healthy sequence is left alone. Each of these goes red
when the guard is off or a rule's comparison is inverted.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from prometheus_client import CollectorRegistry

from services.config import ConfigError, GuardRule, load_config
from services.control import ControlState
from services.loop.autopilot import Autopilot, log_line, summary_line
from services.loop.guard import Guard, plan_action, rule_holds
from services.metrics import TrainingMetrics, exported_metric_names

DECOUPLED = [
    "algorithm.variant=st_ppo",
    "algorithm.off_policy=decoupled",
    "buffer.max_staleness=16",
    "guard.mode=act",
]


def healthy(n: int = 40) -> list[dict]:
    """A run that learns and holds: small, noisy signals throughout."""
    return [
        {"step": i, "behavior_log_ratio_abs_mean": 0.01 + 0.002 * (i % 3),
         "malformed_rate": 0.03 * (i % 2), "approx_kl": 0.002, "grad_norm": 0.4,
         "success_rate": 0.5}
        for i in range(1, n + 1)
    ]  # fmt: skip


def falling(n: int = 40, start: int = 12) -> list[dict]:
    """A forced fall: from step ``start`` the behaviour log-ratio grows by 0.03 a step; the
    malformed share follows from step 30."""
    out = healthy(n)
    for r in out:
        i = r["step"]
        if i >= start:
            r["behavior_log_ratio_abs_mean"] = 0.01 + 0.03 * (i - start + 1)
        if i >= 30:
            r["malformed_rate"] = min(1.0, 0.2 * (i - 29))
    return out


def run(records, cfg, control=None, guard=None):
    guard = guard or Guard()
    control = control or ControlState(config=cfg)
    decisions = []
    for record in records:
        live = control.take_pending() or cfg  # applied at the step boundary, as the driver does
        if live is not cfg:
            control.publish(config=live)
            cfg = live
        decisions.append(
            guard.observe(
                record, cfg, control.person_fields,
                lambda changes: control.request_change(changes, source="guard"),
            )
        )  # fmt: skip
    return decisions, cfg, guard


def first(decisions, level):
    return next((d for d in decisions if d.level == level), None)


def test_a_forced_fall_makes_the_guard_act_at_the_expected_step_and_climb_the_ladder():
    cfg = load_config(None, DECOUPLED)
    decisions, final, guard = run(falling(), cfg)
    act = first(decisions, "act")
    # 0.04, 0.07, 0.10, 0.13, 0.16 at steps 12-16: the 3-step trailing mean is 0.10 at
    # step 15 (not above 0.1) and 0.13 at step 16
    assert act is not None and act.step == 16
    assert act.rule == "behavior_log_ratio_abs_mean > 0.1"
    assert act.action == "lower_staleness"
    assert act.before == {"buffer.max_staleness": 16} and act.after == {"buffer.max_staleness": 4}
    assert act.signals["behavior_log_ratio_abs_mean"] == pytest.approx(0.13)
    # cooldown 5: the first step that still applies, at 21 (4 -> 1) and 26 (the objective)
    acts = [(d.step, d.action, d.after) for d in decisions if d.level == "act"]
    assert acts == [
        (16, "lower_staleness", {"buffer.max_staleness": 4}),
        (21, "lower_staleness", {"buffer.max_staleness": 1}),
        (26, "behavior_objective", {"algorithm.off_policy": "behavior"}),
    ]
    assert final.buffer.max_staleness == 1
    assert final.algorithm.off_policy == "behavior" and final.algorithm.rollout_correction is None
    assert final.learner.actor_lr == cfg.learner.actor_lr  # the budget (3) ended the ladder
    # budget of 3 spent: later decisions say so and change nothing
    later = [d for d in decisions if d.step > 26 and d.would_act]
    assert later and all(d.level == "warn" for d in later)
    assert {d.reason for d in later} <= {"cooldown", "budget spent"}
    assert len(guard.actions) == 3


def test_a_healthy_run_is_left_alone():
    cfg = load_config(None, DECOUPLED)
    decisions, final, _ = run(healthy(), cfg)
    assert all(d.level == "ok" for d in decisions)
    assert final is cfg


def test_the_behaviour_objective_falls_by_its_malformed_share():
    """Under the default objective no behaviour log-ratio is logged; a format collapse acts."""
    cfg = load_config(None, ["buffer.max_staleness=8", "guard.mode=act"])
    records = falling()
    for r in records:
        del r["behavior_log_ratio_abs_mean"]
    decisions, final, _ = run(records, cfg)
    act = first(decisions, "act")
    # malformed 0.2, 0.4, 0.6, 0.8 at steps 30-33: the trailing mean passes 0.5 at step 33
    assert act is not None and (act.step, act.rule) == (33, "malformed_rate > 0.5")
    assert act.after == {"buffer.max_staleness": 2}
    assert final.buffer.max_staleness == 1  # and 2 -> 1 at step 38, after the cooldown


def test_mode_off_decides_nothing_and_mode_warn_changes_nothing():
    off = load_config(None, [*DECOUPLED, "guard.mode=off"])
    decisions, final, _ = run(falling(), off)
    assert all(d.level == "ok" for d in decisions) and final is off
    warn = load_config(None, [*DECOUPLED, "guard.mode=warn"])
    decisions, final, guard = run(falling(), warn)
    assert final is warn and not guard.actions
    would = [d for d in decisions if d.would_act]
    assert would[0].step == 16 and would[0].action == "lower_staleness"
    assert would[0].reason == "mode warn" and would[0].level == "warn"


def test_a_person_pauses_the_guard_and_is_never_undone():
    cfg = load_config(None, DECOUPLED)
    control = ControlState(config=cfg)
    control.request_change({"buffer": {"max_staleness": 12}})  # a person, before the fall
    decisions, final, _ = run(falling(), cfg, control)
    acts = [(d.step, d.action) for d in decisions if d.level == "act"]
    assert acts[0] == (16, "behavior_objective")  # the staleness step is the person's
    assert final.buffer.max_staleness == 12
    assert "lower_staleness" not in {a for _, a in acts}
    # pausing: a person's guard.mode=warn through the same control plane
    paused = ControlState(config=cfg)
    paused.request_change({"guard": {"mode": "warn"}})
    decisions, final, guard = run(falling(), cfg, paused)
    assert final.guard.mode == "warn" and not guard.actions
    assert final.buffer.max_staleness == 16


def test_a_refused_step_is_skipped_for_the_next():
    cfg = load_config(None, DECOUPLED)

    def refuse_staleness(changes):
        if "buffer" in changes:
            raise ConfigError("buffer.max_staleness: refused")
        return ["algorithm.off_policy"]

    guard = Guard()
    decisions = [guard.observe(r, cfg, (), refuse_staleness) for r in falling()]
    act = first(decisions, "act")
    assert act.action == "behavior_objective" and "refused" in act.reason


def test_plan_action_applies_only_where_it_tightens():
    g = load_config().guard
    on_policy = load_config(None, ["buffer.max_staleness=1"])
    assert plan_action("lower_staleness", on_policy, g) is None  # already at min_staleness
    assert plan_action("behavior_objective", on_policy, g) is None  # the default objective
    lagged = load_config(None, ["buffer.max_staleness=8", "sync.every_k_steps=9"])
    plan = plan_action("lower_staleness", lagged, g)
    assert plan.changes == {"buffer": {"max_staleness": 2}, "sync": {"every_k_steps": 3}}
    with pytest.raises(ValueError, match="unknown guard action"):
        plan_action("reboot", lagged, g)


def test_rules_compare_in_their_direction():
    above = GuardRule(signal="malformed_rate", above=0.5)
    below = GuardRule(signal="success_rate", below=0.1, level="warn")
    assert rule_holds(above, 0.6) and not rule_holds(above, 0.5)
    assert not rule_holds(above, math.nan)
    assert rule_holds(below, 0.05) and not rule_holds(below, 0.2)
    assert above.name == "malformed_rate > 0.5" and below.name == "success_rate < 0.1"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("guard.mode=always", "guard.mode"),
        ("guard.window=0", "guard.window"),
        ("guard.patience=0", "guard.patience"),
        ("guard.staleness_factor=1.0", "guard.staleness_factor"),
        ("guard.ladder=['rollback']", "guard.ladder.0"),
        ('guard.rules=[{signal="malformed_rate"}]', "guard.rules.0"),
        ('guard.rules=[{signal="Bad-Name",above=1}]', "guard.rules.0.signal"),
    ],
)
def test_an_invalid_guard_section_fails_at_load_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=re.escape(f"{field}:")):
        load_config(None, [override])


def test_the_default_guard_only_warns():
    assert load_config().guard.mode == "warn"


def test_the_autopilot_requests_through_the_control_plane_and_writes_its_decisions(tmp_path):
    """The driver's part: the guard's action is a pending change of the control plane (not
    a person's), and each decision goes to guard.jsonl, the metrics and the progress."""
    from types import SimpleNamespace

    from services.run_records import Lineage, RecordWriter

    cfg = load_config(None, DECOUPLED)
    control = ControlState(config=cfg)
    metrics = TrainingMetrics(CollectorRegistry())
    said: list[str] = []
    services = SimpleNamespace(records=RecordWriter(tmp_path, Lineage("r1", 1)), metrics=metrics)
    pilot = Autopilot(control, services, said.append)
    for record in falling(20):
        pilot.step(record, cfg)
    pending = control.take_pending()
    assert pending is not None and pending.buffer.max_staleness == 4
    assert control.person_fields == set()  # the guard's change is not a person's
    logged = [json.loads(line) for line in (tmp_path / "guard.jsonl").read_text().splitlines()]
    assert logged[0]["step"] == 16  # nothing held before (approx_kl quiet)
    act = logged[0]
    assert {"step", "signals", "rule", "action", "before", "after", "mode"} <= set(act)
    assert act["level"] == "act" and act["after"] == {"buffer.max_staleness": 4}
    assert any(m.startswith("guard act at step 16") for m in said)
    assert len(said) < len(logged)  # repeated warnings are not repeated on the console
    names = exported_metric_names(metrics.registry)
    assert {"stppo_guard_level", "stppo_guard_decisions_total", "stppo_guard_actions_total",
            "stppo_guard_signal"} <= names  # fmt: skip
    assert metrics.guard_actions_total.labels(action="lower_staleness")._value.get() == 1
    line = summary_line(tmp_path, "act")
    assert line.startswith("stability guard (mode act): ")
    assert "acted: lower_staleness at step 16" in line
    assert log_line([], "warn") == "stability guard (mode warn): no warning"
    assert summary_line(tmp_path / "none", "warn") == "stability guard (mode warn): no warning"


def test_a_signal_that_stops_being_logged_stops_holding():
    """After the switch to the behaviour objective the behaviour log-ratio is no longer
    logged: its old values leave the window and the guard takes no further action on them."""
    cfg = load_config(None, [*DECOUPLED, "guard.cooldown_steps=0", "guard.ladder=['lower_lr']",
                             "guard.max_actions=10"])  # fmt: skip
    records = falling(20)
    for r in records[16:]:  # steps 17-20: no longer logged
        del r["behavior_log_ratio_abs_mean"]
    guard = Guard()
    decisions = [guard.observe(r, cfg, (), lambda changes: None) for r in records]
    acts = [d.step for d in decisions if d.level == "act"]
    # steps 17 and 18 still have a logged value (0.13, 0.16) in their 3-step window; from
    # step 19 the window has none
    assert acts == [16, 17, 18]
    assert decisions[-1].level == "ok" and math.isnan(decisions[-1].signals[
        "behavior_log_ratio_abs_mean"])  # fmt: skip
