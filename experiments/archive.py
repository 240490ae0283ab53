"""A grid's finished runs kept with the source, so that the grid resumes on another machine.

A grid such as the arena is hundreds of runs of a few minutes each: more than one sitting,
and the sittings do not always get the same machine (a run directory under ``runs/`` does
not survive a new machine; a commit does). With :attr:`experiments.grid.ExperimentSpec.archive_dir`
set, every run of the grid is written, once it has finished, into that directory as one
gzipped JSON file, ``<run name>.json.gz``: the records every summary reads
(:data:`RUN_FILES`), the modification times of the two files that date the run (its wall
time), the machine and source commit it ran on and the digest of the warm start it started
from. The shared warm start itself (its policy and its SFT record) is kept once, as
``warm_start.tar.gz``.

At the start of the grid :func:`restore_warm_start` and :func:`restore_runs` write them back
under the grid's output directory, where the grid's resume finds them finished and skips
them; the summaries, leaderboards and figures are then computed from the restored records
exactly as from runs made on this machine. Runs archived from a different warm start are
refused (:class:`ArchiveMismatchError`): a grid compares methods from one starting point.

The files are written atomically (:func:`services.atomic.write_atomic`) and their bytes are a
function of their content alone (gzip and tar without timestamps, sorted keys), so
archiving a run again rewrites nothing a version control system would see.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import tarfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.atomic import write_atomic
from services.run_records import clear_run_records, read_records

ARCHIVE_FORMAT = 2
"""Version of the archived run's JSON layout and of what its records mean. 2: the final
evaluation answered with the learner's final policy (``eval.jsonl``'s
``engine_policy_version_min``). Format 1 (archived before 2026-11-27 17:00 UTC) is refused:
under ``sync.fixed_lag`` its final evaluation answered with the engines' weights,
``buffer.max_staleness`` versions behind the learner."""

RUN_FILES: tuple[str, ...] = ("config.json", "run.json", "steps.jsonl", "eval.jsonl")
"""The files of a run directory that are archived (what :func:`experiments.grid.summarize_run`,
:func:`experiments.arena.read_run` and the plots read); checkpoints and logs are not."""

DATED_FILES: tuple[str, ...] = ("config.json", "eval.jsonl")
"""Files whose modification time is kept: a run's wall time is the span between them
(written at its start, and by its final evaluation)."""

WARM_START_ARCHIVE = "warm_start.tar.gz"
"""The shared warm start's archive (its ``config.json``, ``sft.jsonl`` and exported policy)."""

POLICY_WEIGHTS = "model.safetensors"
"""The exported policy file whose sha256 identifies a warm start."""


class ArchiveMismatchError(RuntimeError):
    """The archive and the run directories hold runs from different warm starts."""


def _source_commit() -> str:
    """The git commit of the code that ran (``unknown`` outside a git checkout); a ``+``
    suffix when the checkout had uncommitted changes to tracked files."""
    import subprocess

    from services.env import PROJECT_ROOT

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True,
                              text=True, timeout=30, check=True)  # fmt: skip
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine() -> dict[str, str]:
    """The CPU model, Python and torch versions of this machine, and the source commit
    (provenance only)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "none"
    return {"cpu": cpu, "python": platform.python_version(), "torch": torch_version,
            "commit": _source_commit()}  # fmt: skip


def _gzip(data: bytes) -> bytes:
    """gzip ``data`` with no name and timestamp 0 (the bytes depend on ``data`` alone)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as f:
        f.write(data)
    return buf.getvalue()


