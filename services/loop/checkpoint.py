"""The driver's checkpoints: what they hold, when one is due, how one is made complete.

A checkpoint ``checkpoints/step_NNNNNN/`` holds the learner's state (DeepSpeed engines,
``learner_state.json``, written by the learner), ``driver_state.json`` (:class:`DriverState`)
and ``config.json`` (the live config when it was taken). It is written crash-consistently:

1. everything goes into ``step_NNNNNN.partial/``;
2. ``manifest.json`` lists every file with its size (and the SHA-256 of the small ones),
   after an fsync of the whole tree;
3. the folder is renamed to ``step_NNNNNN`` (atomic), and ``checkpoints/latest`` is
   replaced atomically to name it, last.

A ``kill -9`` or a full disk at any moment leaves either the previous checkpoint named by
``latest``, or the new one complete. A checkpoint is complete only when its manifest
matches its files (:func:`checkpoint_problem`; a ``step_N`` folder from before manifests,
with a readable ``driver_state.json``, is taken as written); an incomplete or partial one is never
resumed from, and :meth:`CheckpointStore.sweep` moves it to ``checkpoints/incomplete/``
with its reason. Ray-free: the learner's part is written by a callable.

Retention (:meth:`CheckpointStore.prune`): the newest ``checkpoint.keep_last``, the one
``latest`` names, and those a rollback of the stability guard may go to
(:attr:`CheckpointStore.keep_before`), the last one of which ``checkpoints/last_good`` names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.atomic import DiskFullError, free_bytes, fsync_tree, is_disk_full, write_atomic

log = logging.getLogger("stppo.checkpoint")

MANIFEST = "manifest.json"
"""The file whose presence and agreement make a checkpoint complete."""

LATEST = "latest"
"""``checkpoints/latest``: the name of the checkpoint a resume starts from."""

LAST_GOOD = "last_good"
"""``checkpoints/last_good``: the checkpoint the retention keeps for a rollback."""

INCOMPLETE_DIR = "incomplete"
"""``checkpoints/incomplete/``: partial or damaged checkpoints moved aside."""

FULL_BELOW_BYTES = 4 << 20
"""A save that failed with less than this free on its filesystem failed for lack of space."""

HASHED_MAX_BYTES = 1 << 20
"""Files up to this size get a SHA-256 in the manifest (the state and config JSONs);
larger ones (weights, optimizer states) are checked by size."""


@dataclass
class DriverState:
    """What a checkpoint stores besides the learner's own state."""

    learner_step: int = 0
    policy_version: int = 0
    questions_drawn: int = 0
    trajectories_admitted: int = 0
    trajectories_generated: int = 0
    trajectories_consumed: int = 0
    trajectories_dropped_stale: int = 0
    actor_restarts: int = 0
    inflight_weight_updates: int = 0  # updates that landed while a rollout batch ran
    warm_started: bool = False
    elapsed_s: float = 0.0  # training wall time up to the checkpoint, summed over attempts
    record_lines: dict[str, int] = field(default_factory=dict)  # lines per *.jsonl file
    guard: dict[str, Any] = field(default_factory=dict)  # services.loop.guard_state.save_state


def checkpoint_name(step: int) -> str:
    """``step_NNNNNN``: the folder of learner step ``step``'s checkpoint."""
    return f"step_{step:06d}"


