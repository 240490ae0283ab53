"""One run directory, one run (issue 33): the start modes, the lineage on every record line,
the records a resume supersedes, and ``stppo train``'s refusal and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.run_records import (
    EXIT_INTERRUPTED,
    LINEAGE_FILE,
    SUPERSEDED_DIR,
    RecordWriter,
    RunDirInUse,
    TrainingInterrupted,
    move_aside,
    plan_start,
    read_records,
    start_attempt,
    used_by,
)


def fake_checkpoint(run_dir: Path, step: int, records: RecordWriter | None) -> Path:
    """What the driver's checkpoint leaves for the start logic: a complete checkpoint (its
    driver_state.json under a manifest) named by latest."""
    from services.loop.checkpoint import write_manifest

    path = run_dir / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    lines = records.line_counts() if records is not None else {}
    state = {"learner_step": step, "record_lines": lines}
    (path / "driver_state.json").write_text(json.dumps(state))
    write_manifest(path)
    (run_dir / "checkpoints" / "latest").write_text(path.name)
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_never_refuses_a_used_directory_in_one_line_naming_the_ways_on(tmp_path: Path):
    run_dir = tmp_path / "synthetic"
    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirInUse) as e:
        plan_start(run_dir, "never")
    message = str(e.value)
    assert "\n" not in message and str(run_dir) in message and "steps.jsonl" in message
    for way in ("--resume", "run.resume=auto", "run.name", "--overwrite", "deletes nothing"):
        assert way in message


def test_never_starts_in_a_directory_without_records(tmp_path: Path):
    """A start that failed before its first record (config.json, logs, an empty file) left
    nothing to protect: a new run may start there."""
    run_dir = tmp_path / "r"
    assert plan_start(run_dir, "never").checkpoint is None  # missing
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "console.log").write_text("Traceback ...")
    (run_dir / "steps.jsonl").write_text("")
    plan = plan_start(run_dir, "never")
    assert (plan.checkpoint, plan.continue_lineage, plan.move_aside) == (None, False, False)
    assert used_by(run_dir) == []


def test_auto_starts_on_an_empty_directory_and_resumes_a_used_one(tmp_path: Path):
    run_dir = tmp_path / "r"
    empty = plan_start(run_dir, "auto")
    assert (empty.checkpoint, empty.continue_lineage) == (None, False)

    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text('{"step": 1}\n')
    no_checkpoint = plan_start(run_dir, "auto")  # killed before its first checkpoint
    assert (no_checkpoint.checkpoint, no_checkpoint.continue_lineage) == (None, True)

    ckpt = fake_checkpoint(run_dir, 1, None)
    used = plan_start(run_dir, "auto")
    assert (used.checkpoint, used.continue_lineage, used.move_aside) == (ckpt, True, False)
    assert plan_start(run_dir, "must").checkpoint == ckpt


def test_must_needs_a_complete_checkpoint(tmp_path: Path):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)  # killed while saving
    (run_dir / "checkpoints" / "latest").write_text("step_000002")
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        plan_start(run_dir, "must")


def test_overwrite_moves_the_directory_aside_and_deletes_nothing(tmp_path: Path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text('{"step": 1}\n')
    plan = plan_start(run_dir, "never", overwrite=True)
    assert plan.move_aside and plan.checkpoint is None and not plan.continue_lineage
    moved = move_aside(run_dir)
    assert moved.parent == tmp_path and moved.name.startswith("r.old-")
    assert not run_dir.exists() and (moved / "steps.jsonl").read_text() == '{"step": 1}\n'
    run_dir.mkdir()
    (run_dir / "steps.jsonl").write_text('{"step": 1}\n')
    again = move_aside(run_dir)  # same second: a distinct name
    assert again != moved and again.exists() and moved.exists()
    with pytest.raises(ValueError, match="cannot be combined with --resume"):
        plan_start(tmp_path / "x", "must", overwrite=True)


def test_a_resume_recounts_every_step_exactly_once(tmp_path: Path):
    """Attempt 1 trains steps 1..3, checkpoints at 2, is killed after step 3 and its final
    evaluation; attempt 2 resumes from step 2 and trains 3..4. The live files hold steps 1..4
    once each; what attempt 1 wrote after its checkpoint is in superseded/, and every line
    carries the run id and its attempt."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    first = start_attempt(run_dir, plan_start(run_dir, "never"), 0)
    assert first.attempt == 1
    w1 = RecordWriter(run_dir, first)
    w1.append("eval.jsonl", {"tag": "start", "learner_step": 0})
    for step in (1, 2):
        w1.append("consumed.jsonl", {"step": step, "ids": [f"a1-d{step}-g0"]})
        w1.append("steps.jsonl", {"step": step})
    fake_checkpoint(run_dir, 2, w1)
    w1.append("consumed.jsonl", {"step": 3, "ids": ["a1-d3-g0"]})
    w1.append("steps.jsonl", {"step": 3})
    w1.append("eval.jsonl", {"tag": "end", "learner_step": 3})
    with (run_dir / "steps.jsonl").open("a") as f:
        f.write('{"run_id": "torn')  # killed mid-write

    plan = plan_start(run_dir, "auto")
    second = start_attempt(run_dir, plan, 2)
    assert (second.run_id, second.attempt) == (first.run_id, 2)
    w2 = RecordWriter(run_dir, second)
    w2.append("eval.jsonl", {"tag": "resume", "learner_step": 2})
    for step in (3, 4):
        w2.append("consumed.jsonl", {"step": step, "ids": [f"a2-d{step}-g0"]})
        w2.append("steps.jsonl", {"step": step})

    steps = read_records(run_dir / "steps.jsonl", "step")
    assert [(s["step"], s["attempt"]) for s in steps] == [(1, 1), (2, 1), (3, 2), (4, 2)]
    assert {s["run_id"] for s in steps} == {first.run_id}
    consumed = read_records(run_dir / "consumed.jsonl", "step")
    ids = [i for rec in consumed for i in rec["ids"]]
    assert ids == ["a1-d1-g0", "a1-d2-g0", "a2-d3-g0", "a2-d4-g0"]
    evals = read_records(run_dir / "eval.jsonl")
    assert [e["tag"] for e in evals] == ["start", "resume"]

    aside = run_dir / SUPERSEDED_DIR
    aside_steps = (aside / "steps.jsonl").read_text().splitlines()
    assert json.loads(aside_steps[0])["step"] == 3
    assert aside_steps[1] == '{"run_id": "torn'  # kept, on a line of its own
    assert [e["tag"] for e in read(aside / "eval.jsonl")] == ["end"]
    lineage = json.loads((run_dir / LINEAGE_FILE).read_text())
    assert lineage["run_id"] == first.run_id
    assert [a["attempt"] for a in lineage["attempts"]] == [1, 2]
    assert lineage["attempts"][1]["resumed_from"] == "checkpoints/step_000002"
    assert lineage["attempts"][1]["resumed_at_step"] == 2
    assert lineage["attempts"][1]["superseded_lines"] == {
        "consumed.jsonl": 1, "eval.jsonl": 1, "steps.jsonl": 2,
    }  # fmt: skip


