"""Experiment trackers (services.tracking): the values logged are read back from the
TensorBoard event files, the MLflow file store and the W&B offline run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tracking_readers import history, mlflow_run, read_tensorboard, read_wandb_history

from services.config import ConfigError, load_config
from services.tracking import Tracker, TrackingConfig


def test_backends_are_checked_at_config_load(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.backends\.0: Input should be"):
        load_config(None, ['tracking.backends=["neptune"]'])
    with pytest.raises(ConfigError, match="listed twice"):
        load_config(None, ['tracking.backends=["mlflow", "mlflow"]'])
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"tracking\.backends: .*'wandb' .*not installed \(pip install wandb=="
    ):
        load_config(None, ['tracking.backends=["tensorboard", "wandb"]'])
    assert load_config(None, ['tracking.backends=["tensorboard"]']).tracking.backends == [
        "tensorboard"
    ]


def test_driver_records_reach_every_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    live = {
        "buffer": {"max_staleness": 1},
        "algorithm": {"variant": "st_ppo"},
        "run": {"name": "r"},
    }
    tracker = Tracker(
        TrackingConfig(backends=["tensorboard", "mlflow", "wandb"]),
        tmp_path, "r", live, live_config=lambda: live,
    )  # fmt: skip
    tracker.log_record("sft.jsonl", {"loss_first": 3.5, "loss_last": 1.25, "policy_version": 2})
    tracker.log_record("eval.jsonl", {"tag": "start", "learner_step": 0, "success_rate": 0.25})
    for step, loss in ((1, 0.5), (2, 0.375)):
        tracker.log_record(
            "steps.jsonl",
            {"step": step, "loss": loss, "variant": "st_ppo", "clip_ratio": float("nan")},
        )
    live["buffer"]["max_staleness"] = 3
    live["algorithm"]["variant"] = "ppo"
    tracker.log_record(
        "config_changes.jsonl",
        {"learner_step": 2, "fields": ["algorithm.variant", "buffer.max_staleness"]},
    )
    tracker.log_record(
        "eval.jsonl",
        {"tag": "end", "learner_step": 2, "success_rate": 0.5, "success_rate/nq": 0.75},
    )
    tracker.log_record("consumed.jsonl", {"step": 2, "ids": ["d0-g0"]})  # not a metric log
    tracker.close()
    directory = tmp_path / "tracking"

    scalars, texts = read_tensorboard(directory / "tensorboard")
    assert scalars["train/loss"] == [(1, 0.5), (2, 0.375)]
    assert "train/clip_ratio" not in scalars  # non-finite values are left out
    assert scalars["eval/success_rate"] == [(0, 0.25), (2, 0.5)]
    assert scalars["eval/success_rate/nq"] == [(2, 0.75)]
    assert scalars["sft/loss_last"] == [(0, 1.25)]
    assert scalars["config/buffer.max_staleness"] == [(2, 3.0)]
    assert texts["config/algorithm.variant"] == [(2, "ppo")]
    assert json.loads(texts["config"][0][1].strip("`\n"))["buffer"]["max_staleness"] == 1
    assert not any(t.startswith("consumed") for t in scalars)

    client, run = mlflow_run(directory)
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert history(client, run, "train/loss") == [(1, 0.5), (2, 0.375)]
    assert history(client, run, "eval/success_rate") == [(0, 0.25), (2, 0.5)]
    # per-set keys nest one level deeper: kept apart from eval/success_rate in the file store
    assert history(client, run, "eval/success_rate.nq") == [(2, 0.75)]
    assert history(client, run, "config/buffer.max_staleness") == [(2, 3.0)]
    assert run.data.tags["config/algorithm.variant"] == "ppo"
    assert run.data.params["buffer.max_staleness"] == "1"  # the config at start

    (run_file,) = (directory / "wandb").glob("offline-run-*/run-*.wandb")
    rows = read_wandb_history(run_file)

    def series(key: str) -> list[tuple[int, float]]:
        return [(r["learner_step"], r[key]) for r in rows if key in r]

    assert series("train/loss") == [(1, 0.5), (2, 0.375)]
    assert series("eval/success_rate") == [(0, 0.25), (2, 0.5)]
    assert series("sft/loss_first") == [(0, 3.5)]
    assert series("config/buffer.max_staleness") == [(2, 3)]


def test_a_failing_backend_is_switched_off_not_fatal(tmp_path: Path) -> None:
    tracker = Tracker(TrackingConfig(backends=["tensorboard"]), tmp_path, "r", {})
    tracker.backends["tensorboard"].writer.close()
    tracker.backends["tensorboard"].writer = None  # any call now raises AttributeError
    tracker.log_record("steps.jsonl", {"step": 1, "loss": 1.0})
    assert tracker.backends == {}
    tracker.close()


def test_per_question_records_reach_every_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    tracker = Tracker(
        TrackingConfig(backends=["tensorboard", "mlflow", "wandb"]), tmp_path, "r", {}
    )
    turns = [{"text": "<answer> Lima | Peru </answer>", "tokens": 7, "search_query": None,
              "passages": []}]  # fmt: skip
    records = [
        {"kind": "eval", "tag": "end", "learner_step": 4, "question_id": "single_hop/v/0",
         "data_source": "single_hop", "question": "Capital of Peru?",
         "golden_answers": ["Lima"], "turns": turns, "answer": "Lima | Peru",
         "correct": False, "malformed_reason": None, "num_searches": 0},
        {"kind": "eval", "tag": "end", "learner_step": 4, "question_id": "single_hop/v/1",
         "data_source": "single_hop", "question": "Capital of Chile?",
         "golden_answers": ["Santiago"], "turns": [], "answer": None, "correct": False,
         "malformed_reason": "no_answer", "num_searches": 2},
    ]  # fmt: skip
    tracker.log_records("eval_samples/end", records, step=4)
    tracker.log_records("eval_samples/start", [], step=0)  # nothing to log: no call
    tracker.close()
    directory = tmp_path / "tracking"

    _, texts = read_tensorboard(directory / "tensorboard")
    ((step, table),) = texts["eval_samples/end"]
    lines = table.splitlines()
    assert step == 4 and len(lines) == 4  # header, separator, two rows
    assert lines[0].startswith("| question_id | data_source | correct | malformed_reason |")
    assert r"Lima \| Peru" in lines[2]  # a | in a cell does not split it
    assert "| no_answer |" in lines[3]
    assert "eval_samples/start" not in texts

    client, run = mlflow_run(directory)
    local = client.download_artifacts(run.info.run_id, "eval_samples/end_step000004.jsonl")
    assert [json.loads(line) for line in Path(local).read_text().splitlines()] == records

    (run_dir,) = (directory / "wandb").glob("offline-run-*")
    (row,) = [r for r in read_wandb_history(next(run_dir.glob("run-*.wandb")))
              if "eval_samples/end/path" in r]  # fmt: skip
    assert (row["learner_step"], row["eval_samples/end/_type"]) == (4, "table-file")
    table = json.loads((run_dir / "files" / row["eval_samples/end/path"]).read_text())
    assert table["columns"][:3] == ["question_id", "data_source", "correct"]
    assert table["columns"][-1] == "turns"
    by_id = {r[0]: dict(zip(table["columns"], r, strict=True)) for r in table["data"]}
    assert by_id["single_hop/v/1"]["malformed_reason"] == "no_answer"
    assert json.loads(by_id["single_hop/v/0"]["turns"]) == turns
