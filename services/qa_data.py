"""QA sets from your own files: Search-R1 records in JSON Lines or Parquet.

A record (one JSON object per line, or one Parquet row) needs::

    {"question": str, "golden_answers": [str, ...], "data_source": str}

and may have ``id`` (str or int; default ``<file stem>-<row>``), ``metadata`` (object), and
multiple-choice options as ``options`` / ``choices`` (top level or inside ``metadata``):
either letter -> text (``{"A": "...", "B": "..."}``) or a list of texts, lettered A, B, C ...
in order. With options, each golden answer is an option letter, an option's exact text, or
a 0-based option index; all are turned into letters. verl/Search-R1 processed Parquet files
that carry the answers only as ``reward_model.ground_truth.target`` are read too; their
``prompt`` column is ignored (the rollout builds its own prompt from ``question``).

What loading produces (what :mod:`actors.rollout`, :mod:`actors.scoring` and
:mod:`actors.prompts` read)::

    {"id": str, "question": str, "golden_answers": [str, ...], "data_source": str,
     "metadata": {..., "options": {"A": str, ...}}}   # options only for multiple choice

A multiple-choice question whose text does not already show every option gets them appended
as ``A. text`` lines. Scoring: option-letter match when options are present, Search-R1's
normalised exact match against any golden answer otherwise, whatever the ``data_source``.

Files are read with pyarrow (Parquet) or the standard ``json`` module (JSON Lines). Every
problem raises :class:`QADataError` naming the file, the line (JSON Lines, 1-based) or the
row (Parquet, 0-based), and the field.

Example::

    records = load_qa_file(Path("nq/train.parquet"))
    records[0]["golden_answers"]   # ['Paris']
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

QA_FILE_SUFFIXES = (".jsonl", ".parquet")
"""Accepted QA file types (by suffix)."""

_LETTERS = string.ascii_uppercase


class QADataError(ValueError):
    """A QA file is missing, unreadable, empty, or holds a malformed record (message names
    the file, the line or row, and the field)."""


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, raw row) pairs: ``line N`` for JSON Lines, ``row N`` for Parquet."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses
            raise QADataError(f"{path}: not a readable Parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"row {i}", row
        return
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise QADataError(f"{path}: line {line_no}: not JSON ({e.msg})") from None
            yield f"line {line_no}", row


def _options(row: Mapping[str, Any], where: str) -> dict[str, str] | None:
    metadata = row.get("metadata") or {}
    raw = None
    for source in (row, metadata):
        for key in ("options", "choices"):
            if source.get(key) is not None:
                raw, field = source[key], ("metadata." if source is metadata else "") + key
                break
        if raw is not None:
            break
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        # Parquet structs come back with every key of the schema; absent ones are None
        items = [(str(k).strip().upper(), v) for k, v in raw.items() if v is not None]
    elif isinstance(raw, list | tuple):
        if len(raw) > len(_LETTERS):
            raise QADataError(f"{where}: field {field!r}: more than {len(_LETTERS)} options")
        items = list(zip(_LETTERS, raw, strict=False))
    else:
        raise QADataError(
            f"{where}: field {field!r}: expected letter -> text or a list of texts, "
            f"got {type(raw).__name__}"
        )
    if len(items) < 2:
        raise QADataError(f"{where}: field {field!r}: needs at least 2 options")
    options: dict[str, str] = {}
    for letter, text in items:
        if len(letter) != 1 or letter not in _LETTERS:
            raise QADataError(f"{where}: field {field!r}: option key {letter!r} is not a letter")
        if not isinstance(text, str) or not text.strip():
            raise QADataError(f"{where}: field {field!r}: option {letter} is not non-empty text")
        options[letter] = text.strip()
    return options


def _golden_letters(golden: list[Any], options: dict[str, str], where: str) -> list[str]:
    by_text = {text: letter for letter, text in options.items()}
    letters = list(options)
    out = []
    for g in golden:
        if isinstance(g, int) and not isinstance(g, bool) and 0 <= g < len(letters):
            out.append(letters[g])
        elif isinstance(g, str) and g.strip().upper() in options:
            out.append(g.strip().upper())
        elif isinstance(g, str) and g.strip() in by_text:
            out.append(by_text[g.strip()])
        else:
            raise QADataError(
                f"{where}: field 'golden_answers': {g!r} is not an option letter "
                f"({', '.join(letters)}), an option's text or a 0-based option index"
            )
    return out


def _golden(row: Mapping[str, Any], where: str) -> list[Any]:
    golden = row.get("golden_answers")
    field = "golden_answers"
    if golden is None:
        target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
        if target is None:
            raise QADataError(f"{where}: field 'golden_answers' is missing")
        golden, field = target, "reward_model.ground_truth.target"
    if hasattr(golden, "tolist"):  # numpy arrays from a pandas-written file
        golden = golden.tolist()
    if not isinstance(golden, list | tuple):
        raise QADataError(
            f"{where}: field {field!r}: expected a list of answers, got {type(golden).__name__}"
        )
    if not golden:
        raise QADataError(f"{where}: field {field!r} is empty")
    return list(golden)


def normalize_record(row: Any, where: str, default_id: str) -> dict[str, Any]:
    """Check one raw record and return it in the loaded form (see module docstring).

    Args:
        row: the parsed JSON object or Parquet row.
        where: ``"<file>: line N"`` / ``"<file>: row N"``, the prefix of every error.
        default_id: the id used when the record has none.

    Raises:
        QADataError: not an object, or a missing / empty / wrongly typed field (named).
    """
    if not isinstance(row, Mapping):
        raise QADataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise QADataError(f"{where}: field 'question' is missing or not non-empty text")
    source = row.get("data_source")
    if not isinstance(source, str) or not source.strip():
        raise QADataError(
            f"{where}: field 'data_source' is missing or not non-empty text "
            "(the set name, e.g. 'nq' or 'hotpotqa')"
        )
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise QADataError(f"{where}: field 'metadata': expected an object")
    golden = _golden(row, where)
    options = _options(row, where)
    if options is not None:
        golden = _golden_letters(golden, options, where)
    elif not all(isinstance(g, str) and g.strip() for g in golden):
        raise QADataError(f"{where}: field 'golden_answers': every answer must be non-empty text")
    rid = row.get("id")
    if rid is None:
        rid = default_id
    elif not isinstance(rid, str | int) or isinstance(rid, bool):
        raise QADataError(f"{where}: field 'id': expected text or an integer")
    record: dict[str, Any] = {
        "id": str(rid),
        "question": question.strip(),
        "golden_answers": golden,
        "data_source": source.strip(),
        "metadata": dict(metadata or {}),
    }
    if options is not None:
        record["metadata"]["options"] = options
        if not all(text in record["question"] for text in options.values()):
            lines = "\n".join(f"{letter}. {text}" for letter, text in options.items())
            record["question"] = f"{record['question']}\n{lines}"
    return record


def load_qa_file(path: Path) -> list[dict[str, Any]]:
    """All records of one JSON Lines or Parquet QA file, checked and normalised.

    Raises:
        QADataError: the file is missing, has another suffix, is unreadable or empty, a
            record is malformed (file + line/row + field named), or an id repeats.
    """
    path = Path(path)
    if path.suffix not in QA_FILE_SUFFIXES:
        raise QADataError(f"{path}: unsupported QA file type; expected {QA_FILE_SUFFIXES}")
    if not path.is_file():
        raise QADataError(f"{path}: QA file does not exist")
    records: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for where, row in _rows(path):
        rec = normalize_record(row, f"{path}: {where}", f"{path.stem}-{len(records)}")
        if rec["id"] in seen:
            raise QADataError(
                f"{path}: {where}: field 'id': {rec['id']!r} repeats ({seen[rec['id']]})"
            )
        seen[rec["id"]] = where
        records.append(rec)
    if not records:
        raise QADataError(f"{path}: holds no QA records")
    return records


def load_qa_files(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """``{str(path): records}`` for each file: each file is one set of the round-robin
    sampler (:class:`services.sampler.QuestionSampler`), so files are mixed uniformly.

    Raises:
        QADataError: as :func:`load_qa_file`, for the first bad file.
    """
    return {str(p): load_qa_file(p) for p in paths}
