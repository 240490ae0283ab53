"""Experiment trackers (services.tracking): the values logged are read back from the
TensorBoard event files, the MLflow file store and the W&B offline run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from services.config import ConfigError, load_config
from services.tracking import Tracker, TrackingConfig


def read_tensorboard(directory: Path) -> tuple[dict[str, list[tuple[int, float]]], dict]:
    """scalar tag -> [(step, value)], and text tag -> [(step, text)], from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts = {
        t.removesuffix("/text_summary"): [
            (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)
        ]
        for t in acc.Tags()["tensors"]
    }
    return scalars, texts


def read_wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows of an offline W&B run file (``run-<id>.wandb``).

    Format (W&B's datastore, as the removed ``wandb/sdk/internal/datastore.py`` read it):
    header ``:W&B`` + magic 0xBEE1 + version byte, then LevelDB log blocks of 32 KiB, each
    record ``crc32 (4) | length (2, LE) | type (1: full, 2: first, 3: middle, 4: last)``,
    a record being a serialised ``wandb_internal_pb2.Record``.
    """
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


def mlflow_run(tracking_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracking_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("st-ppo").experiment_id])
    return client, run


def history(client, run, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


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
    tracker.log_record("eval.jsonl", {"tag": "end", "learner_step": 2, "success_rate": 0.5})
    tracker.log_record("consumed.jsonl", {"step": 2, "ids": ["d0-g0"]})  # not a metric log
    tracker.close()
    directory = tmp_path / "tracking"

    scalars, texts = read_tensorboard(directory / "tensorboard")
    assert scalars["train/loss"] == [(1, 0.5), (2, 0.375)]
    assert "train/clip_ratio" not in scalars  # non-finite values are left out
    assert scalars["eval/success_rate"] == [(0, 0.25), (2, 0.5)]
    assert scalars["sft/loss_last"] == [(0, 1.25)]
    assert scalars["config/buffer.max_staleness"] == [(2, 3.0)]
    assert texts["config/algorithm.variant"] == [(2, "ppo")]
    assert json.loads(texts["config"][0][1].strip("`\n"))["buffer"]["max_staleness"] == 1
    assert not any(t.startswith("consumed") for t in scalars)

    client, run = mlflow_run(directory)
    assert run.info.run_name == "r" and run.info.status == "FINISHED"
    assert history(client, run, "train/loss") == [(1, 0.5), (2, 0.375)]
    assert history(client, run, "eval/success_rate") == [(0, 0.25), (2, 0.5)]
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
