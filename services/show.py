"""``stppo show``: read per-question records (:mod:`services.records`) in the terminal.

A table of the latest evaluation's records (or of the last step's training samples),
filterable by data source and verdict, with a recount of success and malformed answers
over what is shown and, for a run directory, whether the stabilisers acted
(:mod:`services.stabilisers`); ``record`` expands one record in full: every turn's text, search
query and returned passages, the compared forms and the verdict.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.records import (
    EVAL_RECORDS,
    TRAIN_SAMPLES,
    evaluation_key,
    latest_evaluation,
    read_records,
    recount,
)


def records_file(path: Path, samples: bool = False) -> Path:
    """The records file ``path`` names: a ``.jsonl`` file itself, or in a run directory
    ``eval_samples.jsonl`` (``samples.jsonl`` with ``samples``).

    Raises:
        FileNotFoundError: no such file (the message says what was looked for).
    """
    if path.is_dir():
        file = path / (TRAIN_SAMPLES if samples else EVAL_RECORDS)
        if not file.exists():
            what = "training samples" if samples else "evaluation records"
            raise FileNotFoundError(f"{path} has no {file.name} ({what}); is it a run directory?")
        return file
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run directory or records file")
    return path


def select(
    records: Sequence[Mapping[str, Any]],
    data_source: str | None = None,
    correct: bool | None = None,
) -> list[tuple[int, Mapping[str, Any]]]:
    """``(row number, record)`` of the records that pass the filters; row numbers count
    from 1 over all of ``records``, so a row keeps its number under any filter."""
    rows = list(enumerate(records, 1))
    if data_source is not None:
        rows = [(i, r) for i, r in rows if r.get("data_source") == data_source]
    if correct is not None:
        rows = [(i, r) for i, r in rows if bool(r.get("correct")) == correct]
    return rows


def find_record(records: Sequence[Mapping[str, Any]], which: str) -> Mapping[str, Any]:
    """The record ``which`` names: a row number (1-based, as in the table) or a
    ``question_id`` (or a training sample's ``trajectory_id``).

    Raises:
        LookupError: no such row or id.
    """
    if which.isdigit():
        index = int(which)
        if not 1 <= index <= len(records):
            raise LookupError(f"no row {index}: the evaluation has {len(records)} records")
        return records[index - 1]
    for r in records:
        if which in (r.get("question_id"), r.get("trajectory_id")):
            return r
    raise LookupError(f"no record with id {which!r}")


def _title(records: Sequence[Mapping[str, Any]]) -> str:
    first = records[0]
    if first.get("kind") == "train":
        return f"training samples of step {first.get('step')}"
    tag, step = evaluation_key(first)
    modes = sorted({str(r.get("mode", "agent")) for r in records})
    return f"evaluation {tag!r} at learner step {step} ({', '.join(modes)})"


def render(
    path: Path,
    data_source: str | None = None,
    correct: bool | None = None,
    record: str | None = None,
    samples: bool = False,
    console: Any = None,
) -> int:
    """Print the latest evaluation (or step) of ``path`` as a table, or one record in full.

    Args:
        path: a run directory or a records file (see :func:`records_file`).
        data_source: show only this QA set.
        correct: True / False to show only correct / incorrect answers; None for all.
        record: a row number or id to expand (:func:`find_record`) instead of the table.
        samples: read ``samples.jsonl`` (the last step's samples) instead.
        console: a ``rich.console.Console`` (default: stdout, 160 columns when not a tty).

    Returns:
        The number of records printed.

    Raises:
        FileNotFoundError: see :func:`records_file`.
        LookupError: ``record`` names none.
        ValueError: the file has no records, or a line is not JSON.
    """
    from rich.console import Console

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    file = records_file(path, samples)
    latest = latest_evaluation(read_records(file))
    if not latest:
        raise ValueError(f"{file} has no records")
    if record is not None:
        _print_record(console, find_record(latest, record))
        return 1
    rows = select(latest, data_source, correct)
    console.print(_table(rows, _title(latest), caption=str(file)))
    if rows:
        counts = recount([r for _, r in rows])
        console.print(
            f"{len(rows)} of {len(latest)} records: success {counts['success_rate']:.3f}, "
            f"malformed {counts['malformed_rate']:.3f}, searches {counts['searches_mean']:.2f}"
        )
    else:
        console.print(f"0 of {len(latest)} records pass the filters")
    if path.is_dir() and (path / "steps.jsonl").exists():
        from services.run_records import read_records as read_steps
        from services.stabilisers import activity_line, stabiliser_activity

        steps = read_steps(path / "steps.jsonl", "step")
        if steps:
            console.print(activity_line(stabiliser_activity(steps)))
    if path.is_dir() and (path / "guard.jsonl").exists():
        from services.loop.autopilot import GUARD_LOG, log_line
        from services.run_records import read_records as read_log

        decisions = read_log(path / GUARD_LOG)
        console.print(log_line(decisions, decisions[-1].get("mode") if decisions else None))
    return len(rows)


def _table(rows: list[tuple[int, Mapping[str, Any]]], title: str, caption: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    train = bool(rows) and rows[0][1].get("kind") == "train"
    table = Table(title=title, caption=caption)
    for col in ("#", "question_id", "set", "correct", "malformed", "searches", "answer"):
        table.add_column(col)
    table.add_column("golden", max_width=30)
    if train:
        table.add_column("reward")
        table.add_column("staleness")
    table.add_column("question", max_width=60)
    for i, r in rows:
        cells = [
            str(i),
            str(r.get("question_id")),
            str(r.get("data_source")),
            "yes" if r.get("correct") else "no",
            r.get("malformed_reason") or "",
            str(r.get("num_searches")),
            r.get("answer") or "",
            " | ".join(r.get("golden_answers") or []),
        ]
        if train:
            cells += [f"{r.get('reward', 0.0):.3g}", str(r.get("staleness"))]
        cells.append(r.get("question") or "")
        table.add_row(*(Text(c) for c in cells))  # Text: no markup in policy output
    return table


def _print_record(console: Any, r: Mapping[str, Any]) -> None:
    from rich.rule import Rule
    from rich.text import Text

    def line(label: str, value: Any) -> None:
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        console.print(Text.assemble((f"{label}: ", "bold"), shown))

    console.print(Rule(Text(f"{r.get('question_id')} ({r.get('data_source')})")))
    line("question", r.get("question"))
    line("golden answers", r.get("golden_answers"))
    for k, turn in enumerate(r.get("turns") or []):
        console.print(Rule(Text(f"turn {k}: {turn.get('tokens')} tokens"), style="dim"))
        console.print(Text(turn.get("text") or ""))
        if turn.get("search_query") is not None:
            line("search", turn["search_query"] or "(empty: invalid search)")
            for p in turn.get("passages") or []:
                console.print(Text(f"  {p['id']}  {p['title']}"))
        for name in ("advantage", "behavior_logprob"):
            if turn.get(name) is not None:
                line(name, turn[name])
    console.print(Rule(style="dim"))
    line("answer", r.get("answer"))
    line("scoring", r.get("scoring"))
    verdict = "correct" if r.get("correct") else "incorrect"
    if r.get("malformed"):
        verdict += f", malformed: {r.get('malformed_reason')}"
    line("verdict", verdict)
    keys = ("finish_reason", "num_searches", "num_turns", "tokens", "policy_version_min",
            "policy_version_max", "retrieval_error", "reward", "staleness", "trajectory_id",
            "text_cap_chars", "truncated")  # fmt: skip
    for key in keys:
        if key in r and r[key] is not None:
            line(key, r[key])
