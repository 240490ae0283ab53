"""The NCCL variant of ``tests/integration/test_learner_ranks.py``: two learner ranks, one GPU
each (Ray actors with ``num_gpus = 1``, an nccl group), equal one rank on one GPU after one
learner step of two optimizer steps, for ``ppo``, ``st_ppo`` and ``so_grpo`` at ZeRO-2 and
ZeRO-3 (tiny random Llama, fp32). Needs 2 CUDA devices; skipped otherwise."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from learner_factories import make_batch

from learner.config import LearnerConfig, PPOConfig, SOGRPOConfig, STPPOConfig

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices (one per learner rank)", allow_module_level=True)

RTOL, ATOL = 1e-4, 1e-6
"""CUDA kernels may reduce in another order than the CPU ones and than each other."""

VARIANTS = {
    "ppo": PPOConfig(off_policy="decoupled"),  # proximal log-probs all-gathered
    "st_ppo": STPPOConfig(tau=1e-3, off_policy="behavior"),
    "so_grpo": SOGRPOConfig(tau=1e-3, off_policy="behavior"),
}


class Ranks:
    def __init__(self, world_size: int) -> None:
        import ray

        from services.learner_group import LearnerRank
        from services.ray_actors import _actor_env

        cls = ray.remote(LearnerRank).options(num_cpus=1, num_gpus=1, runtime_env=_actor_env())
        self.actors = [cls.remote(rank, world_size) for rank in range(world_size)]
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        backends = ray.get([a.join.remote(addr, port, 300.0) for a in self.actors], timeout=300)
        assert set(backends) == {"nccl"}

    def run(self, model: Path, algorithm, zero_stage: int):
        import ray

        config = LearnerConfig(
            dtype="fp32",
            zero_stage=zero_stage,
            num_ranks=len(self.actors),
            train_batch_size=8,
            mini_batch_size=4,
            micro_batch_size=1,
            actor_lr=1e-3,
            critic_lr=1e-3,
        )
        args = (str(model), config, algorithm, 0, 1.0)
        ray.get([a.build.remote(*args) for a in self.actors], timeout=300)
        batch = make_batch(11, num=8)
        metrics = ray.get([a.call.remote("step", batch) for a in self.actors], timeout=300)
        exports = ray.get([a.call.remote("export_weights") for a in self.actors], timeout=300)
        return metrics, exports


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[int, Ranks]]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=False)
    out = {1: Ranks(1), 2: Ranks(2)}
    yield out
    for ranks in out.values():
        for actor in ranks.actors:
            ray.kill(actor)
    if started:
        ray.shutdown()


def turn_values(metrics) -> list[float | None]:
    """``StepMetrics.turn_advantages`` flattened: mean, min, max of every turn, in order
    (None for an excluded trajectory)."""
    flat: list[float | None] = []
    for turns in metrics.to_dict()["turn_advantages"]:
        flat += [None] if turns is None else [t[k] for t in turns for k in ("mean", "min", "max")]
    return flat


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_gpu_ranks_equal_one(groups, tiny_llama_dir, variant, zero_stage):
    (one,), (one_export,) = groups[1].run(tiny_llama_dir, VARIANTS[variant], zero_stage)
    two, two_exports = groups[2].run(tiny_llama_dir, VARIANTS[variant], zero_stage)
    assert one.optimizer_steps == two[0].optimizer_steps == 2
    for name, value in one.to_dict().items():
        if name in ("step_s", "tokens_per_s"):
            continue
        if name == "turn_advantages":  # per trajectory and turn: mean, min, max
            assert turn_values(two[0]) == pytest.approx(turn_values(one), rel=RTOL, abs=ATOL)
            continue
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(two[0][name]), name
        elif isinstance(value, float):
            assert two[0][name] == pytest.approx(value, rel=RTOL, abs=ATOL), name
        else:
            assert two[0][name] == value, name
    assert two_exports[1].state_dict == {}
    for name, tensor in one_export.state_dict.items():
        assert two_exports[0].state_dict[name].device.type == "cpu"
        torch.testing.assert_close(two_exports[0].state_dict[name], tensor, rtol=RTOL, atol=ATOL)
