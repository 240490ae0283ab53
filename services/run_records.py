"""One run directory, one run: how ``stppo train`` starts on a run directory (``run.resume``),
the run's lineage (a run id per start, attempts per resume), and the one writer of its records.

Start modes (``run.resume``; ``stppo train --resume`` is ``must``):

- ``never`` (default): start a new run; a run directory that already holds one (a non-empty
  ``*.jsonl`` record file or a checkpoint) is refused with :class:`RunDirInUse`.
- ``auto`` (the cluster configs): resume from the latest checkpoint if there is one, else
  start. A used directory without a checkpoint (a run killed before its first one) continues
  its lineage from step 0: every record of it is superseded.
- ``must``: resume from the latest checkpoint; none is an error.

``--overwrite`` moves a used directory aside to ``<name>.old-<UTC time>`` (never deletes it)
and starts a new run in its place.

Lineage: ``run.json`` holds the run id (made at the first start, kept across resumes) and one
entry per attempt (1, 2, ...: where it resumed from, which records it superseded). Every
record line written through :class:`RecordWriter` starts with ``run_id`` and ``attempt``.

Superseded records: a checkpoint stores how many lines each ``*.jsonl`` file had when it was
written (``DriverState.record_lines``). A resume moves every line after those counts (what
the interrupted attempt wrote after its last checkpoint: steps that will be trained again,
their consumed ids, a final evaluation) to ``superseded/<file>`` before it writes anything,
so the live files hold each step exactly once and nothing is deleted.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.atomic import write_atomic

ResumeMode = Literal["never", "auto", "must"]

LINEAGE_FILE = "run.json"
SUPERSEDED_DIR = "superseded"

EXIT_INTERRUPTED = 75
"""``stppo train`` exit status after SIGTERM: checkpointed, not finished, resumable
(``EX_TEMPFAIL`` of sysexits.h: "try again later")."""

EXIT_DISK_FULL = 74
"""``stppo train`` exit status when the disk filled up (``EX_IOERR`` of sysexits.h): one
error line names the path and the bytes it needed; the last complete checkpoint resumes."""


EXIT_GUARD_STOPPED = 3
"""``stppo train`` exit status when the stability guard stopped the run: an action would
have rolled back with ``guard.max_rollbacks`` spent. The run ended like a finished one
(checkpoint, end evaluation, records) before ``run.num_steps``; one line says why."""


class RunDirInUse(RuntimeError):
    """``run.resume = "never"`` on a run directory that already holds a run; the message is
    one line naming the directory and the ways on."""


class TrainingInterrupted(RuntimeError):
    """The run stopped on SIGTERM before ``run.num_steps``, after writing a checkpoint.

    Attributes:
        step: the learner step of that checkpoint.
        run_dir: the run directory.
    """

    def __init__(self, step: int, run_dir: Path) -> None:
        super().__init__(f"interrupted at step {step} (checkpoint in {run_dir / 'checkpoints'})")
        self.step = step
        self.run_dir = run_dir


class GuardStopped(RuntimeError):
    """The stability guard ended the run before ``run.num_steps``: its rollback budget was
    spent (:data:`services.loop.guard.STOP`). Raised after the run's end (checkpoint, end
    evaluation, records), so nothing is lost.

    Attributes:
        step: the learner step at which it stopped.
        reason: the decision's reason (``rollback budget spent (2 of 2)``).
        run_dir: the run directory.
    """

    def __init__(self, step: int, reason: str, run_dir: Path) -> None:
        super().__init__(
            f"stopped by the stability guard at step {step}: {reason} (guard.jsonl in {run_dir})"
        )
        self.step = step
        self.reason = reason
        self.run_dir = run_dir


@dataclass(frozen=True)
class Lineage:
    """Who writes the records now: ``run_id`` (one per new run) and ``attempt`` (1 at the
    start, +1 at every resume)."""

    run_id: str
    attempt: int


@dataclass(frozen=True)
class StartPlan:
    """What a start does with its run directory (see :func:`plan_start`).

    Attributes:
        checkpoint: the checkpoint to resume from, or None (train from step 0).
        continue_lineage: keep the directory's run id and add an attempt (a resume, or
            ``auto`` on a used directory without a checkpoint); False starts a new run id.
        move_aside: the directory is used and ``--overwrite`` moves it aside first.
        used: what makes the directory used (file names, ``checkpoints``); [] if unused.
    """

    checkpoint: Path | None
    continue_lineage: bool
    move_aside: bool
    used: list[str] = field(default_factory=list)


def used_by(run_dir: Path) -> list[str]:
    """What in ``run_dir`` belongs to a run: its non-empty ``*.jsonl`` record files and
    ``checkpoints`` if one is complete. ``[]`` for a missing or unused directory (only
    ``config.json``, logs or ``console.log`` of a start that failed before any record)."""
    if not run_dir.is_dir():
        return []
    used = sorted(p.name for p in run_dir.glob("*.jsonl") if p.is_file() and p.stat().st_size)
    if latest_checkpoint(run_dir) is not None or any(
        (p / "driver_state.json").exists() for p in (run_dir / "checkpoints").glob("step_*")
    ):
        used.append("checkpoints")
    return used


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resume starts from: the complete one (its manifest agrees with its
    files) ``checkpoints/latest`` names, else the newest complete one, else None
    (:meth:`services.loop.checkpoint.CheckpointStore.latest`)."""
    from services.loop.checkpoint import CheckpointStore

    return CheckpointStore(run_dir / "checkpoints").latest()


