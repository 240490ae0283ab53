"""Experiment trackers: TensorBoard, MLflow and Weights & Biases, fed by the driver.

Everything the driver appends to its JSON Lines logs goes to every configured backend too
(:meth:`Tracker.log_record`, called from ``Driver._append_jsonl``):

| driver log | logged as | step |
|---|---|---|
| ``steps.jsonl`` | ``train/<key>`` for every numeric field | ``step`` (learner step) |
| ``eval.jsonl`` | ``eval/<key>`` (``eval/success_rate``, ``eval/success_rate/nq`` ...; MLflow: ``eval/success_rate.nq``) | ``learner_step`` |
| ``sft.jsonl`` | ``sft/<key>`` | 0 |
| ``config_changes.jsonl`` | ``config/<dotted field>`` with its new value (numbers as metrics, text as TensorBoard text / MLflow tags) | ``learner_step`` |

Per-question records (:mod:`services.records`: ``eval_samples.jsonl`` and ``samples.jsonl``,
:meth:`Tracker.log_records`) go to TensorBoard as a markdown table (text
``eval_samples/<tag>`` / ``samples/train``, one row per record), to MLflow as a JSON Lines
artifact (``eval_samples/<tag>_step<N>.jsonl`` / ``samples/train_step<N>.jsonl``, the
records in full), and to W&B as a table (key ``eval_samples/<tag>`` / ``samples/train``:
the one-line columns of :func:`services.records.summary_row` plus ``turns`` as JSON).

The run's whole config (token redacted) is logged once at start: TensorBoard text
``config``, MLflow params (dotted names), W&B ``run.config``.

Backends and where they write (``tracking.dir``, default ``<run_dir>/tracking``):

- ``tensorboard``: event files in ``<dir>/tensorboard`` (``tensorboard --logdir <dir>``),
  written by ``torch.utils.tensorboard``.
- ``mlflow``: the MLflow client (``mlflow-skinny``); ``tracking.mlflow_tracking_uri`` or, by
  default, a local file store ``file:<dir>/mlruns`` (``mlflow ui --backend-store-uri ...``).
  MLflow 3 keeps the file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; this
  module sets it to ``true`` for a ``file:`` URI unless you set it.
- ``wandb``: ``wandb.init(mode=tracking.wandb_mode)``; ``offline`` (the default) needs no
  network or account and writes ``<dir>/wandb/offline-run-*`` (``wandb sync`` uploads it).

Every backend is imported only when configured; a backend whose package is missing fails
the config load (:class:`TrackingConfig`), naming the field and the package. A backend that
raises while logging is logged as a warning once and switched off: tracking never stops a run.

Example::

    tracker = Tracker(TrackingConfig(backends=["tensorboard"]), run_dir, "run1", cfg_dict)
    tracker.log_record("steps.jsonl", {"step": 1, "loss": 0.3})
    tracker.close()
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger("stppo.tracking")

Backend = Literal["tensorboard", "mlflow", "wandb"]

BACKEND_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard==2.21.0"),
    "mlflow": ("mlflow", "mlflow-skinny==3.17.2"),
    "wandb": ("wandb", "wandb==0.31.0"),
}
"""backend -> (module that must be importable, the pinned package that provides it)."""

_PREFIXES = {
    "steps.jsonl": ("train", "step"),
    "eval.jsonl": ("eval", "learner_step"),
    "sft.jsonl": ("sft", None),
}
_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")


class TrackingConfig(BaseModel):
    """``[tracking]``: where step metrics, evaluations and live config changes go besides
    ``steps.jsonl`` and Prometheus."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    backends: list[Backend] = Field(default_factory=list)
    """Experiment trackers to log to: ``tensorboard``, ``mlflow``, ``wandb`` (empty = none)."""

    dir: Path | None = None
    """Folder of the trackers' local files; None = ``<run_dir>/tracking``."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI (a server ``http://...`` or a store); None = the local file store
    ``file:<dir>/mlruns``."""

    mlflow_experiment: str = Field("st-ppo", min_length=1)
    """MLflow experiment name (created when missing)."""

    wandb_project: str = Field("st-ppo", min_length=1)
    """W&B project."""

    wandb_entity: str | None = None
    """W&B entity (team or user); None = the account's default."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` writes a local run that ``wandb sync`` uploads later (no network, no
    account); ``online`` streams to the W&B server (needs ``WANDB_API_KEY``)."""

    @field_validator("backends")
    @classmethod
    def _check_backends(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"a backend is listed twice: {value}")
        for name in value:
            module, package = BACKEND_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"backend {name!r} needs the {module!r} module, which is not installed "
                    f"(pip install {package})"
                )
        return value


