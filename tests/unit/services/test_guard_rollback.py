"""The stability guard's rollback (services/loop/guard.py, guard_state.py, ladder.py,
checkpoint.py, autopilot.py, restore.py), Ray-free: which checkpoint a rollback goes to, the rollback
budget and the stop, the retention that keeps the last good checkpoint, the guard's state
through a checkpoint and a resume.

The fall is the one of test_guard.py: the behaviour log-ratio grows by 0.03 a step from
step 12 (0.04, 0.07, 0.10, 0.13, 0.16 at steps 12-16), so with the default rule (3-step
trailing mean > 0.1) the guard acts at step 16, and the signal began at step 15 (the first
step of that window whose own value is past 0.1: 0.10 at step 14 is not). A fake driver
(:func:`drive`) does what services/driver.py does with the decisions: checkpoints every
``every`` steps with the guard's state, rolls back (the guard's windows back to the
checkpoint's, the records replayed from the step after it), stops.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from test_guard import DECOUPLED, falling, healthy

from services.config import load_config
from services.control import ControlState
from services.loop.autopilot import Autopilot, log_line, progress_line
from services.loop.checkpoint import CheckpointStore, DriverState
from services.loop.guard import STOP, Guard, last_good
from services.loop.guard_state import (
    decision_from_record,
    load_state,
    protect_before,
    rewind,
    save_state,
)
from services.loop.restore import rewind_checkpoints
from services.metrics import TrainingMetrics, exported_metric_names
from services.run_records import EXIT_GUARD_STOPPED, GuardStopped, Lineage, RecordWriter


def learner_files(directory: Path) -> None:
    """What a learner's save writes, in small."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "learner_state.json").write_text('{"tag": "step_1"}')


def drive(records, cfg, every, guard=None, control=None, saved=None, limit=200, start=1):
    """Feed ``records`` (by step) to the guard as the driver does: live changes applied at
    the step boundary, a checkpoint (the guard's state) every ``every`` steps unless the
    step rolled back, a rollback replays from the step after its checkpoint, a stop ends.

    Returns:
        (decisions, the live config at the end, the guard, the checkpoints {step: state}).
    """
    guard = guard or Guard()
    control = control or ControlState(config=cfg)
    saved = {} if saved is None else saved
    by_step = {r["step"]: r for r in records}
    decisions, step = [], start

    def checkpoints():
        return sorted(saved)

    while step in by_step and len(decisions) < limit:
        live = control.take_pending()
        if live is not None:
            control.publish(config=live)
            cfg = live
        decision = guard.observe(
            by_step[step], cfg, control.person_fields,
            lambda changes: control.request_change(changes, source="guard"), checkpoints,
        )  # fmt: skip
        decisions.append(decision)
        if decision.stops:
            break
        if decision.rollback_to is not None:
            to = decision.rollback_to
            rewind(guard, saved[to])
            saved = {s: st for s, st in saved.items() if s <= to}  # later ones deleted
            saved[to] = save_state(guard)  # the driver checkpoints the rolled-back state
            step = to + 1
            continue
        if step % every == 0:
            saved[step] = json.loads(json.dumps(save_state(guard)))  # as written to disk
        step += 1
    return decisions, cfg, guard, saved


def acts(decisions):
    return [(d.step, d.action, d.rollback_to) for d in decisions if d.level == "act"]


def test_the_rollback_goes_to_the_newest_checkpoint_before_the_signal_began():
    cfg = load_config(None, DECOUPLED)
    guard = Guard()
    control = ControlState(config=cfg)
    request = lambda c: control.request_change(c, source="guard")  # noqa: E731
    decisions = [guard.observe(r, cfg, (), request, lambda: [5, 10, 15]) for r in falling(16)]
    act = decisions[-1]
    assert act.level == "act" and act.action == "lower_staleness"
    # began at 15 (0.13 > 0.1; 0.10 at 14 is not): the checkpoint of step 15 is not before
    # it, the one of step 10 is
    assert act.rollback == {
        "from_step": 16, "signal_began": 15, "to_step": 10, "checkpoint": "step_000010",
        "reason": "",
    }  # fmt: skip
    assert act.rollback_to == 10 and guard.rollbacks == [act.rollback]
    assert control.take_pending().buffer.max_staleness == 4  # and the ladder's change
    assert json.loads(json.dumps(act.record()))["rollback"]["to_step"] == 10
    assert last_good([5, 10, 15], 15) == 10 and last_good([5, 10, 15], 16) == 15
    assert last_good([15, 20], 15) is None and last_good([], 3) is None


