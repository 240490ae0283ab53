"""The warm start kept for the next run: SFT once per model, data and settings.

A finished warm start (SFT on demonstrations, :meth:`services.loop.phases.Phases.warm_start`)
is saved as a learner checkpoint (policy, critic, their optimizer states, the reference,
the version) under ``<cache>/warm_start/<key>/``, with its ``sft.jsonl`` record. A later
run whose key is the same loads it (:meth:`learner.checkpoint.CheckpointMixin.load_checkpoint`,
the same path a resume takes: the learner continues exactly as if it had just finished the
SFT) instead of building demonstrations and training again: minutes on a laptop CPU.

The key is a SHA-256 over everything the warm start's result depends on:

- the model folder, the QA sets and the retrieval corpus and index: every file's path, size
  and modification time (a re-prepared file is a new key; nothing is read);
- the settings that shape the demonstrations and the SFT: ``[model]``, ``[data]``,
  ``[sft]``, ``[learner]`` (its checkpoint resumes only with the same ranks and ZeRO
  stage), the retrieval's method, corpus and top-k, ``rollout.system_prompt``,
  ``rollout.max_information_tokens``, ``run.seed``, and the learner's dtype once resolved
  (``auto`` is bf16 or fp32 by CPU);
- the code: the source of ``actors``, ``learner`` and ``retrieval_server``.

What it does not cover: the algorithm and RL's learning rates (``learner.actor_lr``,
``learner.critic_lr``), which the warm start does not use (the driver sets the run's own on
the loaded learner). The newest :data:`KEEP` entries are kept. Only a run
with ``sft.cache = true`` (the laptop demo's config) reads or writes the cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from services.atomic import write_atomic
from services.config import RunConfig
from services.env import CACHE_ROOT, PROJECT_ROOT

KEEP = 2
"""Warm starts kept (each is a learner checkpoint: about 4 GB for SmolLM2-135M)."""

DONE = "warm_start.json"
"""Written last, atomically, into an entry: without it the entry is incomplete."""

CODE_PACKAGES = ("actors", "learner", "retrieval_server")


def _files(root: Path) -> list[list[Any]]:
    """``[relative path, size, mtime_ns]`` of every file under ``root`` (or of ``root``)."""
    root = root if root.is_absolute() else PROJECT_ROOT / root
    if root.is_file():
        stat = root.stat()
        return [[root.name, stat.st_size, stat.st_mtime_ns]]
    if not root.is_dir():
        return [[str(root), None, None]]
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = path.stat()
        out.append([str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns])
    return out


def _code_digest() -> str:
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(PROJECT_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def warm_start_key(cfg: RunConfig, dtype: str) -> str:
    """The cache key of ``cfg``'s warm start (module docstring), 16 hex digits.

    Args:
        cfg: the run config (``model.path`` already a local folder).
        dtype: the learner's resolved dtype (``"bf16"`` / ``"fp32"``).
    """
    server = cfg.retrieval.server
    data_files = cfg.data.train_files if cfg.data.uses_files else [cfg.data.qa_dir]
    parts = {
        "model": cfg.model.model_dump(mode="json"),
        "data": cfg.data.model_dump(mode="json"),
        "sft": cfg.sft.model_dump(mode="json"),
        # RL's learning rates do not shape the warm start (SFT runs at sft.lr); a loaded
        # one gets the run's own (Phases.warm_start)
        "learner": cfg.learner.model_dump(mode="json", exclude={"actor_lr", "critic_lr"}),
        "dtype": dtype,
        "retrieval": {
            "method": server.method,
            "corpus_path": str(server.corpus_path),
            "index_dir": str(server.index_dir),
            "client": cfg.rollout.retrieval.model_dump(mode="json"),
        },
        "prompt": [cfg.rollout.system_prompt, cfg.rollout.max_information_tokens],
        "seed": cfg.run.seed,
        "files": {
            "model": _files(Path(cfg.model.path)),
            "data": [_files(Path(p)) for p in data_files],
            "corpus": _files(server.corpus_path),
            "index": _files(server.index_dir),
        },
        "code": _code_digest(),
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class WarmStartCache:
    """Finished warm starts under ``root`` (default ``<STPPO_CACHE_DIR>/warm_start``)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or CACHE_ROOT / "warm_start"

    def lookup(self, key: str) -> tuple[Path, dict[str, Any]] | None:
        """``(learner checkpoint folder, sft.jsonl record)`` of a complete entry, or None."""
        done = self.root / key / DONE
        if not done.is_file():
            return None
        return self.root / key / "learner", json.loads(done.read_text())["record"]

    def staging(self, key: str) -> Path:
        """An empty folder for a new entry's learner checkpoint (``<entry>.partial/learner``;
        a leftover from an interrupted run is removed first)."""
        partial = self.root / f"{key}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "learner").mkdir(parents=True)
        return partial / "learner"

    def commit(self, key: str, record: dict[str, Any]) -> Path:
        """Complete the staged entry of ``key`` (its record written last, then the folder
        renamed into place) and drop all but the newest :data:`KEEP` entries; returns it."""
        partial, final = self.root / f"{key}.partial", self.root / key
        write_atomic(partial / DONE, json.dumps({"key": key, "record": record}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        entries = sorted(
            (p for p in self.root.iterdir() if (p / DONE).is_file()),
            key=lambda p: (p / DONE).stat().st_mtime_ns,
        )
        for old in entries[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        return final
