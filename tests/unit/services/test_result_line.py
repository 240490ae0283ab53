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
