"""Question sampling for rollouts: uniform over QA sets, deterministic, resumable.

The i-th draw takes set ``datasets[i % len(datasets)]`` and the next question of that set's
seeded permutation (re-shuffled each epoch). The whole state is the draw counter, so a
resumed run continues exactly where the checkpoint left off.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from services.config import DataSection


def read_qa_split(qa_dir: Path, dataset: str, split: str) -> list[dict]:
    """Records of ``<qa_dir>/<dataset>/<split>.jsonl`` (Search-R1 format).

    Raises:
        FileNotFoundError: the split file is missing (names it and the command that builds it).
        ValueError: a line is not a JSON object with ``question`` and ``golden_answers``.
    """
    path = qa_dir / dataset / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `stppo prepare`")
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            rec = json.loads(line)
            if not isinstance(rec, dict) or "question" not in rec or "golden_answers" not in rec:
                raise ValueError(
                    f"{path}:{lineno}: expected a QA record with question and golden_answers"
                )
            records.append(rec)
    if not records:
        raise ValueError(f"{path} has no records")
    return records


@dataclass
class QuestionSampler:
    """Round-robin over QA sets, seeded permutation within each set.

    Args:
        records: dataset name -> its records (e.g. from :func:`read_qa_split`).
        seed: permutation seed.
        num_drawn: draws already made (restored from a checkpoint).
    """

    records: dict[str, list[dict]]
    seed: int = 0
    num_drawn: int = 0
    _names: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.records or any(not r for r in self.records.values()):
            raise ValueError("every QA set needs at least one record")
        self._names = sorted(self.records)

    @classmethod
    def from_data(
        cls,
        data: DataSection,
        split: str,
        seed: int,
        side: Literal["rl", "warm_start"] | None = None,
    ) -> QuestionSampler:
        """Load ``split`` of the sets ``data`` names (built-in sets or your own files).

        ``side`` (training split only) keeps one side of ``data.warm_start_share``
        (:func:`warm_start_split`): ``"rl"`` the questions RL may draw, ``"warm_start"`` the
        ones kept for demonstrations; None (or a share of 0) the whole split.

        Raises:
            ValueError: a side left with no question of some set.
        """
        sets = qa_sets(data, split)
        if side is not None and data.warm_start_share > 0.0:
            warm, rl = warm_start_split(sets, data.warm_start_share)
            sets = warm if side == "warm_start" else rl
        return cls(sets, seed=seed)

    def _record(self, draw: int) -> dict:
        name = self._names[draw % len(self._names)]
        pool = self.records[name]
        k = draw // len(self._names)  # k-th draw from this set
        epoch, pos = divmod(k, len(pool))
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode()), epoch])
        perm = rng.permutation(len(pool))
        return pool[int(perm[pos])]

    def sample(self, n: int) -> list[dict]:
        """The next ``n`` questions."""
        out = [self._record(self.num_drawn + i) for i in range(n)]
        self.num_drawn += n
        return out


def qa_sets(data: DataSection, split: str) -> dict[str, list[dict]]:
    """Set name -> records of ``split`` (``train``, ``validation`` or ``test``).

    Built-in sets (``data.qa_dir`` + ``data.datasets``) are named by dataset; your own files
    (``data.<split>_files``, read by :func:`services.qa_data.load_qa_files`) by path.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_qa_split` (built-in sets).
        services.qa_data.QADataError: a file is missing or malformed, or ``split`` has no files.
    """
    if not data.uses_files:
        return {d: read_qa_split(data.qa_dir, d, split) for d in data.datasets}
    from services.qa_data import QADataError, load_qa_files

    files = getattr(data, f"{split}_files")
    if not files:
        raise QADataError(f"data.{split}_files is empty: no {split} QA files configured")
    return load_qa_files(files)


def entity_key(record: dict) -> str:
    """What :func:`warm_start_split` hashes: ``metadata.entity`` when the record names one,
    else its ``id``, else its question text."""
    entity = (record.get("metadata") or {}).get("entity")
    if entity:
        return f"entity:{entity}"
    return f"id:{record['id']}" if "id" in record else f"question:{record['question']}"


def warm_start_split(
    sets: dict[str, list[dict]], share: float
) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """Split every set into (warm-start side, RL side) by a stable hash of each record's
    :func:`entity_key`: a record goes to the warm start when ``crc32(key) / 2**32 < share``.

    The split does not depend on any seed or on the order of the records, and every
    question about one entity lands on the same side (on the synthetic task, the one-hop and
    the two-hop question about a record).

    Raises:
        ValueError: ``share`` outside (0, 1), or a side with no record of some set (the
            message names the set and the counts).
    """
    if not 0.0 < share < 1.0:
        raise ValueError(f"warm_start_share must be in (0, 1), got {share}")
    warm: dict[str, list[dict]] = {}
    rl: dict[str, list[dict]] = {}
    for name, records in sets.items():
        to_warm = [zlib.crc32(entity_key(r).encode()) / 2**32 < share for r in records]
        warm[name] = [r for r, w in zip(records, to_warm, strict=True) if w]
        rl[name] = [r for r, w in zip(records, to_warm, strict=True) if not w]
        if not warm[name] or not rl[name]:
            raise ValueError(
                f"data.warm_start_share = {share} leaves QA set {name!r} with "
                f"{len(warm[name])} warm-start and {len(rl[name])} RL questions of "
                f"{len(records)}: each side needs at least one"
            )
    return warm, rl


def evaluation_questions(data: DataSection, split: str, n: int, seed: int = 1234) -> list[dict]:
    """A fixed, evenly split sample of ``n`` questions for before/after comparisons."""
    if n <= 0:
        return []
    return QuestionSampler(qa_sets(data, split), seed=seed).sample(n)
