"""Hard faults: ``kill -9`` at any moment, a full disk. Nothing lost, nothing trained twice.

A short synthetic run (``stppo train``, a checkpoint after every step) is SIGKILLed at 20
moments: at random times, while a checkpoint is being written (its ``.partial`` folder
exists), right after a step record (the step's weight sync in flight), during an
evaluation; each kill takes the driver's whole session (its Ray head, retrieval server and
workers: what a pod restart does), and each is followed by ``stppo train`` with
``run.resume = auto``. Separately the learner actor's process is SIGKILLed mid-run. The run
that finishes must equal an uninterrupted one in its counters, with every step and every
consumed trajectory recorded exactly once. A run whose disk fills during a checkpoint stops
with one error line (path and bytes), exit status 74, and its last checkpoint still resumes.

Outside ``make test`` (``make test-faults``, marker ``faults``): the kill test takes ~11
minutes on 2 cores. It prints the outcome table that docs/reliability.md quotes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.env import PROJECT_ROOT
from services.run_records import EXIT_DISK_FULL, latest_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STPPO = str(Path(sys.executable).parent / "stppo")
NUM_STEPS = 120  # long enough that the run outlasts 20 kills (a step takes under a second)
BATCH = 8
KILLS = 20
TRIGGERS = ("time", "checkpoint", "step", "eval", "time")


def overrides(out: Path, name: str, **extra) -> list[str]:
    values = {
        "run.output_dir": str(out), "run.name": name, "run.num_steps": NUM_STEPS,
        "run.eval_questions": 8, "run.resume": "auto", "sft.enabled": False,
        "learner.train_batch_size": BATCH, "learner.mini_batch_size": BATCH,
        "learner.micro_batch_size": BATCH, "checkpoint.every_k_steps": 1,
        "checkpoint.keep_last": 2, "metrics.enabled": False, "control.enabled": False,
        **extra,
    }  # fmt: skip
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def start(args: list[str], log: Path) -> subprocess.Popen:
    """``stppo train`` in a session of its own (so that the whole session can be killed)."""
    with log.open("ab") as f:
        return subprocess.Popen(
            [STPPO, "train", "@deploy/configs/synthetic.toml", *args], cwd=PROJECT_ROOT,
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def session(sid: int) -> list[int]:
    """Every process of session ``sid`` (from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # stat: state ppid pgrp session ...
            pids.append(int(entry.name))
    return pids


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver, then everything else of its session (a pod restart)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pid in session(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a torn last line: the next start supersedes it
            out.append(json.loads(line))
    return out


def fired(
    trigger: str, run_dir: Path, new_log: str, waited_s: float, at_s: float, steps0: int
) -> bool:
    """Whether this attempt's kill moment has come (``new_log``: what it printed so far)."""
    if trigger == "time":
        return waited_s >= at_s
    if trigger == "checkpoint":  # inside a checkpoint write
        return any((run_dir / "checkpoints").glob("*.partial"))
    if trigger == "step":  # a step record just written: its weight sync is in flight
        return len(lines(run_dir / "steps.jsonl")) > steps0
    return "questions, ETA" in new_log  # an evaluation in progress


@pytest.mark.timeout(3600)
def test_kill_9_anywhere_resumes_with_nothing_lost_or_trained_twice(tmp_path: Path):
    rng = random.Random(0)
    run_dir = tmp_path / "runs" / "crash"
    log = tmp_path / "console.log"
    table = {"kills": 0, "resumes": 0, "by_trigger": {}, "first_step_s": []}
    finished_early = 0  # the run completed before the next kill came
    for k in range(KILLS):
        trigger = TRIGGERS[k % len(TRIGGERS)]
        offset = log.stat().st_size if log.exists() else 0
        proc = start(overrides(tmp_path / "runs", "crash"), log)
        began, at_s = time.monotonic(), rng.uniform(5, 45)
        steps0 = len(lines(run_dir / "steps.jsonl"))
        first_step = None
        while proc.poll() is None:
            waited = time.monotonic() - began
            if first_step is None and len(lines(run_dir / "steps.jsonl")) > steps0:
                first_step = waited
            with log.open("rb") as f:
                f.seek(offset)
                new_log = f.read().decode(errors="replace")
            if fired(trigger, run_dir, new_log, waited, at_s, steps0) or waited > 240:
                kill_session(proc)
                table["kills"] += 1
                table["by_trigger"][trigger] = table["by_trigger"].get(trigger, 0) + 1
                break
            time.sleep(0.05)
        if first_step is not None:
            table["first_step_s"].append(first_step)
        if proc.returncode not in (None, -signal.SIGKILL):
            assert proc.returncode == 0, log.read_text()[-3000:]
            finished_early = 1
            break  # the run finished before this kill
        table["resumes"] += 1
    final = start(overrides(tmp_path / "runs", "crash"), log)
    assert final.wait(900) == 0, log.read_text()[-3000:]

    reference = start(overrides(tmp_path / "runs", "reference"), tmp_path / "reference.log")
    assert reference.wait(900) == 0
    check_records(run_dir, tmp_path / "runs" / "reference")
    superseded = {p.name: len(lines(p)) for p in (run_dir / "superseded").glob("*.jsonl")}
    table.update(
        steps_redone=superseded.get("steps.jsonl", 0),
        records_moved_aside=sum(superseded.values()),
        attempts=len(json.loads((run_dir / "run.json").read_text())["attempts"]),
        longest_to_first_resumed_step_s=round(max(table.pop("first_step_s"), default=0), 1),
    )
    print("crash-consistency outcome:", json.dumps(table))
    # every start is an attempt: the killed ones, the one that finished before its kill
    # came (if any) and the final one
    assert table["kills"] >= KILLS or table["attempts"] == table["kills"] + finished_early + 1


def check_records(run_dir: Path, reference_dir: Path) -> None:
    """Every step once, in order; every consumed trajectory once; the counters of an
    uninterrupted run."""
    steps = lines(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    assert [s["policy_version"] for s in steps] == list(range(1, NUM_STEPS + 1))
    consumed = lines(run_dir / "consumed.jsonl")
    assert [c["step"] for c in consumed] == list(range(1, NUM_STEPS + 1))
    ids = [i for c in consumed for i in c["ids"]]
    assert len(ids) == len(set(ids)) == NUM_STEPS * BATCH
    evals = lines(run_dir / "eval.jsonl")
    assert evals[-1]["tag"] == "end" and [e["tag"] for e in evals].count("end") == 1
    ref_steps = lines(reference_dir / "steps.jsonl")
    for key in ("step", "policy_version", "trajectories_consumed"):
        assert steps[-1][key] == ref_steps[-1][key], key
    state = json.loads((latest_checkpoint(run_dir) / "driver_state.json").read_text())
    ref_state = json.loads((latest_checkpoint(reference_dir) / "driver_state.json").read_text())
    for key in ("learner_step", "policy_version", "trajectories_consumed"):
        assert state[key] == ref_state[key], key


@pytest.mark.timeout(1800)
def test_a_killed_learner_actor_is_a_failed_run_that_resumes(tmp_path: Path):
    run_dir = tmp_path / "runs" / "learner"
    log = tmp_path / "console.log"
    for _ in range(3):
        proc = start(overrides(tmp_path / "runs", "learner"), log)
        steps0 = len(lines(run_dir / "steps.jsonl"))
        while proc.poll() is None and len(lines(run_dir / "steps.jsonl")) < steps0 + 2:
            time.sleep(0.1)
        learners = [p for p in session(proc.pid)
                    if "LearnerRank" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]  # fmt: skip
        if proc.poll() is not None or not learners:
            break
        os.kill(learners[0], signal.SIGKILL)
        assert proc.wait(300) != 0  # the driver cannot go on without its learner
        kill_session(proc)
    final = start(overrides(tmp_path / "runs", "learner"), log)
    assert final.wait(900) == 0, log.read_text()[-3000:]
    steps = lines(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, NUM_STEPS + 1))
    ids = [i for c in lines(run_dir / "consumed.jsonl") for i in c["ids"]]
    assert len(ids) == len(set(ids)) == NUM_STEPS * BATCH


@pytest.mark.timeout(1800)
def test_a_full_disk_stops_with_one_line_and_the_last_checkpoint_resumes(tmp_path: Path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # one checkpoint of the synthetic model is ~41 MB: the first fits, the second does not
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("tmpfs mount needs root")
    try:
        log = tmp_path / "full.log"
        args = overrides(disk, "full", **{"checkpoint.every_k_steps": 2})
        proc = start(args, log)
        assert proc.wait(900) == EXIT_DISK_FULL, log.read_text()[-3000:]
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        assert len(errors) == 1, errors
        assert "disk full writing" in errors[0] and "step_000004.partial" in errors[0]
        assert "needed about" in errors[0] and "bytes" in errors[0]
        resume_from = latest_checkpoint(disk / "full")
        assert resume_from is not None and resume_from.name == "step_000002"
        # it resumes (nothing left to train at 2 steps: restore, evaluate, exit 0)
        again = start(overrides(disk, "full", **{"run.num_steps": 2}), log)
        assert again.wait(900) == 0, log.read_text()[-3000:]
        assert "resumed from" in log.read_text()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
