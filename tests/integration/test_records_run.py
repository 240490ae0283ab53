"""A short real run (tiny Llama, real retrieval server, Ray, DeepSpeed, a warm start: three
evaluations) leaves per-question records that recount to its eval.jsonl aggregates,
per-step samples of what the learner trained on, the records in the trackers, and
``stppo show`` renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_driver import read_jsonl, tiny_run_config
from tracking_readers import read_tensorboard
from typer.testing import CliRunner

from services.cli import app
from services.records import evaluation_key, recount

pytestmark = pytest.mark.integration


def test_a_short_run_leaves_records_that_recount_to_its_aggregates(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    from services.driver import Driver

    cfg = tiny_run_config(
        tmp_path, tiny_llama_dir,
        **{"run.num_steps": 2, "run.eval_questions": 3, "run.samples_per_step": 3,
           "run.record_text_chars": 24, "checkpoint.every_k_steps": 0,
           "rollout.num_actors": 1, "control.enabled": False,
           "sft.enabled": True, "sft.num_demonstrations": 4, "sft.epochs": 1,
           "tracking.backends": ["tensorboard"]},
    )  # fmt: skip
    Driver(cfg).run()
    run_dir = cfg.run_dir

    aggregates = read_jsonl(run_dir / "eval.jsonl")
    records = read_jsonl(run_dir / "eval_samples.jsonl")
    assert [a["tag"] for a in aggregates] == ["before_warm_start", "start", "end"]
    for aggregate in aggregates:
        key = (aggregate["tag"], aggregate["learner_step"])
        mine = [r for r in records if evaluation_key(r) == key]
        assert len(mine) == aggregate["num_questions"] == 3
        counts = recount(mine)
        for name in ("success_rate", "malformed_rate", "success_rate/single_hop"):
            assert counts[name] == pytest.approx(aggregate[name], abs=1e-12), (key, name)
        assert {r["policy_version_min"] for r in mine} == {aggregate["policy_version"]}
    for r in records:
        assert r["malformed"] == (r["malformed_reason"] is not None)
        assert len(r["turns"]) == r["num_turns"] and r["text_cap_chars"] == 24
        assert all(len(t["text"]) <= 24 for t in r["turns"])
        assert len(r["question"]) <= 24

    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 1, 1, 2, 2, 2]
    consumed = {c["step"]: c["ids"] for c in read_jsonl(run_dir / "consumed.jsonl")}
    for s in samples:
        assert s["trajectory_id"] in consumed[s["step"]]
        assert s["staleness"] >= 0 and isinstance(s["reward"], float)
        for turn in s["turns"]:
            assert set(turn["advantage"]) == {"mean", "min", "max"}
            assert turn["behavior_logprob"]["max"] <= 0.0
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert "turn_advantages" not in steps[0]  # per-trajectory detail stays out of the step log

    _, texts = read_tensorboard(run_dir / "tracking" / "tensorboard")
    assert [step for step, _ in texts["samples/train"]] == [1, 2]
    assert [step for step, _ in texts["eval_samples/end"]] == [2]

    result = CliRunner().invoke(app, ["show", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "evaluation 'end' at learner step 2" in result.output
    assert "3 of 3 records" in result.output
    result = CliRunner().invoke(app, ["show", str(run_dir), "--samples", "--record", "1"])
    assert result.exit_code == 0, result.output
    assert "advantage: " in result.output and json.dumps(samples[3]["question_id"])[1:-1] in (
        result.output
    )
