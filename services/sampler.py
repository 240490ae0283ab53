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
from typing import TYPE_CHECKING

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
    def from_dir(cls, qa_dir: Path, datasets: list[str], split: str, seed: int) -> QuestionSampler:
        """Load ``datasets``' ``split`` from ``qa_dir``."""
        return cls({d: read_qa_split(qa_dir, d, split) for d in datasets}, seed=seed)

    @classmethod
    def from_data(cls, data: DataSection, split: str, seed: int) -> QuestionSampler:
        """Load ``split`` of the sets ``data`` names (built-in sets or your own files)."""
        return cls(qa_sets(data, split), seed=seed)

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


def evaluation_questions(data: DataSection, split: str, n: int, seed: int = 1234) -> list[dict]:
    """A fixed, evenly split sample of ``n`` questions for before/after comparisons."""
    if n <= 0:
        return []
    return QuestionSampler(qa_sets(data, split), seed=seed).sample(n)
