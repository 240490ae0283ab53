"""Ray actor wrappers of the plain classes: resources, placement and restarts only.

The classes themselves (``actors.rollout.RolloutWorker``, ``learner.trainer.Learner``)
know nothing about Ray; they are wrapped here at the
call site, as in vLLM's RLHF example and Ray's parameter-server example.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from services.config import RunConfig
from services.env import configure_local_caches

_ACTOR_ENV_VARS = (
    "HF_HOME", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT",
    "TRITON_CACHE_DIR", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
    "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY",
)  # fmt: skip


def _actor_env(threads: int = 0) -> dict[str, Any]:
    """Runtime env passing the driver's cache folders and offline mode to actors explicitly,
    so a worker started on another node of a KubeRay cluster behaves the same. ``threads``
    > 0 sets the actor's OpenMP/torch thread count (Ray's default is its ``num_cpus``)."""
    configure_local_caches()
    env = {k: os.environ[k] for k in _ACTOR_ENV_VARS if k in os.environ}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return {"env_vars": env}


def rollout_actor_options(cfg: RunConfig, index: int) -> dict[str, Any]:
    """``ray.remote(...).options`` of rollout actor ``index``: CPUs, GPUs and the custom
    resources of ``ray.rollout_actor_resources`` (which only the rollout worker group
    advertises on KubeRay, so the actor cannot land on the head or the learner's node)."""
    return {
        "name": f"rollout-{cfg.run.name}-{index}",
        "num_cpus": cfg.ray.rollout_actor_cpus,
        "num_gpus": cfg.ray.rollout_actor_gpus,
        "resources": dict(cfg.ray.rollout_actor_resources),
        "max_restarts": cfg.ray.max_actor_restarts,
        "max_task_retries": 0,  # a failed rollout is dropped and counted, never silently re-run
        "runtime_env": _actor_env(),
    }


def learner_actor_options(cfg: RunConfig, rank: int = 0) -> dict[str, Any]:
    """``ray.remote(...).options`` of learner rank ``rank``: CPUs, GPUs and the custom
    resources of ``ray.learner_resources`` (advertised by the learner worker group only).
    ``services.learner_group`` adds the placement-group bundle of the rank."""
    return {
        "name": f"learner-{cfg.run.name}" + (f"-{rank}" if rank else ""),
        "num_cpus": cfg.ray.learner_cpus,
        "num_gpus": cfg.ray.learner_gpus,
        "resources": dict(cfg.ray.learner_resources),
        "max_restarts": 0,
        "runtime_env": _actor_env(threads=learner_threads(cfg)),
    }


def learner_threads(cfg: RunConfig) -> int:
    """torch/OpenMP threads of a learner rank: ``ray.learner_threads``, or with 0 its
    ``ray.learner_cpus`` rounded (at least 1). Always set explicitly: Ray derives
    ``OMP_NUM_THREADS`` from ``num_cpus`` only for a worker it starts for the actor, and a
    worker it had started ahead kept torch's own default, all the machine's cores (seen as a
    flaky test: 2 threads for a 1-CPU learner)."""
    return cfg.ray.learner_threads or max(1, round(cfg.ray.learner_cpus))


def rollout_actor_capacity(cfg: RunConfig, cluster_total: dict[str, float]) -> tuple[int, str]:
    """How many rollout actors fit in a cluster next to the learner ranks.

    Args:
        cfg: Sizes of the actors (``ray.*_cpus``, ``*_gpus``, ``*_resources``).
        cluster_total: ``ray.cluster_resources()`` (totals, not what is free now).

    Returns:
        ``(capacity, binding)``: the count, and which resource bounds it (for error
        messages), e.g. ``(1, "CPU: 2 in the cluster, 1 for the learner, 1 per actor")``.
        The learner's reservation is ``learner.num_ranks`` times its per-rank needs.
    """
    ranks = cfg.learner.num_ranks
    need = {"CPU": cfg.ray.rollout_actor_cpus, "GPU": cfg.ray.rollout_actor_gpus}
    need.update(cfg.ray.rollout_actor_resources)
    held = {"CPU": cfg.ray.learner_cpus * ranks, "GPU": cfg.ray.learner_gpus * ranks}
    held.update({k: v * ranks for k, v in cfg.ray.learner_resources.items()})
    best: tuple[int, str] | None = None
    for name, per_actor in need.items():
        if per_actor <= 0:
            continue
        total, learner = cluster_total.get(name, 0.0), held.get(name, 0.0)
        fits = max(0, int((total - learner) / per_actor + 1e-9))
        why = f"{name}: {total:g} in the cluster, {learner:g} for the learner, {per_actor:g} per actor"
        if best is None or fits < best[0]:
            best = (fits, why)
    assert best is not None  # rollout_actor_cpus > 0 by validation
    return best


def create_rollout_actor(cfg: RunConfig, retrieval_url: str, index: int) -> Any:
    """One rollout actor (engine + multi-turn loop), restarted by Ray up to
    ``ray.max_actor_restarts`` times after a crash (the driver re-syncs its weights).

    Two thread groups: the default group (``rollout.calls_per_actor`` threads: ``rollout``
    calls, which share the engine turn by turn, :class:`actors.rollout.ContinuousBatcher`,
    and everything else) and the weight group
    (:data:`services.weight_sync.ENGINE_WEIGHTS_GROUP`, one thread: loads and the collective
    group's calls), so a weight load reaches the engine while a rollout runs;
    :class:`actors.engines.interrupt.WeightGate` decides when it lands."""
    from actors.rollout import RolloutWorker
    from services.weight_sync import ENGINE_WEIGHTS_GROUP

    # concurrency groups are a class option (``.options()`` refuses them)
    cls = ray.remote(
        concurrency_groups={ENGINE_WEIGHTS_GROUP: 1}, max_concurrency=cfg.rollout.calls_per_actor
    )(RolloutWorker)
    cls = cls.options(**rollout_actor_options(cfg, index))
    return cls.remote(
        model_path=str(cfg.model.path),
        rollout_cfg=cfg.rollout,
        retrieval_url=retrieval_url,
        seed=cfg.run.seed * 1000 + index,
    )


def on_driver_node() -> Any:
    """Scheduling strategy that keeps a zero-CPU actor or task on the driver's node.

    Zero-CPU work fits on any node, so Ray may put it on a rollout pod; losing that pod would
    then take the driver's own state with it (found on the local cluster: the trajectory
    buffer, then an actor, placed on a rollout pod died with it and stopped the run). On KubeRay the driver's node is the
    head (``num-cpus: "0"``), which the job cannot outlive anyway."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
