"""The passage corpus (Search-R1 format) held in memory by the server.

One JSON object per line: ``{"id": str, "contents": str}`` where ``contents`` is
``"\\"Title\\"\\ntext"``. Row ``i`` of the file is passage index ``i`` in every index.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


class CorpusError(ValueError):
    """The corpus file is missing or a line is not a valid passage (message names the line)."""


@dataclass(frozen=True)
class Passages:
    """Passages in file order: ``ids[i]`` and ``contents[i]`` describe passage index ``i``."""

    ids: list[str]
    contents: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def document(self, index: int) -> dict[str, str]:
        """The Search-R1 document of passage ``index``: ``{"id": ..., "contents": ...}``."""
        return {"id": self.ids[index], "contents": self.contents[index]}


def load_passages(path: Path) -> Passages:
    """Read a Search-R1 passages JSONL file.

    Raises:
        CorpusError: the file is missing or empty, a line is not JSON, lacks a string ``id`` /
            ``contents``, or an id repeats.
    """
    if not path.is_file():
        raise CorpusError(f"corpus file {path} does not exist (built by `stppo prepare`)")
    ids: list[str] = []
    contents: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise CorpusError(f"{path}:{line_no}: expected an object, got {type(row).__name__}")
            pid, text = row.get("id"), row.get("contents")
            if not isinstance(pid, str) or not isinstance(text, str):
                raise CorpusError(f'{path}:{line_no}: needs string "id" and "contents"')
            ids.append(pid)
            contents.append(text)
    if not ids:
        raise CorpusError(f"corpus file {path} holds no passages")
    if len(set(ids)) != len(ids):
        raise CorpusError(f"corpus file {path} repeats passage ids")
    return Passages(ids=ids, contents=contents)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file (used to tie an index to the corpus it was built from)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