def test_line_counts_follow_files_written_elsewhere(tmp_path: Path):
    """A record file another writer appends to is counted when the checkpoint is taken,
    not when it was first seen."""
    writer = RecordWriter(tmp_path, start_attempt(tmp_path, plan_start(tmp_path, "never"), 0))
    writer.append("steps.jsonl", {"step": 1})
    (tmp_path / "other.jsonl").write_text("{}\n")
    assert writer.line_counts() == {"steps.jsonl": 1, "other.jsonl": 1}
    with (tmp_path / "other.jsonl").open("a") as f:
        f.write("{}\n")
    assert writer.line_counts() == {"steps.jsonl": 1, "other.jsonl": 2}


def test_auto_without_a_checkpoint_supersedes_every_record(tmp_path: Path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    first = start_attempt(run_dir, plan_start(run_dir, "auto"), 0)
    RecordWriter(run_dir, first).append("steps.jsonl", {"step": 1})
    second = start_attempt(run_dir, plan_start(run_dir, "auto"), 0)
    assert (second.run_id, second.attempt) == (first.run_id, 2)
    assert (run_dir / "steps.jsonl").read_text() == ""
    assert [s["step"] for s in read(run_dir / SUPERSEDED_DIR / "steps.jsonl")] == [1]
    assert plan_start(run_dir, "never").used == []  # its records moved aside


def test_a_new_run_gets_a_new_run_id(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ids = {start_attempt(d, plan_start(d, "never"), 0).run_id for d in (a, b)}
    assert len(ids) == 2


def test_read_records_refuses_mixed_runs_and_repeated_steps(tmp_path: Path):
    mixed = tmp_path / "steps.jsonl"
    mixed.write_text('{"run_id": "x", "step": 1}\n{"run_id": "y", "step": 1}\n')
    with pytest.raises(ValueError, match="mixes runs x, y"):
        read_records(mixed)
    legacy = tmp_path / "legacy.jsonl"  # the directory: steps 1..2 twice, no run ids
    legacy.write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 1, 2)))
    assert len(read_records(legacy)) == 4
    with pytest.raises(ValueError, match="step 1 twice"):
        read_records(legacy, "step")


def test_trajectory_ids_are_unique_across_attempts():
    from types import SimpleNamespace

    from services.loop.pipeline import stamp_ids

    def batch():
        return [SimpleNamespace(extra={}) for _ in range(4)]

    first, second = batch(), batch()
    stamp_ids(first, first_draw=6, group_size=2, attempt=1)
    stamp_ids(second, first_draw=6, group_size=2, attempt=2)  # the same draws, re-issued
    ids = [t.extra["trajectory_id"] for t in first + second]
    assert ids[:4] == ["a1-d6-g0", "a1-d6-g1", "a1-d7-g0", "a1-d7-g1"]
    assert len(set(ids)) == 8


