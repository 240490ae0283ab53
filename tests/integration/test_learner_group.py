"""The learner group on a real Ray local cluster (2 ranks, gloo, ZeRO-3, tiny Llama): weight
export from rank 0 (gathered, HF names), checkpoint and resume with the same ``num_ranks``,
a clear start-up error with another ``num_ranks``, and a killed rank stopping the next call
with a :class:`LearnerRankError` naming the last checkpoint instead of hanging."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from learner_factories import make_batch

from services.config import load_config

pytestmark = pytest.mark.integration


def config(model: Path, num_ranks: int):
    return load_config(
        None,
        [
            f"model.path={model}",
            f"run.name=group{num_ranks}",
            "algorithm.variant=st_ppo",
            "algorithm.off_policy=behavior",
            "algorithm.tau=0.001",
            "learner.dtype=fp32",
            "learner.zero_stage=3",
            f"learner.num_ranks={num_ranks}",
            "learner.train_batch_size=4",
            "learner.mini_batch_size=4",
            "learner.micro_batch_size=2",
            "learner.actor_lr=0.001",
        ],
    )


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def test_group_exports_checkpoints_resumes_and_fails_clearly(
    ray_cluster, tiny_llama_dir, tmp_path, monkeypatch
):
    import ray
    from transformers import AutoModelForCausalLM

    from services.learner_group import LearnerGroup, LearnerRankError

    said: list[tuple[float, str]] = []
    group = LearnerGroup(
        config(tiny_llama_dir, 2), timeout_s=120.0,
        say=lambda line: said.append((time.monotonic(), line)),
    )  # fmt: skip
    ready_at = time.monotonic()
    try:
        # the members are announced while the group forms, not once it has (an actor runs one
        # call at a time: asked for its address after setup, a rank answers only when built)
        forming = [(t, line) for t, line in said if "forming the learner group" in line]
        assert forming and re.search(
            r"learner rank 0 \(\d+\.\d+\.\d+\.\d+\), learner rank 1", forming[0][1]
        )
        assert ready_at - forming[0][0] > 1.0, said
        assert [info["rank"] for info in group.rank_info] == [0, 1]
        assert {info["backend"] for info in group.rank_info} == {"gloo"}
        real_put, puts = ray.put, []
        monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or real_put(value))
        batch = make_batch(3)
        first = ray.get(group.step.remote(batch))
        monkeypatch.setattr(ray, "put", real_put)
        assert len(puts) == 1 and puts[0] is batch  # one copy in the object store, two ranks
        assert first.policy_version == 1 and first.skipped_steps == 0

        # ZeRO-3 export: rank 0's gathered weights load strictly into a fresh HF model
        weights_ref, version_ref = group.export_weights.options(num_returns=2).remote()
        weights, version = ray.get(weights_ref), ray.get(version_ref)
        assert version == 1
        fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        fresh.load_state_dict(weights, strict=True)
        assert all(t.numel() > 0 for t in weights.values())

        # the sharded (ZeRO-3) reference becomes the policy, and is checkpointed gathered
        ray.get(group.reset_reference_to_policy.remote())
        checkpoint = tmp_path / "step_1"
        ray.get(group.save_checkpoint.remote(str(checkpoint)))
        assert (checkpoint / "hf_policy" / "config.json").exists()
        reference = AutoModelForCausalLM.from_pretrained(checkpoint / "hf_reference")
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0, msg=name)
        second = ray.get(group.step.remote(make_batch(4)))

        # resume (same num_ranks): the same step from the checkpoint gives the same result
        ray.get(group.load_checkpoint.remote(str(checkpoint)))
        again = ray.get(group.step.remote(make_batch(4)))
        assert again.policy_version == second.policy_version == 2
        for name in ("pg_loss", "clip_bias_norm", "clip_bias_scale", "grad_norm", "kl_ref"):
            assert again[name] == pytest.approx(second[name], rel=1e-6, abs=1e-9), name

        # a killed rank: the next call fails fast, naming the last checkpoint
        os.kill(ray.get(group.ranks[1].pid.remote()), signal.SIGKILL)
        with pytest.raises(LearnerRankError, match=r"rank 1 .*Last checkpoint: .*step_1"):
            ray.get(group.step.remote(make_batch(5)), timeout=120)
    finally:
        group.shutdown()

    # another num_ranks: fails at load, before anything changes, naming both values
    single = LearnerGroup(config(tiny_llama_dir, 1), timeout_s=120.0)
    try:
        with pytest.raises(ValueError, match=r"num_ranks = 2.*num_ranks = 1"):
            ray.get(single.load_checkpoint.remote(str(checkpoint)))
    finally:
        single.shutdown()


def test_learner_threads_sets_the_ranks_torch_threads(ray_cluster, tiny_llama_dir):
    """``ray.learner_threads`` reaches the learner actor's torch, so the learner can use
    cores the rollout leaves idle; 0 gives ``ray.learner_cpus`` (1 here) whether Ray starts
    a worker for the actor or hands it one it started ahead (which kept torch's default, 2
    threads on this machine, before the count was always set)."""
    import ray

    from services.ray_actors import learner_actor_options

    class Probe:  # defined here so Ray ships it by value (workers cannot import tests/)
        def threads(self) -> int:
            import torch

            return torch.get_num_threads()

    found = {}
    for threads in (0, 2):
        cfg = load_config(
            None,
            [f"model.path={tiny_llama_dir}", f"run.name=threads{threads}",
             "ray.learner_cpus=1", f"ray.learner_threads={threads}"],
        )  # fmt: skip
        options = learner_actor_options(cfg)
        assert options["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == str(threads or 1)
        probe = ray.remote(Probe).options(**options).remote()
        found[threads] = ray.get(probe.threads.remote(), timeout=120)
        ray.kill(probe)
    assert found == {0: 1, 2: 2}


def test_rank0_holds_its_store_port_from_address_to_join():
    """Rank 0 binds the group's store when it gives out the address and keeps it for the
    join: a port only found free then could be taken before the join. No other socket can
    bind it meanwhile."""
    import socket

    from services.learner_group import LearnerRank

    rank = LearnerRank(0, 1)
    _, port = rank.rendezvous_address()
    assert rank.store is not None and rank.store.port == port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("0.0.0.0", port))