def test_without_a_checkpoint_before_the_signal_it_only_tightens():
    cfg = load_config(None, DECOUPLED)
    guard = Guard()
    control = ControlState(config=cfg)
    request = lambda c: control.request_change(c, source="guard")  # noqa: E731
    act = [guard.observe(r, cfg, (), request, lambda: [15]) for r in falling(16)][-1]
    assert act.level == "act" and act.action == "lower_staleness"
    assert act.rollback == {
        "from_step": 16, "signal_began": 15, "to_step": None, "checkpoint": None,
        "reason": "no checkpoint before step 15",
    }  # fmt: skip
    assert act.rollback_to is None and guard.rollbacks == []
    assert control.take_pending().buffer.max_staleness == 4


@pytest.mark.parametrize("override", ["guard.rollback=false", "guard.mode=warn"])
def test_no_rollback_is_considered_with_rollback_off_or_in_mode_warn(override):
    cfg = load_config(None, [*DECOUPLED, override])
    guard = Guard()
    decisions = [guard.observe(r, cfg, (), lambda c: None, lambda: [5, 10]) for r in falling(16)]
    assert decisions[-1].would_act or decisions[-1].level == "act"
    assert all(d.rollback is None and d.rollback_to is None for d in decisions)
    assert guard.rollbacks == []


def test_two_rollbacks_then_the_spent_budget_stops_the_run():
    """The fall comes back after each rollback (the records do not react to the changes):
    rollback to 10 at step 16, again at the replayed step 16, then the stop."""
    cfg = load_config(None, DECOUPLED)
    decisions, final, guard, _ = drive(falling(), cfg, every=5)
    # after the first rollback the replay observes 11..15 (5 steps: the cooldown of 5 has
    # passed at 16, counted in observed steps, not step numbers); at 15 the window's mean is
    # 0.10 again, at 16 0.13: the same fall, the same checkpoint
    assert acts(decisions) == [
        (16, "lower_staleness", 10), (16, "lower_staleness", 10), (16, STOP, None),
    ]  # fmt: skip
    stop = decisions[-1]
    assert stop.stops and stop.reason == "rollback budget spent (2 of 2)"
    assert stop.rollback["to_step"] is None and stop.rollback["signal_began"] == 15
    assert len(guard.rollbacks) == 2 and len(guard.actions) == 2
    assert final.buffer.max_staleness == 1  # 16 -> 4 -> 1; the stop requests nothing
    assert len(decisions) == 16 + 6 + 6  # steps 1-16, then 11-16 twice


def test_a_rollback_budget_of_zero_stops_at_the_first_action():
    cfg = load_config(None, [*DECOUPLED, "guard.max_rollbacks=0"])
    decisions, final, guard, _ = drive(falling(), cfg, every=5)
    assert acts(decisions) == [(16, STOP, None)]
    assert final.buffer.max_staleness == 16 and not guard.actions
    # no checkpoint to go back to: nothing would roll back, so it tightens instead of stopping
    decisions, final, _, _ = drive(falling(), cfg, every=100)
    assert acts(decisions)[0] == (16, "lower_staleness", None)


def test_a_healthy_run_neither_rolls_back_nor_stops():
    cfg = load_config(None, DECOUPLED)
    decisions, _, guard, saved = drive(healthy(), cfg, every=5)
    assert all(d.level == "ok" for d in decisions) and len(decisions) == 40
    assert not guard.rollbacks and sorted(saved) == [5, 10, 15, 20, 25, 30, 35, 40]