def _train(args: list[str]):
    from services.cli import app

    return CliRunner().invoke(app, ["train", *args])


def test_stppo_train_refuses_a_used_run_directory(tmp_path: Path, monkeypatch):
    import services.driver

    def must_not_train(*args, **kwargs):
        raise AssertionError("stppo train went on to train in a used run directory")

    monkeypatch.setattr(services.driver, "run_training", must_not_train)
    run_dir = tmp_path / "synthetic"
    run_dir.mkdir()
    (run_dir / "consumed.jsonl").write_text('{"step": 1, "ids": ["d0-g0"]}\n')
    result = _train([f"run.output_dir={json.dumps(str(tmp_path))}", "run.name='synthetic'"])
    assert result.exit_code == 2, result.output
    assert "already holds a run" in result.output and "--overwrite" in result.output
    assert (run_dir / "consumed.jsonl").exists()
    must = _train([f"run.output_dir={json.dumps(str(tmp_path))}", "run.name='x'", "--resume"])
    assert must.exit_code == 2 and "no checkpoint in" in must.output


def test_stppo_train_exits_75_after_sigterm_naming_the_resume_command(tmp_path: Path, monkeypatch):
    import services.driver

    def interrupted(cfg, resume=False, overwrite=False):
        raise TrainingInterrupted(7, cfg.run_dir)

    monkeypatch.setattr(services.driver, "run_training", interrupted)
    monkeypatch.setattr("services.env.configure_local_caches", lambda **_: None)
    out = json.dumps(str(tmp_path))
    result = _train([f"run.output_dir={out}", "run.num_steps=10"])
    assert result.exit_code == EXIT_INTERRUPTED == 75
    assert "interrupted at step 7, resume with: stppo train" in result.output
    assert result.output.rstrip().endswith("run.num_steps=10 --resume")
    auto = _train([f"run.output_dir={out}", "run.resume='auto'"])
    assert auto.exit_code == 75 and not auto.output.rstrip().endswith("--resume")


def test_stppo_train_writes_its_pid_for_the_pre_stop_hook(tmp_path: Path, monkeypatch):
    import os

    import services.driver

    pid_file = tmp_path / "stppo-train.pid"
    seen = []
    monkeypatch.setattr(
        services.driver, "run_training", lambda *a, **k: seen.append(pid_file.read_text())
    )
    monkeypatch.setattr("services.env.configure_local_caches", lambda **_: None)
    monkeypatch.setenv("STPPO_PID_FILE", str(pid_file))
    result = _train([f"run.output_dir={json.dumps(str(tmp_path))}"])
    assert result.exit_code == 0, result.output
    assert seen == [f"{os.getpid()}\n"] and not pid_file.exists()


def test_readers_of_runs_count_each_step_once(tmp_path: Path):
    """stppo plot, the experiment summary and the stability cells read through
    read_records: the issue's directory (two runs' steps 1..2 in one file) is refused."""
    from experiments.collapse import CollapseRule
    from experiments.grid import summarize_run
    from experiments.stability import run_stats
    from services.plots import read_run

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    config = {"algorithm": {"variant": "st_ppo"}, "buffer": {"max_staleness": 0}, "run": {}}
    (run_dir / "config.json").write_text(json.dumps(config))
    steps = [{"step": s, "variant": "st_ppo", "success_rate": 0.5} for s in (1, 2, 1, 2)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    rule = CollapseRule()
    for read_it in (lambda: read_run(run_dir), lambda: summarize_run(run_dir, rule),
                    lambda: run_stats(run_dir, rule)):  # fmt: skip
        with pytest.raises(ValueError, match="step 1 twice"):
            read_it()
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps[:2]))
    assert read_run(run_dir).steps == [1, 2]
    assert summarize_run(run_dir, rule).num_steps == 2


def test_the_experiment_clears_a_partial_run_completely(tmp_path: Path):
    """A grid rerun of an unfinished run starts a new run in its directory: every record
    file (consumed.jsonl included), the lineage and superseded records go."""
    from services.run_records import clear_run_records

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lineage = start_attempt(run_dir, plan_start(run_dir, "never"), 0)
    records = RecordWriter(run_dir, lineage)
    for name in ("steps.jsonl", "consumed.jsonl", "eval.jsonl", "samples.jsonl"):
        records.append(name, {"step": 1})
    fake_checkpoint(run_dir, 1, records)
    (run_dir / SUPERSEDED_DIR).mkdir()
    clear_run_records(run_dir)
    assert used_by(run_dir) == [] and not (run_dir / LINEAGE_FILE).exists()
    assert not (run_dir / SUPERSEDED_DIR).exists()
