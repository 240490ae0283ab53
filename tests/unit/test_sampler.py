from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.sampler import QuestionSampler, read_qa_split


def recs(name: str, n: int) -> list[dict]:
    return [{"id": f"{name}-{i}", "question": f"q{i}", "golden_answers": ["a"]} for i in range(n)]


def test_round_robin_over_sets_and_full_epoch_coverage():
    s = QuestionSampler({"a": recs("a", 3), "b": recs("b", 5)}, seed=7)
    drawn = s.sample(6)
    assert [r["id"][0] for r in drawn] == ["a", "b", "a", "b", "a", "b"]
    assert sorted(r["id"] for r in drawn if r["id"][0] == "a") == [
        "a-0",
        "a-1",
        "a-2",
    ]  # one epoch of a


def test_resume_continues_the_same_sequence():
    full = QuestionSampler({"a": recs("a", 4), "b": recs("b", 3)}, seed=3).sample(20)
    first = QuestionSampler({"a": recs("a", 4), "b": recs("b", 3)}, seed=3)
    head = first.sample(9)
    resumed = QuestionSampler(
        {"a": recs("a", 4), "b": recs("b", 3)}, seed=3, num_drawn=first.num_drawn
    )
    assert [r["id"] for r in head + resumed.sample(11)] == [r["id"] for r in full]


def test_seed_changes_order():
    a = [r["id"] for r in QuestionSampler({"a": recs("a", 50)}, seed=1).sample(50)]
    b = [r["id"] for r in QuestionSampler({"a": recs("a", 50)}, seed=2).sample(50)]
    assert a != b and sorted(a) == sorted(b)


def test_read_split_errors_name_the_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="stppo prepare"):
        read_qa_split(tmp_path, "single_hop", "train")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "train.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:1"):
        read_qa_split(tmp_path, "x", "train")
