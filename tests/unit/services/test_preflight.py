"""Loud failures before anything starts: the engine the config names must be installed,
ranks that share a GPU cannot form an NCCL group."""

from __future__ import annotations

import importlib.util

import pytest

from actors.engines.build import EngineUnavailableError
from services.config import ConfigError, load_config
from services.loop.bootstrap import preflight


def test_a_missing_vllm_stops_the_run_before_anything_starts(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a),
    )
    with pytest.raises(EngineUnavailableError, match=r"or set rollout\.engine_fallback = true"):
        preflight(load_config(None, ['rollout.engine="vllm"']))
    preflight(load_config(None, ['rollout.engine="vllm"', "rollout.engine_fallback=true"]))
    preflight(load_config(None, ['rollout.engine="hf"']))


@pytest.mark.parametrize("shared", ["ray.learner_gpus=0.5", "ray.rollout_actor_gpus=0.25"])
def test_a_collective_sync_between_ranks_sharing_a_gpu_is_refused_at_load(shared):
    whole = ["ray.learner_gpus=1", "ray.rollout_actor_gpus=1", 'sync.transport="collective"']
    load_config(None, whole)
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one device"):
        load_config(None, [*whole, shared])
    load_config(None, [*whole, shared, 'sync.transport="object_store"'])