def _numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a flat record (bools as 0/1), as floats."""
    out = {}
    for key, value in record.items():
        if hasattr(value, "item"):  # numpy / torch scalars
            value = value.item()
        if isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class _TensorBoard:
    def __init__(self, directory: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, default=str)}\n```", 0)

    def metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def texts(self, values: dict[str, str], step: int) -> None:
        for key, value in values.items():
            self.writer.add_text(key, value, step)
        self.writer.flush()

    def records(self, key: str, records: list[dict], step: int) -> None:
        self.writer.add_text(key, _markdown_rows(records), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(
        self, cfg: TrackingConfig, directory: Path, run_name: str, config: Mapping
    ) -> None:
        uri = cfg.mlflow_tracking_uri or (directory / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.mlflow_experiment)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(cfg.mlflow_experiment)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.uri = uri
        params = [
            Param(_mlflow_key(k), json.dumps(v, default=str)[:6000])
            for k, v in _flatten(config).items()
        ]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def metrics(self, values: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def texts(self, values: dict[str, str], step: int) -> None:
        for key, value in values.items():
            self.client.set_tag(self.run_id, _mlflow_key(key), value)

    def records(self, key: str, records: list[dict], step: int) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        self.client.log_text(self.run_id, text, f"{key}_step{step:06d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _WandB:
    def __init__(
        self, cfg: TrackingConfig, directory: Path, run_name: str, config: Mapping
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=run_name,
            dir=str(directory),
            mode=cfg.wandb_mode,
            config=_flatten(config),
            reinit="create_new",
        )
        self.run.define_metric("learner_step")
        self.run.define_metric("*", step_metric="learner_step")

    def metrics(self, values: dict[str, float], step: int) -> None:
        # W&B's own step must only grow; ours (learner step) is a logged field and the x axis
        self.run.log({**values, "learner_step": step})

    def texts(self, values: dict[str, str], step: int) -> None:
        self.run.config.update(values, allow_val_change=True)

    def records(self, key: str, records: list[dict], step: int) -> None:
        import wandb

        from services.records import summary_row

        rows = [
            {**summary_row(r), "turns": json.dumps(r.get("turns", []), ensure_ascii=False)}
            for r in records
        ]
        columns = list(rows[0])
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self.run.log({key: table, "learner_step": step})

    def close(self) -> None:
        self.run.finish()


def _markdown_rows(records: list[dict]) -> str:
    """Records as a markdown table of :func:`services.records.summary_row` columns (cells
    with ``|`` and line breaks escaped, each cut to 200 characters)."""
    from services.records import summary_row

    rows = [summary_row(r) for r in records]
    columns = list(rows[0])

    def cell(value: object) -> str:
        text = str(value).replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= 200 else text[:199] + "…"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _mlflow_key(key: str) -> str:
    """An MLflow-safe key: ``eval/success_rate/nq`` -> ``eval/success_rate.nq``. The file
    store keeps each key as a file under folders split at ``/``, so ``eval/success_rate``
    (a file) and ``eval/success_rate/nq`` (a folder of that name) could not both exist."""
    prefix, sep, rest = key.partition("/")
    return _MLFLOW_KEY.sub("_", prefix + sep + rest.replace("/", "."))


class Tracker:
    """The configured backends, started at construction (see module docstring).

    Args:
        cfg: the ``[tracking]`` section.
        run_dir: the run directory (``<dir>`` defaults under it).
        run_name: the run's name in every backend.
        config: the whole run config as a JSON-able tree (secrets already redacted).
        live_config: returns the current config tree; ``config_changes.jsonl`` records name
            only the changed fields, their new values are read from it.

    Raises:
        Any backend's own error when it cannot start (bad URI, unwritable folder).
    """

    def __init__(
        self,
        cfg: TrackingConfig,
        run_dir: Path,
        run_name: str,
        config: Mapping[str, Any],
        live_config: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dir = cfg.dir or run_dir / "tracking"
        self.live_config = live_config or (lambda: config)
        self.backends: dict[str, Any] = {}
        try:
            for name in cfg.backends:
                self.dir.mkdir(parents=True, exist_ok=True)
                if name == "tensorboard":
                    self.backends[name] = _TensorBoard(self.dir / "tensorboard", config)
                elif name == "mlflow":
                    self.backends[name] = _MLflow(cfg, self.dir, run_name, config)
                else:
                    self.backends[name] = _WandB(cfg, self.dir, run_name, config)
        except Exception:
            self.close()
            raise

    def _each(self, method: str, *args: Any) -> None:
        for name, backend in list(self.backends.items()):
            try:
                getattr(backend, method)(*args)
            except Exception as e:
                log.warning(
                    "tracking backend %s failed (%s: %s); switched off", name, type(e).__name__, e
                )
                self.backends.pop(name, None)

    def log_metrics(self, values: Mapping[str, Any], step: int) -> None:
        """Log the finite numeric entries of ``values`` at ``step`` on every backend."""
        numeric = _numeric(values)
        if numeric:
            self._each("metrics", numeric, int(step))

    def log_config_change(self, fields: list[str], step: int) -> None:
        """Log the new values of live-changed ``fields`` (dotted) at ``step``: numbers as
        ``config/<field>`` metrics, everything else as text."""
        flat = _flatten(self.live_config())
        values = {f"config/{f}": flat.get(f) for f in fields}
        texts = {k: str(v) for k, v in values.items() if k not in _numeric(values)}
        self.log_metrics(values, step)
        if texts:
            self._each("texts", texts, int(step))

    def log_record(self, log_name: str, record: Mapping[str, Any]) -> None:
        """Route one record the driver appended to ``log_name`` (see the table above)."""
        if not self.backends:
            return
        if log_name == "config_changes.jsonl":
            self.log_config_change(
                list(record.get("fields", [])), int(record.get("learner_step", 0))
            )
            return
        if log_name not in _PREFIXES:
            return
        prefix, step_key = _PREFIXES[log_name]
        step = int(record.get(step_key, 0)) if step_key else 0
        values = {f"{prefix}/{k}": v for k, v in record.items() if k != step_key}
        self.log_metrics(values, step)

    def log_records(self, key: str, records: list[dict], step: int) -> None:
        """Log per-question records (one evaluation, or one step's samples) under ``key``
        (``eval_samples/<tag>``, ``samples/train``) at ``step`` on every backend (see the
        module docstring). Nothing for no records."""
        if self.backends and records:
            self._each("records", key, list(records), int(step))

    def close(self) -> None:
        """Flush and close every backend (errors are logged, not raised)."""
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as e:
                log.warning("closing tracking backend %s failed: %s", name, e)
        self.backends.clear()