def policy_digest(policy_dir: Path) -> str:
    """sha256 (hex) of ``policy_dir``'s :data:`POLICY_WEIGHTS`.

    Raises:
        FileNotFoundError: the policy has no weights file.
    """
    h = hashlib.sha256()
    with open(Path(policy_dir) / POLICY_WEIGHTS, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_archive_path(archive_dir: Path, run_name: str) -> Path:
    """Where run ``run_name`` is archived."""
    return Path(archive_dir) / f"{run_name}.json.gz"


def archive_run(run_dir: Path, archive_dir: Path, warm_start_sha256: str | None) -> Path:
    """Write finished run ``run_dir`` into ``archive_dir`` (module docstring) unless a run
    of that name is archived already (the first one archived is kept); returns the file.

    Args:
        run_dir: a run directory whose ``eval.jsonl`` holds its final (``end``) evaluation.
        archive_dir: created if missing.
        warm_start_sha256: :func:`policy_digest` of the warm start the run started from
            (None: the grid has no shared warm start).

    Raises:
        ValueError: the run has not finished (no ``end`` evaluation), is not complete
            (:func:`is_complete`), lacks a record file, or its final evaluation did not
            answer with its final policy (:func:`check_final_policy_evaluated`).
    """
    run_dir = Path(run_dir)
    missing = [name for name in RUN_FILES if not (run_dir / name).exists()]
    if missing:
        raise ValueError(f"{run_dir} lacks {', '.join(missing)}: not a finished run")
    if not is_finished(run_dir):
        raise ValueError(f"{run_dir} has no final evaluation: the run has not finished")
    done, planned = steps_done(run_dir)
    if done < planned:
        raise ValueError(
            f"{run_dir} stopped at {done} of its {planned} learner steps (a time cap): "
            "not a sample of the grid's experiment"
        )
    path = run_archive_path(archive_dir, run_dir.name)
    if path.exists():
        return path  # archived before (maybe from another machine): the first one is kept
    check_final_policy_evaluated(run_dir)
    files = {name: (run_dir / name).read_text() for name in RUN_FILES}
    record = {
        "format": ARCHIVE_FORMAT,
        "run": run_dir.name,
        "warm_start_sha256": warm_start_sha256,
        "machine": _machine(),
        "mtimes": {name: (run_dir / name).stat().st_mtime for name in DATED_FILES},
        "files": files,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, _gzip(json.dumps(record, sort_keys=True, indent=0).encode()))
    return path


def read_archived_run(path: Path) -> dict[str, Any]:
    """One archived run's record (the JSON that :func:`archive_run` wrote).

    Raises:
        ValueError: not an archived run of a known :data:`ARCHIVE_FORMAT`, or one of fewer
            learner steps than it planned (:func:`is_complete`).
    """
    try:
        record = json.loads(gzip.decompress(Path(path).read_bytes()))
    except (OSError, EOFError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not an archived run: {e}") from None
    if record.get("format") == 1:
        raise ValueError(
            f"{path}: archive format 1, whose final evaluation answered with the engines' "
            f"lagged weights, not the final policy ({ARCHIVE_FORMAT=}): delete it, the grid "
            "runs it again"
        )
    if record.get("format") != ARCHIVE_FORMAT:
        raise ValueError(
            f"{path}: archive format {record.get('format')!r}, expected {ARCHIVE_FORMAT}"
        )
    files = record.get("files", {})
    planned = json.loads(files.get("config.json", "{}")).get("run", {}).get("num_steps", 0)
    done = sum(1 for line in files.get("steps.jsonl", "").splitlines() if line.strip())
    if done < planned:
        raise ValueError(
            f"{path}: a run the time cap stopped at {done} of its {planned} learner steps "
            "(archived before such runs were refused): delete it, the grid runs it again"
        )
    return record


def restore_runs(
    archive_dir: Path, run_dirs: list[Path], warm_start_sha256: str | None
) -> list[Path]:
    """Write the archived runs among ``run_dirs`` (found by directory name) into them, where
    a directory does not hold its complete run already (a partial or time-capped run there
    is replaced);
    returns the directories restored.

    Args:
        archive_dir: the grid's archive (missing: nothing to restore).
        run_dirs: the grid's planned runs (archived runs the grid no longer plans stay in
            the archive, unused).
        warm_start_sha256: the digest of the grid's warm start (None: no shared warm start).

    Raises:
        ArchiveMismatchError: an archived run started from another warm start.
        ValueError: an unreadable archive file.
    """
    restored = []
    for run_dir in map(Path, run_dirs):
        path = run_archive_path(archive_dir, run_dir.name)
        if not path.exists() or is_complete(run_dir):
            continue
        record = read_archived_run(path)
        if record.get("warm_start_sha256") != warm_start_sha256:
            raise ArchiveMismatchError(
                f"{path} started from warm start {record.get('warm_start_sha256')}, the grid's "
                f"is {warm_start_sha256}: restore the grid's archived warm start "
                f"({WARM_START_ARCHIVE}) or archive into a new directory"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        clear_run_records(run_dir)
        # eval.jsonl last: its final evaluation marks a finished run
        for file_name in sorted(record["files"], key=lambda n: n == "eval.jsonl"):
            write_atomic(run_dir / file_name, record["files"][file_name])
        for file_name, mtime in record["mtimes"].items():
            os.utime(run_dir / file_name, (mtime, mtime))
        restored.append(run_dir)
    return restored


def archive_finished(archive_dir: Path, run_dirs: list[Path], warm_start_sha256: str | None) -> int:
    """Archive every complete run among ``run_dirs`` (:func:`archive_run`,
    :func:`is_complete`); returns how many files were written or already up to date."""
    count = 0
    for run_dir in map(Path, run_dirs):
        if is_complete(run_dir):
            archive_run(run_dir, archive_dir, warm_start_sha256)
            count += 1
    return count


@dataclass(frozen=True)
class Provenance:
    """Where and when a grid's archived runs ran (:func:`provenance`)."""

    runs: int
    cpus: dict[str, int]
    """CPU model (``/proc/cpuinfo``) -> archived runs made on it, most runs first."""
    first_day: str
    last_day: str
    """UTC dates (``YYYY-MM-DD``) of the earliest and the latest final evaluation."""


def provenance(archive_dir: Path, run_names: Iterable[str]) -> Provenance | None:
    """The machines and days of the archived runs among ``run_names`` (the leaderboards'
    header: a grid of several sittings runs on several machines). None when none of them
    is archived.

    Raises:
        ValueError: an unreadable archive file (:func:`read_archived_run`).
    """
    cpus: Counter[str] = Counter()
    finished_at = []
    for name in run_names:
        path = run_archive_path(archive_dir, name)
        if not path.exists():
            continue
        record = read_archived_run(path)
        cpus[record["machine"]["cpu"]] += 1
        finished_at.append(record["mtimes"]["eval.jsonl"])
    if not finished_at:
        return None

    def day(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).date().isoformat()

    return Provenance(
        runs=len(finished_at),
        cpus=dict(cpus.most_common()),
        first_day=day(min(finished_at)),
        last_day=day(max(finished_at)),
    )


def is_finished(run_dir: Path) -> bool:
    """Whether ``run_dir``'s ``eval.jsonl`` holds the final (``end``) evaluation."""
    return any(e.get("tag") == "end" for e in read_records(Path(run_dir) / "eval.jsonl"))


def steps_done(run_dir: Path) -> tuple[int, int]:
    """``(learner steps logged, run.num_steps of its config.json)`` of a run directory
    (``(0, 0)`` without a config)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        return 0, 0
    planned = int(json.loads((run_dir / "config.json").read_text())["run"]["num_steps"])
    return len(read_records(run_dir / "steps.jsonl", "step")), planned


def is_complete(run_dir: Path) -> bool:
    """Finished (:func:`is_finished`) with every learner step it planned: a run stopped by a
    time cap (:attr:`experiments.grid.ExperimentSpec.max_run_s`, on a loaded machine)
    evaluates and finishes too, with fewer updates: not a sample of the grid's experiment."""
    if not is_finished(run_dir):
        return False
    done, planned = steps_done(run_dir)
    return done >= planned


def check_final_policy_evaluated(run_dir: Path) -> None:
    """Check that ``run_dir``'s final (``end``) evaluation answered with the run's final
    policy: the version the engines stamped on its answers (``engine_policy_version_min``
    and ``_max``) is the learner's ``policy_version``.

    Raises:
        ValueError: it answered with other weights, or the record does not say (a run made
            before the driver pushed the final policy to the engines for it: under
            ``sync.fixed_lag`` they held weights ``buffer.max_staleness`` versions older).
    """
    for e in read_records(Path(run_dir) / "eval.jsonl"):
        if e.get("tag") != "end":
            continue
        engine = (e.get("engine_policy_version_min"), e.get("engine_policy_version_max"))
        if None in engine or engine != (e.get("policy_version"),) * 2:
            raise ValueError(
                f"{run_dir}: its final evaluation answered with policy versions {engine}, the "
                f"learner's final policy is {e.get('policy_version')} (made before the driver "
                "pushed the final policy for it?): not archived; delete the run and run it again"
            )


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info


def archive_warm_start(warm_dir: Path, policy_dir: Path, archive_dir: Path) -> Path:
    """Write the shared warm start (``warm_dir``'s ``config.json`` and ``sft.jsonl``, and
    every file of ``policy_dir``) into ``archive_dir/warm_start.tar.gz``, unless the archive
    holds one already; returns the archive's path.

    Raises:
        ArchiveMismatchError: the archive holds a different warm start (another digest).
        FileNotFoundError: the policy has no :data:`POLICY_WEIGHTS`.
    """
    path = Path(archive_dir) / WARM_START_ARCHIVE
    digest = policy_digest(policy_dir)
    if path.exists():
        archived = archived_warm_start_digest(archive_dir)
        if archived != digest:
            raise ArchiveMismatchError(
                f"{path} holds warm start {archived}, {policy_dir} is {digest}: one grid, "
                "one warm start (remove the local warm start to restore the archived one)"
            )
        return path
    members = [(f"run/{n}", Path(warm_dir) / n) for n in ("config.json", "sft.jsonl")]
    members += [(f"policy/{p.name}", p) for p in sorted(Path(policy_dir).iterdir()) if p.is_file()]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, file in members:
            if file.exists():
                data = file.read_bytes()
                tar.addfile(_tar_info(name, len(data)), io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, _gzip(buf.getvalue()))
    return path


def archived_warm_start_digest(archive_dir: Path) -> str | None:
    """sha256 of the archived warm start's policy weights (None: no archived warm start)."""
    path = Path(archive_dir) / WARM_START_ARCHIVE
    if not path.exists():
        return None
    with tarfile.open(path, mode="r:gz") as tar:
        member = tar.extractfile(f"policy/{POLICY_WEIGHTS}")
        if member is None:
            raise ValueError(f"{path} holds no policy/{POLICY_WEIGHTS}")
        return hashlib.sha256(member.read()).hexdigest()


def restore_warm_start(archive_dir: Path, warm_dir: Path, policy_dir: Path) -> bool:
    """Write the archived warm start into ``warm_dir`` (its run records) and ``policy_dir``
    (its policy) unless ``policy_dir`` holds a complete policy (its ``config.json``, which
    the export and this restore write last); returns whether it wrote.

    Raises:
        ArchiveMismatchError: ``policy_dir`` holds a different warm start than the archive.
    """
    archived = archived_warm_start_digest(archive_dir)
    if archived is None:
        return False
    if (Path(policy_dir) / "config.json").exists():  # a complete export (written last)
        local = policy_digest(policy_dir)
        if local != archived:
            raise ArchiveMismatchError(
                f"{policy_dir} is warm start {local}, the archive {archive_dir} holds "
                f"{archived}: one grid, one warm start (move the local grid aside to resume "
                "the archived one)"
            )
        return False
    Path(policy_dir).mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(archive_dir) / WARM_START_ARCHIVE, mode="r:gz") as tar:
        # the policy's config.json last: its presence marks a complete policy
        members = sorted(tar.getmembers(), key=lambda m: m.name == "policy/config.json")
        for member in members:
            folder, _, name = member.name.partition("/")
            target = {"run": Path(warm_dir), "policy": Path(policy_dir)}.get(folder)
            source = tar.extractfile(member)
            if target is None or source is None or "/" in name:
                raise ValueError(f"unexpected member {member.name} in {archive_dir}")
            write_atomic(target / name, source.read())
    return True