def plan_start(run_dir: Path, mode: ResumeMode, overwrite: bool = False) -> StartPlan:
    """Decide how a start uses ``run_dir``; reads only, changes nothing.

    Args:
        run_dir: ``<run.output_dir>/<run.name>``.
        mode: ``run.resume`` (see the module docstring).
        overwrite: ``--overwrite``: start a new run, moving a used directory aside.

    Raises:
        ValueError: ``overwrite`` with ``mode = "must"`` (a resume keeps the directory).
        RunDirInUse: ``mode = "never"`` and ``run_dir`` is used.
        FileNotFoundError: ``mode = "must"`` and there is no complete checkpoint.
    """
    used = used_by(run_dir)
    if overwrite:
        if mode == "must":
            raise ValueError("--overwrite starts a new run; it cannot be combined with --resume")
        return StartPlan(None, continue_lineage=False, move_aside=bool(used), used=used)
    checkpoint = latest_checkpoint(run_dir)
    if mode == "must":
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        return StartPlan(checkpoint, continue_lineage=True, move_aside=False, used=used)
    if mode == "auto":
        return StartPlan(checkpoint, continue_lineage=bool(used), move_aside=False, used=used)
    if used:
        raise RunDirInUse(
            f"{run_dir} already holds a run ({', '.join(used)}): continue it with --resume "
            f"(or run.resume=auto), or start a new one with another run.name or with "
            f"--overwrite (moves {run_dir.name} aside to {run_dir.name}.old-<time>, deletes "
            "nothing)"
        )
    return StartPlan(None, continue_lineage=False, move_aside=False, used=used)


def move_aside(run_dir: Path) -> Path:
    """Rename ``run_dir`` to ``<name>.old-<UTC YYYYmmddTHHMMSS>`` beside it (``-2``, ``-3``
    ... if taken) and return the new path; nothing is deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    run_dir.rename(target)
    return target


def new_run_id() -> str:
    """``<UTC YYYYmmddTHHMMSS>-<6 hex>``: sortable by start time, unique in practice."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def start_attempt(run_dir: Path, plan: StartPlan, resumed_at_step: int) -> Lineage:
    """Open the attempt ``plan`` describes in ``run_dir`` (already created): supersede what
    the last attempt wrote after ``plan.checkpoint`` (all of it without a checkpoint), then
    append the attempt to ``run.json``. Call before anything is written to the records.

    Args:
        run_dir: the run directory.
        plan: from :func:`plan_start` (after any :func:`move_aside`).
        resumed_at_step: the checkpoint's learner step (0 without one).

    Returns:
        The lineage every record of this attempt carries.
    """
    lineage_path = run_dir / LINEAGE_FILE
    previous = json.loads(lineage_path.read_text()) if lineage_path.exists() else None
    entry: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "resumed_from": None,
        "resumed_at_step": 0,
        "superseded_lines": {},
    }
    if plan.continue_lineage:
        keep: dict[str, int] = {}
        if plan.checkpoint is not None:
            state = json.loads((plan.checkpoint / "driver_state.json").read_text())
            keep = state.get("record_lines")  # None: a checkpoint from before lineages
            entry["resumed_from"] = str(plan.checkpoint.relative_to(run_dir))
            entry["resumed_at_step"] = resumed_at_step
        if keep is not None:
            entry["superseded_lines"] = supersede_after(run_dir, keep)
        attempts = previous["attempts"] if previous else []
        run_id = previous["run_id"] if previous else new_run_id()
    else:
        attempts, run_id = [], new_run_id()
    entry["attempt"] = len(attempts) + 1
    record = {"run_id": run_id, "attempts": [*attempts, entry]}
    write_atomic(lineage_path, json.dumps(record, indent=2) + "\n")
    return Lineage(run_id=run_id, attempt=entry["attempt"])