def step_of(path: Path) -> int:
    """The learner step in a checkpoint folder's name (``step_000012`` -> 12).

    Raises:
        ValueError: not a ``step_N`` name.
    """
    return int(path.name.split(".")[0].removeprefix("step_"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(directory: Path) -> dict[str, Any]:
    """fsync every file under ``directory``, then write its ``manifest.json`` atomically:
    ``{"files": {relative path: {"bytes": n, "sha256": ... (small files)}}, "bytes": total}``.

    Returns:
        The manifest.
    """
    fsync_tree(directory)
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = path.stat().st_size
        entry: dict[str, Any] = {"bytes": size}
        if size <= HASHED_MAX_BYTES:
            entry["sha256"] = _sha256(path)
        files[str(path.relative_to(directory))] = entry
    manifest = {"files": files, "bytes": sum(f["bytes"] for f in files.values())}
    write_atomic(directory / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def checkpoint_problem(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or None when it is: its manifest
    exists, parses, and every file it lists exists with its size (and hash)."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        # a step_N folder without a manifest was written before manifests existed (new ones
        # are renamed from step_N.partial after it): complete if its state reads
        try:
            legacy = json.loads((directory / "driver_state.json").read_text())
            if isinstance(legacy, dict) and "learner_step" in legacy:
                return None
        except (OSError, ValueError):
            pass
        return "no manifest.json (the checkpoint was not finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest.json ({type(e).__name__})"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its SHA-256"
    if "driver_state.json" not in files:
        return "no driver_state.json in the manifest"
    return None


class CheckpointStore:
    """The checkpoints of one run (``<run_dir>/checkpoints``).

    Args:
        root: the checkpoints folder (created on the first save).
        keep_last: complete checkpoints kept (older ones are deleted after a save).
        every_k_steps: a checkpoint is due every this many learner steps (0: never).

    Attributes:
        keep_before: ``(step, newer)`` or None: the newest complete checkpoint before
            learner step ``step`` survives every prune (the last good one), and with
            ``newer`` every later one (:func:`services.loop.guard_state.protect_before`).
    """

    def __init__(self, root: Path, keep_last: int = 2, every_k_steps: int = 0) -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.every_k_steps = every_k_steps
        self.last_saved_step = -1
        self.keep_before: tuple[int, bool] | None = None

    def due(self, step: int) -> bool:
        """A periodic checkpoint is due after learner step ``step``."""
        return bool(self.every_k_steps) and step % self.every_k_steps == 0

    def save(
        self,
        step: int,
        state: DriverState,
        config: dict[str, Any],
        save_learner: Callable[[Path], Any],
    ) -> Path:
        """Write the checkpoint of learner step ``step`` (module docstring, steps 1-3).

        Raises:
            DiskFullError: the disk filled up; the partial folder is removed and the
                previous checkpoint stays the one ``latest`` names.
        """
        final = self.root / checkpoint_name(step)
        partial = final.with_name(final.name + ".partial")
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        try:
            save_learner(partial)
            write_atomic(partial / "driver_state.json", json.dumps(state.__dict__, indent=2))
            write_atomic(partial / "config.json", json.dumps(config, indent=2))
            write_manifest(partial)
            if final.exists():  # a second save of the same step (after a resume): replace it
                shutil.rmtree(final)
            os.replace(partial, final)
            write_atomic(self.root / LATEST, final.name)
        except Exception as e:
            # torch.save reports a full disk as "unexpected pos ...": judge by the free space
            # left at the failure (before the partial folder is removed), too
            free = free_bytes(self.root)
            full = is_disk_full(e) or free < FULL_BELOW_BYTES
            shutil.rmtree(partial, ignore_errors=True)
            if full and not isinstance(e, DiskFullError):
                raise DiskFullError(partial, self._expected_bytes(), free) from e
            raise
        self.last_saved_step = step
        self.prune()
        return final

    def _expected_bytes(self) -> int:
        """The size of the newest complete checkpoint: what the next one needs, about."""
        latest = self.latest()
        if latest is None:
            return 0
        return int(json.loads((latest / MANIFEST).read_text()).get("bytes", 0))

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        steps = sorted(p for p in self.root.glob("step_*") if not p.name.endswith(".partial"))
        return [p for p in steps if p.is_dir() and checkpoint_problem(p) is None]

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the one ``latest`` names if complete, else the
        newest complete one (a kill between the rename and ``latest``), else None. Reads
        only."""
        pointer = self.root / LATEST
        if pointer.is_file():
            named = self.root / pointer.read_text().strip()
            if named.is_dir() and checkpoint_problem(named) is None:
                return named
        complete = self.complete()
        return complete[-1] if complete else None

    def sweep(self) -> list[tuple[str, str]]:
        """Move every partial or incomplete checkpoint folder to ``incomplete/`` (logged
        with its reason); returns ``(name, reason)`` of each moved."""
        moved = []
        for path in sorted(self.root.glob("step_*")):
            if not path.is_dir():
                continue
            reason = (
                "partial (interrupted while written)"
                if path.name.endswith(".partial")
                else checkpoint_problem(path)
            )
            if reason is None:
                continue
            aside = self.root / INCOMPLETE_DIR / f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}"
            aside.parent.mkdir(exist_ok=True)
            os.replace(path, aside)
            log.warning("checkpoint %s moved to %s: %s", path.name, aside, reason)
            moved.append((path.name, reason))
        return moved

    def load(self, path: Path) -> tuple[DriverState, dict[str, Any] | None]:
        """(the driver state, the saved live config or None) of checkpoint ``path``."""
        state = DriverState(**json.loads((path / "driver_state.json").read_text()))
        config_path = path / "config.json"
        saved = json.loads(config_path.read_text()) if config_path.exists() else None
        return state, saved

    def steps(self) -> list[int]:
        """The learner steps of the complete checkpoints, oldest first."""
        return [step_of(p) for p in self.complete()]

    def last_good(self) -> Path | None:
        """The newest complete checkpoint before :attr:`keep_before`'s step, or None."""
        if self.keep_before is None:
            return None
        before = [p for p in self.complete() if step_of(p) < self.keep_before[0]]
        return before[-1] if before else None

    def prune(self) -> None:
        """Delete complete checkpoints beyond the newest ``keep_last``, never the one
        ``latest`` names nor those :attr:`keep_before` keeps: the last good one
        (:meth:`last_good`, which ``checkpoints/last_good`` then names) and, with its
        ``newer``, every later one."""
        good = self.last_good()
        keep = {self.latest(), good}
        if good is not None:
            write_atomic(self.root / LAST_GOOD, good.name)
        newer_from = None
        if self.keep_before is not None and self.keep_before[1]:
            newer_from = self.keep_before[0]
        for old in self.complete()[: -self.keep_last]:
            if old in keep or (newer_from is not None and step_of(old) >= newer_from):
                continue
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_step(path: Path | None) -> int:
    """The learner step of checkpoint ``path`` (0 for None)."""
    if path is None:
        return 0
    return int(json.loads((path / "driver_state.json").read_text())["learner_step"])
