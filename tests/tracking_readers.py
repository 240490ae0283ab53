"""Read experiment-tracker files back (tests of services.tracking): TensorBoard event
files, the MLflow file store, and an offline W&B run file."""

from __future__ import annotations

import json
from pathlib import Path


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
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: file store opt-in

    client = MlflowClient(tracking_uri=(tracking_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("st-ppo").experiment_id])
    return client, run


def history(client, run, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
