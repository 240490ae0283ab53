"""The end of a run says its result (services.evaluate.result_line): validation success when RL started and at the end,
with 95% Wilson intervals, and whether they overlap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.evaluate import result_line


def write_evals(run_dir: Path, evals: list[dict]) -> Path:
    with (run_dir / "eval.jsonl").open("w") as f:
        for record in evals:
            f.write(json.dumps({"run_id": "r1", **record}) + "\n")
    return run_dir


@pytest.mark.parametrize(
    ("start", "end", "verdict"),
    [((4, 24), (6, 24), "the intervals overlap"), ((0, 64), (40, 64), "do not overlap")],
)
def test_the_result_line_states_both_evaluations_with_intervals(tmp_path, start, end, verdict):
    evals = [
        {"tag": "start", "num_questions": start[1], "success_rate": start[0] / start[1],
         "learner_step": 0},
        {"tag": "end", "num_questions": end[1], "success_rate": end[0] / end[1],
         "learner_step": 10},
    ]  # fmt: skip
    line = result_line(write_evals(tmp_path, evals))
    assert line.startswith("validation success (greedy): when RL started ")
    assert f"{start[0]}/{start[1]} = {start[0] / start[1]:.3f} [" in line
    assert f"at the end {end[0]}/{end[1]}" in line and "after 10 RL step(s)" in line
    assert verdict in line
    if start == (4, 24):  # Wilson's interval for 4 of 24: 0.067 to 0.359
        assert "[0.07, 0.36]" in line


def test_no_result_without_both_evaluations(tmp_path):
    evals = [{"tag": "start", "num_questions": 8, "success_rate": 0.5}]
    assert result_line(write_evals(tmp_path, evals)) is None


def write_samples(run_dir: Path, first: list[bool], end: list[bool]) -> None:
    with (run_dir / "eval_samples.jsonl").open("w") as f:
        for tag, correct in (("start", first), ("end", end)):
            for i, c in enumerate(correct):
                f.write(json.dumps({"tag": tag, "question_id": f"q{i}", "correct": c}) + "\n")


def test_the_gain_is_paired_on_the_same_questions(tmp_path):
    # 40 questions: 10 right in both, 8 fixed by RL, 1 broken, 21 wrong in both
    first = [True] * 10 + [False] * 8 + [True] + [False] * 21
    end = [True] * 10 + [True] * 8 + [False] + [False] * 21
    write_samples(tmp_path, first, end)
    evals = [
        {"tag": "start", "num_questions": 40, "success_rate": 11 / 40, "learner_step": 0},
        {"tag": "end", "num_questions": 40, "success_rate": 18 / 40, "learner_step": 8},
    ]
    line = result_line(write_evals(tmp_path, evals))
    # the separate intervals overlap, the paired one does not hold 0
    assert "the intervals overlap" in line
    assert "paired on the same 40 questions: 8 fixed, 1 broken, gain +0.175 [" in line
    assert "above 0: RL gained" in line
    assert "exact McNemar p = 0.039" in line  # 2 * P(Binomial(9, 1/2) <= 1) = 20/512


def test_paired_gain_interval():
    from services.evaluate import paired_gain

    same = {f"q{i}": i < 5 for i in range(20)}
    none = paired_gain(same, same)
    assert (none.gain, none.fixed, none.broken, none.p_value) == (0.0, 0, 0, 1.0)
    assert none.low < 0.0 < none.high
    lost = paired_gain({"a": True, "b": True, "c": True}, {"a": False, "b": False, "c": False})
    assert lost.gain == -1.0 and lost.high < 0.0 and lost.low >= -1.0
    assert paired_gain({"a": True}, {"b": True}) is None  # no question in both
    # pairing narrows the interval: 30 concordant questions carry no noise
    wide = paired_gain({f"q{i}": False for i in range(6)}, {f"q{i}": i < 4 for i in range(6)})
    narrow = paired_gain(
        {f"q{i}": i >= 6 and i < 21 for i in range(36)},
        {f"q{i}": i < 4 or (i >= 6 and i < 21) for i in range(36)},
    )
    assert narrow.high - narrow.low < wide.high - wide.low