def test_the_guard_state_round_trips_through_a_checkpoint_and_a_resume_keeps_the_budget(
    tmp_path: Path,
):
    """Checkpoint the guard (DriverState.guard, written and read by CheckpointStore) after
    the first rollback, resume from it with a new Guard: the resumed run makes the same
    decisions as the run that went on, so its budget is not reset (a fresh guard would roll
    back twice more before stopping)."""
    cfg = load_config(None, DECOUPLED)
    whole, _, _, _ = drive(falling(), cfg, every=5)
    # the run until it has rolled back once and checkpointed at the replayed step 15:
    # steps 1-16, then 11-15 (21 decisions)
    first, live, guard, saved = drive(falling(), cfg, every=5, limit=21)
    assert acts(first) == [(16, "lower_staleness", 10)] and sorted(saved) == [5, 10, 15]
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    path = store.save(15, DriverState(learner_step=15, guard=save_state(guard)), {}, learner_files)
    state, _ = store.load(path)
    resumed = load_state(state.guard)
    assert len(resumed.rollbacks) == 1 and len(resumed.actions) == 1
    assert (resumed.steps_seen, resumed.last_action_seen) == (21, 16)
    assert resumed.decisions == guard.decisions and resumed.began == guard.began
    same = lambda d: [(s, v if not math.isnan(v) else None) for s, v in d]  # noqa: E731
    assert {k: same(v) for k, v in resumed.values.items()} == {
        k: same(v) for k, v in guard.values.items()
    }
    assert save_state(resumed) == json.loads(json.dumps(save_state(guard)))
    # the resume: from step 16 on, under the live config, with the run's checkpoints
    after, _, _, _ = drive(falling(), live, every=5, guard=resumed,
                           control=ControlState(config=live), saved=dict(saved), start=16)  # fmt: skip
    assert acts(after) == acts(whole)[1:]  # the second rollback, then the stop
    assert after[-1].stops and after[-1].reason == "rollback budget spent (2 of 2)"
    # a guard whose budget was reset would roll back twice more before it stops
    fresh, _, _, _ = drive(falling(), live, every=5, control=ControlState(config=live),
                           saved=dict(saved), start=16)  # fmt: skip
    assert [a[2] is not None for a in acts(fresh)] == [True, True, False]
    assert acts(fresh)[-1][1] == STOP


def test_state_of_another_version_is_refused_and_an_old_checkpoint_starts_fresh():
    assert load_state({}).rollbacks == [] and load_state(None).steps_seen == 0
    with pytest.raises(ValueError, match="guard state version 99"):
        load_state({"version": 99})
    with pytest.raises(ValueError, match="guard state version 98"):
        rewind(Guard(), {"version": 98})
    state = DriverState(**{"learner_step": 4})  # a driver_state.json from before the guard's
    assert state.guard == {}


def test_the_retention_keeps_the_last_good_checkpoint(tmp_path: Path):
    """keep_last = 1 and a checkpoint every step: the guard's protect_before keeps the newest
    checkpoint before the earliest step a future signal can have begun at, so the rollback
    at step 16 finds one (without it only step 15's is left: no rollback)."""
    cfg = load_config(None, DECOUPLED)

    def run(protect: bool):
        store = CheckpointStore(tmp_path / f"ck{protect}", keep_last=1, every_k_steps=1)
        guard = Guard()
        for record in falling(16):
            decision = guard.observe(record, cfg, (), lambda c: None, store.steps)
            step = record["step"]
            store.keep_before = protect_before(guard, step, cfg.guard.window) if protect else None
            if decision.level != "act":
                store.save(step, DriverState(learner_step=step), {}, learner_files)
        return decision, store

    decision, store = run(protect=True)
    # at step 15 no rule holds yet (window mean 0.10): a rule first holding at 16 may have
    # begun at 14 (window 14-16) or later, so the newest checkpoint before 14 (13) and the
    # newer ones (14, 15) are kept; at 16 the signal began at 15: 14 is the last good one
    assert decision.rollback_to == 14
    assert store.steps() == [13, 14, 15]
    assert (store.root / "last_good").read_text() == "step_000013"
    # while the rule holds only the last good one is kept besides keep_last
    assert guard_keeps(store, (15, False)) == [14, 16]
    decision, store = run(protect=False)
    assert store.steps() == [15] and decision.rollback_to is None
    assert decision.rollback["reason"] == "no checkpoint before step 15"


