"""A tiny synthetic-task experiment for the integration tests that run a grid through the
real pipeline (tests/integration/test_stability.py, test_arena_run.py): the task, the
overrides that point a run at it with a small rollout, and the grid file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prepare.synthetic_task import SyntheticReport, SyntheticSpec, build_synthetic
from services.env import PROJECT_ROOT

TINY_SPEC = SyntheticSpec(
    num_records=60, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64
)
"""60 records and a one-layer Llama of width 32: a run step takes about a second."""


def build_tiny_task(data: Path) -> SyntheticReport:
    """Build the tiny task (corpus, QA sets, BM25 index, model) under ``data``."""
    return build_synthetic(data, TINY_SPEC)


def tiny_run_overrides(data: Path) -> dict[str, Any]:
    """Overrides pointing a run at the task built under ``data``, with 2 evaluation
    questions and rollouts of 2 prompts, at most 2 turns of 12 new tokens."""
    return {
        "model.path": str(data / "model" / "tiny-llama"),
        "data.qa_dir": str(data / "qa"),
        "retrieval.server.corpus_path": str(data / "corpus" / "passages.jsonl"),
        "retrieval.server.index_dir": str(data / "index"),
        "run.eval_questions": 2,
        "rollout.prompts_per_batch": 2,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens_per_turn": 12,
        "ray.rollout_actor_cpus": 0.5,
    }


def write_experiment(
    experiments: Path, name: str, spec: dict[str, Any], tables: dict[str, dict[str, Any]]
) -> Path:
    """Write ``experiments/<name>.toml`` on ``deploy/configs/synthetic.toml``: the top-level
    ``spec`` keys, then each ``[table]`` (``grid``, ``overrides``, ``methods.<m>``) with
    quoted dotted keys. Values are written as JSON, which is TOML for strings, numbers,
    booleans and lists."""
    base = PROJECT_ROOT / "deploy" / "configs" / "synthetic.toml"
    lines = [f"base_config = {json.dumps(str(base))}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in spec.items()]
    for table, values in tables.items():
        lines += [f"[{table}]", *(f'"{k}" = {json.dumps(v)}' for k, v in values.items())]
    experiments.mkdir(parents=True, exist_ok=True)
    path = experiments / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
