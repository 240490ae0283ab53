"""``stppo show``: the latest evaluation's records as a table, filtered, and one in full
(typer's CliRunner; the records are written by services.records.append_records)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.records import append_records


def record(i: int, source: str, correct: bool, tag: str = "end", step: int = 4, **extra):
    malformed = extra.pop("malformed_reason", None)
    return {
        "kind": "eval", "tag": tag, "learner_step": step, "mode": "agent",
        "question_id": f"{source}/validation/{i}", "data_source": source,
        "question": f"Question {i} [bold]?", "golden_answers": [f"gold{i}"],
        "turns": [
            {"text": f"<search> q{i} </search>", "tokens": 5, "search_query": f"q{i}",
             "passages": [{"id": f"p{i}", "title": f"Title {i}"}]},
            {"text": f"<answer> ans{i} </answer>", "tokens": 4, "search_query": None,
             "passages": []},
        ],
        "answer": None if malformed else f"ans{i}",
        "scoring": {"method": "exact_match", "prediction": None if malformed else f"ans{i}",
                    "golden": [f"gold{i}"]},
        "correct": correct, "malformed": malformed is not None, "malformed_reason": malformed,
        "finish_reason": "answer", "retrieval_failed": False, "retrieval_error": None,
        "num_searches": 1, "num_turns": 2, "tokens": {"prompt": 30, "response": 20, "policy": 9},
        "policy_version_min": 3, "policy_version_max": 3, "text_cap_chars": 2000,
        "truncated": [], **extra,
    }  # fmt: skip


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    append_records(tmp_path / "eval_samples.jsonl", [record(9, "single_hop", True, "start", 0)])
    append_records(
        tmp_path / "eval_samples.jsonl",
        [
            record(0, "single_hop", True),
            record(1, "single_hop", False, malformed_reason="no_answer"),
            record(2, "multi_hop", False),
            record(3, "multi_hop", True),
        ],
    )
    return tmp_path


def show(*args: str):
    result = CliRunner().invoke(app, ["show", *args])
    return result.exit_code, result.output


def test_the_latest_evaluation_as_a_table(run_dir: Path) -> None:
    code, out = show(str(run_dir))
    assert code == 0, out
    assert "evaluation 'end' at learner step 4" in out
    for i in range(4):
        assert f"validation/{i}" in out
    assert "validation/9" not in out  # the 'start' evaluation is older
    assert "Question 0 [bold]?" in out  # policy and question text are not rich markup
    assert "no_answer" in out
    assert "4 of 4 records: success 0.500, malformed 0.250, searches 1.00" in out


def test_filters_keep_row_numbers(run_dir: Path) -> None:
    code, out = show(str(run_dir), "--incorrect")
    assert code == 0 and "2 of 4 records: success 0.000" in out
    assert "validation/1" in out and "validation/2" in out and "validation/0" not in out
    code, out = show(str(run_dir), "--data-source", "multi_hop", "--correct")
    assert code == 0 and "1 of 4 records: success 1.000" in out
    assert "│ 4 " in out  # multi_hop/validation/3 keeps its row number 4
    code, out = show(str(run_dir), "--data-source", "nq")
    assert code == 0 and "0 of 4 records pass the filters" in out


def test_one_record_in_full(run_dir: Path) -> None:
    code, by_row = show(str(run_dir), "--record", "2")
    assert code == 0, by_row
    for text in ("single_hop/validation/1", "<search> q1 </search>", "search: q1",
                 "p1  Title 1", "<answer> ans1 </answer>", "malformed: no_answer",
                 '"prediction": null'):  # fmt: skip
        assert text in by_row, text
    code, by_id = show(str(run_dir / "eval_samples.jsonl"), "--record", "single_hop/validation/1")
    assert code == 0 and by_id == by_row


def test_errors_are_one_line(run_dir: Path, tmp_path: Path) -> None:
    code, out = show(str(run_dir), "--record", "7")
    assert code == 2 and "error: no row 7: the evaluation has 4 records" in out
    code, out = show(str(tmp_path / "nowhere"))
    assert code == 2 and "no such run directory or records file" in out
    code, out = show(str(run_dir), "--samples")
    assert code == 2 and "has no samples.jsonl" in out


def test_the_guard_line_sums_up_guard_jsonl(run_dir: Path) -> None:
    import json

    decisions = [
        {"step": 21, "level": "warn", "mode": "warn", "rule": "approx_kl > 0.02",
         "would_act": False, "action": None, "reason": ""},
        {"step": 22, "level": "warn", "mode": "warn", "rule": "malformed_rate > 0.5",
         "would_act": True, "action": "lower_staleness", "reason": "mode warn"},
    ]  # fmt: skip
    (run_dir / "guard.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
    code, out = show(str(run_dir))
    assert code == 0, out
    assert (
        "stability guard (mode warn): 2 warnings from step 21; would have acted at step 22 "
        "(malformed_rate > 0.5: lower_staleness); no action" in " ".join(out.split())
    )
