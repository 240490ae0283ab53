"""Where the 7B recipe's processes land on one node of 8 GPUs, proven on a CPU Ray cluster
that declares 8 GPUs.

A real local Ray cluster (``num_gpus=8``: Ray hands out GPU ids and sets
``CUDA_VISIBLE_DEVICES`` whether or not the devices exist), the product's own placement
(:func:`services.learner_group.reserve_learner_bundles` and ``learner_rank_options`` for
the learner ranks, :func:`services.ray_actors.rollout_actor_options` for the engines) and
``deploy/configs/gpu_8gpu_7b.toml``'s sizes. The placed actors are probes that report the
GPUs Ray gave them, since a learner or an engine would need the devices themselves.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.config import ConfigError, load_config

pytestmark = pytest.mark.integration

RECIPE = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "gpu_8gpu_7b.toml"


class GpuProbe:
    """Stands where a learner rank or a rollout engine would: reports its GPUs."""

    def __init__(self, *args) -> None:
        pass

    def gpus(self) -> tuple[list[int], str]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="module")
def eight_gpus() -> Iterator[None]:
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probe, by value
    if ray.is_initialized():
        ray.shutdown()
    # CPUs to spare (the recipe asks 8 per process), so that the GPUs are what binds
    ray.init(num_cpus=96, num_gpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def recipe(*overrides: str):
    return load_config(str(RECIPE), ["model.path=Qwen/Qwen2.5-7B-Instruct", *overrides])


def test_learner_ranks_and_engines_get_disjoint_gpus_and_the_capacity_check_refuses_more(
    eight_gpus,
):
    import ray

    from services.control import ControlState
    from services.learner_group import learner_rank_options, reserve_learner_bundles
    from services.loop.parts import check_rollout_capacity
    from services.ray_actors import rollout_actor_options

    cfg = recipe()
    assert (cfg.learner.num_ranks, cfg.rollout.num_actors) == (6, 2)
    probe = ray.remote(GpuProbe)
    group = reserve_learner_bundles(cfg, timeout_s=60.0)
    learners = [
        probe.options(**learner_rank_options(cfg, group, rank)).remote(rank)
        for rank in range(cfg.learner.num_ranks)
    ]
    engines = [
        probe.options(**rollout_actor_options(cfg, i)).remote(i)
        for i in range(cfg.rollout.num_actors)
    ]
    learner_gpus = ray.get([p.gpus.remote() for p in learners], timeout=120)
    engine_gpus = ray.get([p.gpus.remote() for p in engines], timeout=120)
    for ids, visible in learner_gpus + engine_gpus:
        assert len(ids) == 1 and visible == str(ids[0])  # one whole GPU each, and only it
    taken_by_learner = {ids[0] for ids, _ in learner_gpus}
    taken_by_engines = {ids[0] for ids, _ in engine_gpus}
    assert len(taken_by_learner) == 6 and len(taken_by_engines) == 2
    assert taken_by_learner.isdisjoint(taken_by_engines)
    assert taken_by_learner | taken_by_engines == set(range(8))

    # a third engine has no GPU left: refused at start, naming the binding resource
    state = ControlState(config=cfg)
    with pytest.raises(ConfigError) as refused:
        check_rollout_capacity(recipe("rollout.num_actors=3"), state)
    assert "GPU: 8 in the cluster, 6 for the learner, 1 per actor" in str(refused.value)
    check_rollout_capacity(cfg, state)  # the recipe's own two fit

    # a learner group that needs more GPUs than are free is refused with its bundle named
    for actor in learners + engines:
        ray.kill(actor)
    ray.util.remove_placement_group(group)
    with pytest.raises(TimeoutError, match=r"did not grant 9 learner bundle\(s\) of .*'GPU': 1"):
        reserve_learner_bundles(recipe("learner.num_ranks=9"), timeout_s=3.0)


def test_a_fractional_gpu_with_the_collective_sync_is_refused_at_load():
    """NCCL refuses two ranks on one device: the config says so before anything starts."""
    with pytest.raises(ConfigError) as refused:
        recipe("ray.rollout_actor_gpus=0.5")
    message = str(refused.value)
    assert "sync.transport = 'collective' with ray.rollout_actor_gpus = 0.5" in message
    assert "cannot be in one NCCL group" in message
    recipe("ray.rollout_actor_gpus=0.5", 'sync.transport="object_store"')  # allowed there