def supersede_after(run_dir: Path, keep: dict[str, int]) -> dict[str, int]:
    """Keep the first ``keep[name]`` lines of every ``*.jsonl`` in ``run_dir`` (0 for a file
    not in ``keep``); append the rest to ``superseded/<name>``. Idempotent: a second call
    with the same ``keep`` moves nothing.

    Returns:
        ``{file name: lines moved}`` for every file that lost lines.
    """
    moved: dict[str, int] = {}
    for path in sorted(run_dir.glob("*.jsonl")):
        lines = path.read_bytes().splitlines(keepends=True)
        n = keep.get(path.name, 0)
        rest = [line for line in lines[n:] if line.strip()]
        if not rest and len(lines) <= n:
            continue
        aside = run_dir / SUPERSEDED_DIR / path.name
        aside.parent.mkdir(exist_ok=True)
        with aside.open("ab") as f:
            for line in rest:  # a torn last line (killed mid-write) gets its newline here
                f.write(line if line.endswith(b"\n") else line + b"\n")
        write_atomic(path, b"".join(lines[:n]).decode())
        if rest:
            moved[path.name] = len(rest)
    return moved


class RecordWriter:
    """The one writer of a run's JSONL records (``steps.jsonl``, ``consumed.jsonl``,
    ``eval.jsonl``, ``config_changes.jsonl``, ``sft.jsonl`` and any new record file): every
    line is ``{"run_id": ..., "attempt": ..., **record}``, and it counts the lines of each
    file so a checkpoint can store them (:meth:`line_counts`).

    Example::

        records = RecordWriter(run_dir, Lineage("20261125T101500-a1b2c3", 2))
        records.append("samples.jsonl", {"step": 9, "text": "..."})
    """

    def __init__(self, run_dir: Path, lineage: Lineage) -> None:
        self.run_dir = run_dir
        self.lineage = lineage
        self._lines: dict[str, int] = {}

    def append(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        """Append ``record`` (JSON-serialisable, or with ``.item()`` / ``__dict__`` values) as
        one line of ``<run_dir>/<name>``; returns the line as written (with the lineage)."""
        stamped = {"run_id": self.lineage.run_id, "attempt": self.lineage.attempt, **record}
        line = json.dumps(stamped, default=_json_default) + "\n"
        path = self.run_dir / name
        if name not in self._lines:
            self._lines[name] = _count_lines(path)
        with path.open("a") as f:
            f.write(line)
        self._lines[name] += 1
        return stamped

    def supersede_after(
        self, keep: dict[str, int], except_files: tuple[str, ...] = ()
    ) -> dict[str, int]:
        """A rollback: :func:`supersede_after` with the ``keep`` counts of the checkpoint
        rolled back to, except the files in ``except_files`` (kept whole: what the guard
        decided, the live changes that still hold); this writer counts the files afresh.

        Returns:
            ``{file name: lines moved}``.
        """
        keep = {**keep, **{name: self.line_counts().get(name, 0) for name in except_files}}
        moved = supersede_after(self.run_dir, keep)
        self._lines.clear()
        return moved

    def line_counts(self) -> dict[str, int]:
        """``{file name: lines}`` of every ``*.jsonl`` in the run directory now (files this
        writer did not write are counted afresh)."""
        counts = {p.name: _count_lines(p) for p in self.run_dir.glob("*.jsonl")}
        return {**counts, **self._lines}


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__dict__"):
        return value.__dict__
    return str(value)


def clear_run_records(run_dir: Path) -> None:
    """Remove the records of an unfinished run (every ``*.jsonl``, its lineage, superseded
    records, checkpoints, ``console.log``) so that a new run, or one restored from a grid's
    archive, starts clean in it."""
    import shutil

    for path in run_dir.glob("*.jsonl"):
        path.unlink()
    for name in (LINEAGE_FILE, "console.log"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / SUPERSEDED_DIR, ignore_errors=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


def read_records(path: Path, step_key: str | None = None) -> list[dict[str, Any]]:
    """The records of a JSONL record file ([] when it does not exist), checked to belong to
    one run.

    Args:
        path: e.g. ``<run_dir>/steps.jsonl``.
        step_key: a key that must not repeat (``"step"`` in steps.jsonl and consumed.jsonl).

    Raises:
        ValueError: the file mixes run ids, or ``step_key`` repeats (a run directory written
            twice before run ids existed): counting it would count steps twice.
    """
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run_ids = list(dict.fromkeys(r["run_id"] for r in records if "run_id" in r))
    if len(run_ids) > 1:
        raise ValueError(
            f"{path} mixes runs {', '.join(run_ids)}: move the run directory aside and "
            "start again, or split it by run_id"
        )
    if step_key is not None:
        seen: set[Any] = set()
        for r in records:
            step = r.get(step_key)
            if step in seen:
                raise ValueError(
                    f"{path} holds {step_key} {step} twice: it mixes two runs written "
                    "before run ids existed; split it by hand"
                )
            seen.add(step)
    return records