def guard_keeps(store: CheckpointStore, keep_before) -> list[int]:
    store.keep_before = keep_before
    store.save(16, DriverState(learner_step=16), {}, learner_files)
    return store.steps()


def test_protect_before_follows_the_holding_rule(tmp_path: Path):
    cfg = load_config(None, DECOUPLED)
    guard = Guard()
    for record in falling(18):
        guard.observe(record, cfg)
        if record["step"] == 10:
            assert protect_before(guard, 10, 3) == (9, True)  # nothing holds: 10 - 3 + 2
    # from 16 the rule holds; its signal began at 15, and stays there while it holds
    assert guard.began == {"behavior_log_ratio_abs_mean > 0.1": 15}
    assert protect_before(guard, 18, 3) == (15, False)
    # a warn rule that holds does not pin it (it never rolls back)
    warn = load_config(
        None, [*DECOUPLED, 'guard.rules=[{signal="approx_kl",above=0.001,level="warn"}]']
    )
    guard = Guard()
    for record in falling(18):
        guard.observe(record, warn)
    assert guard.began == {"approx_kl > 0.001": 1} and protect_before(guard, 18, 3) == (17, True)


def test_a_rollback_rewinds_latest_and_deletes_the_later_checkpoints(tmp_path: Path):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=3)
    for step in (2, 4, 6):
        store.save(step, DriverState(learner_step=step), {}, learner_files)
    (store.root / "step_000008.partial").mkdir()
    removed = rewind_checkpoints(store, store.root / "step_000004")
    assert removed == ["step_000006", "step_000008.partial"]
    assert store.steps() == [2, 4] and store.latest().name == "step_000004"
    assert (store.root / "last_good").read_text() == "step_000004"
    assert store.last_saved_step == 4
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        rewind_checkpoints(store, store.root / "step_000006")


