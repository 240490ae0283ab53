"""Crash-consistent checkpoints (services.loop.checkpoint, services.atomic) on real files."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from services.atomic import DiskFullError, is_disk_full, write_atomic
from services.loop.checkpoint import (
    CheckpointStore,
    DriverState,
    checkpoint_problem,
    checkpoint_step,
)


def learner_files(directory: Path, size: int = (1 << 20) + 1) -> None:
    """What a learner's save writes, in small: a weights file and its state."""
    (directory / "policy").mkdir(parents=True)
    (directory / "policy" / "model.pt").write_bytes(b"w" * size)
    (directory / "learner_state.json").write_text('{"tag": "step_1"}')


def save(store: CheckpointStore, step: int, **kwargs) -> Path:
    return store.save(
        step, DriverState(learner_step=step), {"run": {"name": "x"}}, learner_files, **kwargs
    )


def test_a_saved_checkpoint_is_complete_named_by_latest_and_loads(tmp_path: Path):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2, every_k_steps=2)
    path = save(store, 4)
    assert (
        path.name == "step_000004"
        and not (tmp_path / "checkpoints" / "step_000004.partial").exists()
    )
    assert checkpoint_problem(path) is None
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000004"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["files"]["policy/model.pt"] == {"bytes": (1 << 20) + 1}  # large: size only
    assert "sha256" in manifest["files"]["driver_state.json"]  # small: hashed too
    state, config = store.load(store.latest())
    assert state.learner_step == 4 and config == {"run": {"name": "x"}}
    assert checkpoint_step(path) == 4 and store.last_saved_step == 4
    assert [store.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]


def test_damaged_or_partial_checkpoints_are_never_resumed_and_are_moved_aside(tmp_path: Path):
    root = tmp_path / "checkpoints"
    store = CheckpointStore(root, keep_last=3)
    good = save(store, 2)
    newer = save(store, 4)
    # a truncated weights file (a kill mid-copy, a disk error): size disagrees with the manifest
    (newer / "policy" / "model.pt").write_bytes(b"w" * 10)
    assert "model.pt has 10 bytes, the manifest says 1048577" in checkpoint_problem(newer)
    assert store.latest() == good  # latest names step 4, which is damaged: the newest complete
    # a checkpoint killed before its manifest, and one killed while written
    (root / "step_000006").mkdir()
    (root / "step_000006" / "driver_state.json").write_text("{")
    learner_files(root / "step_000008.partial")
    assert (
        checkpoint_problem(root / "step_000006")
        == "no manifest.json (the checkpoint was not finished)"
    )
    moved = dict(store.sweep())
    assert set(moved) == {"step_000004", "step_000006", "step_000008.partial"}
    assert [p.name for p in root.glob("step_*")] == ["step_000002"]
    assert len(list((root / "incomplete").iterdir())) == 3
    # a checkpoint from before manifests (driver_state.json readable) still resumes
    legacy = root / "step_000010"
    legacy.mkdir()
    (legacy / "driver_state.json").write_text('{"learner_step": 10}')
    assert checkpoint_problem(legacy) is None and store.latest() == legacy
    # a changed small file is caught by its hash
    (good / "config.json").write_text(json.dumps({"run": {"name": "y"}}, indent=2))
    assert checkpoint_problem(good) == "config.json does not match its SHA-256"


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path):
    store = CheckpointStore(tmp_path / "checkpoints")
    first = save(store, 2)

    def dies(directory: Path) -> None:
        learner_files(directory)
        raise KeyboardInterrupt  # killed in the middle of the learner's save

    with pytest.raises(KeyboardInterrupt):
        store.save(3, DriverState(learner_step=3), {}, dies)
    assert store.latest() == first  # the partial folder is not a checkpoint
    assert store.sweep() == [("step_000003.partial", "partial (interrupted while written)")]


def test_a_full_disk_names_the_path_and_the_bytes_and_keeps_the_previous(tmp_path: Path):
    store = CheckpointStore(tmp_path / "checkpoints")
    first = save(store, 2)
    expected = json.loads((first / "manifest.json").read_text())["bytes"]

    def full(directory: Path) -> None:
        learner_files(directory)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError) as error:
        store.save(4, DriverState(learner_step=4), {}, full)
    message = str(error.value)
    assert "step_000004.partial" in message and f"needed about {expected:,} bytes" in message
    assert (
        store.latest() == first and not (tmp_path / "checkpoints" / "step_000004.partial").exists()
    )
    # Ray reports the learner's error as text
    assert is_disk_full(RuntimeError("RayTaskError(OSError): [Errno 28] No space left on device"))
    assert not is_disk_full(RuntimeError("shape mismatch"))


def test_prune_keeps_the_newest_and_the_one_latest_names(tmp_path: Path):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=2)
    for step in (1, 2, 3, 4):
        save(store, step)
    assert [p.name for p in store.complete()] == ["step_000003", "step_000004"]
    # saving the same step again (after a resume) replaces it
    save(store, 4)
    assert [p.name for p in store.complete()] == ["step_000003", "step_000004"]


def test_write_atomic_replaces_whole_files(tmp_path: Path):
    path = tmp_path / "state.json"
    write_atomic(path, "old")
    write_atomic(path, b"new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left


def test_a_failure_on_a_full_filesystem_is_a_disk_full_error(tmp_path: Path, monkeypatch):
    """torch.save reports ENOSPC as 'unexpected pos ...': the free space decides."""
    from services.loop import checkpoint as module

    store = CheckpointStore(tmp_path / "checkpoints")

    def torn(directory: Path) -> None:
        learner_files(directory)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6027840")

    monkeypatch.setattr(module, "free_bytes", lambda path: 1000)
    with pytest.raises(DiskFullError, match="1,000 free"):
        store.save(2, DriverState(learner_step=2), {}, torn)
    monkeypatch.setattr(module, "free_bytes", lambda path: 10 << 30)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        store.save(2, DriverState(learner_step=2), {}, torn)