def test_a_rollback_supersedes_the_records_after_its_checkpoint_but_not_the_guards(tmp_path):
    writer = RecordWriter(tmp_path, Lineage("r1", 1))
    for step in (1, 2, 3):
        writer.append("steps.jsonl", {"step": step})
        writer.append("guard.jsonl", {"step": step, "level": "warn"})
    keep = writer.line_counts()
    keep = {**keep, "steps.jsonl": 1, "guard.jsonl": 1}  # a checkpoint after step 1
    moved = writer.supersede_after(keep, except_files=("guard.jsonl",))
    assert moved == {"steps.jsonl": 2}
    steps = [json.loads(x)["step"] for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert steps == [1]
    assert len((tmp_path / "guard.jsonl").read_text().splitlines()) == 3
    assert len((tmp_path / "superseded" / "steps.jsonl").read_text().splitlines()) == 2
    writer.append("steps.jsonl", {"step": 2})
    assert writer.line_counts()["steps.jsonl"] == 2  # counted afresh after the move


def test_the_autopilot_writes_and_counts_the_rollback_and_the_stop(tmp_path: Path):
    cfg = load_config(None, [*DECOUPLED, "guard.max_rollbacks=1"])
    control = ControlState(config=cfg)
    metrics = TrainingMetrics(CollectorRegistry())
    said: list[str] = []
    services = SimpleNamespace(records=RecordWriter(tmp_path, Lineage("r1", 1)), metrics=metrics)
    pilot = Autopilot(control, services, said.append)
    store = SimpleNamespace(steps=lambda: [5, 10], keep_before=None)
    decisions = [pilot.step(r, cfg, store) for r in falling(21)]
    assert [(d.step, d.action) for d in decisions if d.level == "act"] == [
        (16, "lower_staleness"), (21, STOP),
    ]  # fmt: skip
    assert "stppo_guard_rollbacks_total" in exported_metric_names(metrics.registry)
    assert metrics.guard_rollbacks_total._value.get() == 1
    assert metrics.guard_actions_total.labels(action=STOP)._value.get() == 1
    logged = [json.loads(x) for x in (tmp_path / "guard.jsonl").read_text().splitlines()]
    first = next(r for r in logged if r["level"] == "act")
    assert first["rollback"] == {
        "from_step": 16, "signal_began": 15, "to_step": 10, "checkpoint": "step_000010",
        "reason": "",
    }  # fmt: skip
    assert logged[-1]["action"] == STOP and logged[-1]["rollback"]["to_step"] is None
    assert pilot.stop is decisions[-1] and store.keep_before == (15, False)
    with pytest.raises(GuardStopped, match="at step 21: rollback budget spent"):
        pilot.end(tmp_path)
    assert any("rolling back to step 10 (the signal began at step 15)" in m for m in said)
    assert said[-2].endswith("the run stops: rollback budget spent (1 of 1)")
    assert said[-1] == "stopped by the stability guard at step 21"
    line = log_line(logged, "act")
    assert (
        "acted: lower_staleness at step 16 (behavior_log_ratio_abs_mean > 0.1; rolled back "
        "to step 10)" in line
    )
    assert line.endswith(
        "; 1 rollback; stopped at step 21 (behavior_log_ratio_abs_mean > 0.1): rollback "
        "budget spent (1 of 1)"
    )
    none = {**first, "rollback": {**first["rollback"], "to_step": None,
                                  "reason": "no checkpoint before step 15"}}  # fmt: skip
    assert (
        "(behavior_log_ratio_abs_mean > 0.1; no rollback: no checkpoint before step 15)"
        in log_line([none], "act")
        and log_line([none], "act").endswith("; 0 rollbacks")
    )
    assert "rollback" not in log_line([{**first, "rollback": None}], "act")
    assert "no rollback: no checkpoint" in progress_line(decision_from_record(none))


def test_the_keep_before_of_the_autopilot_is_off_unless_it_can_roll_back():
    services = SimpleNamespace(records=None, metrics=None)
    pilot = Autopilot(ControlState(config=load_config()), services, print)
    assert pilot.keep_before(10, load_config()) is None  # mode warn
    assert pilot.keep_before(10, load_config(None, DECOUPLED)) == (9, True)
    assert pilot.keep_before(10, load_config(None, [*DECOUPLED, "guard.rollback=false"])) is None


def test_stppo_train_exits_3_when_the_guard_stopped_the_run(tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    import services.driver
    from services.cli import app

    def stopped(cfg, resume=False, overwrite=False):
        raise GuardStopped(21, "rollback budget spent (2 of 2)", cfg.run_dir)

    monkeypatch.setattr(services.driver, "run_training", stopped)
    monkeypatch.setattr("services.env.configure_local_caches", lambda **_: None)
    result = CliRunner().invoke(app, ["train", f"run.output_dir={json.dumps(str(tmp_path))}"])
    assert result.exit_code == EXIT_GUARD_STOPPED == 3, result.output
    assert "stopped by the stability guard at step 21: rollback budget spent (2 of 2)" in " ".join(
        result.output.split()
    )
    assert "Exit status: 0 finished; 2 bad config" in " ".join(
        CliRunner().invoke(app, ["train", "--help"], terminal_width=200).output.split()
    )


def test_trajectory_ids_stay_unique_after_a_rollback_redraws_the_same_questions():
    from services.loop.pipeline import stamp_ids

    before, after = (
        [SimpleNamespace(extra={}) for _ in range(2)],
        [SimpleNamespace(extra={}) for _ in range(2)],
    )
    stamp_ids(before, first_draw=6, group_size=2, attempt=1)
    stamp_ids(after, first_draw=6, group_size=2, attempt=1, rollbacks=1)  # draw 6 again
    assert [t.extra["trajectory_id"] for t in before] == ["a1-d6-g0", "a1-d6-g1"]
    assert [t.extra["trajectory_id"] for t in after] == ["a1r1-d6-g0", "a1r1-d6-g1"]
