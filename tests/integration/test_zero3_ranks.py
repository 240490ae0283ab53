"""ZeRO-3 on four CPU ranks: what the 7B recipe runs on eight GPUs, proven on gloo ranks.

Real Ray actors, a real gloo group of 4 :class:`services.learner_group.LearnerRank`
processes, real DeepSpeed, a tiny random **Qwen2-shaped** model (q/k/v biases, embedding
tied to the LM head) in fp32. One learner step (8 trajectories, two optimizer steps of 4)
on 4 ranks equals the same step on 1 rank (the tolerances of ``tests/rank_groups.py``)
at ZeRO-3 with and without gradient checkpointing, at ZeRO-3 with the optimizer states and
the parameters offloaded to the host (DeepSpeed's ``offload_optimizer`` /
``offload_param``, against 1 rank without offload), and at ZeRO-2 with the optimizer
offloaded. Then the 4-rank ZeRO-3 learner saves a checkpoint (one optimizer partition per
rank), resumes it onto the same 4 ranks with the same weights, and a 1-rank learner refuses
it naming both settings; the export gathered a bucket at a time equals the export of the
whole model at once; and during a bucketed export a rank other than 0 holds at most 1.5
buckets beyond its partition (resident memory sampled every millisecond; the same
measurement with one bucket larger than the model shows the whole model, so it can fail).

What only CUDA runs: NCCL (gloo here), the bf16 mixed-precision wrapper (fp32 here: CPU
DeepSpeed refuses fp16 and the comparison needs fp32), pinned host buffers for offload, and
the fused AdamW kernel on CUDA tensors (torch's fused AdamW on CPU is checked at ZeRO-3 in
``tests/unit/learner/test_fused_adamw.py``).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from learner_factories import make_batch
from rank_groups import Ranks, assert_same_weights, rank_groups

from learner.config import LearnerConfig, STPPOConfig

pytestmark = pytest.mark.integration


def setup_module() -> None:
    """The functions this module runs in the ranks' processes (``LearnerRank.execute``) go
    there by value: the ranks cannot import a test module."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


ALGORITHM = STPPOConfig(tau=1e-3, off_policy="behavior")

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc serves every allocation over 64 KiB by its own mapping and unmaps it when freed,
so a freed gather leaves the resident set at once (by default glibc raises that threshold
after the first large free, and later gathers would be served, and kept, on the heap)."""


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, tok) -> Path:
    import torch
    from tiny_models import save_model, tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(len(tok), tok))
    return save_model(model, tok, tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[int, Ranks]]:
    yield from rank_groups((1, 4), num_cpus=5, env=MALLOC_ENV)


def step(ranks: Ranks, model: Path, **settings):
    """Build ``ranks``' learners with ``settings`` and take one learner step; returns the
    exports of every rank."""
    config = LearnerConfig(
        dtype="fp32", num_ranks=len(ranks.actors), train_batch_size=8, mini_batch_size=4,
        micro_batch_size=1, actor_lr=1e-3, critic_lr=1e-3, **settings,
    )  # fmt: skip
    ranks.build(model, config, ALGORITHM)
    metrics = ranks.call("step", make_batch(11, num=8))
    assert all(m.optimizer_steps == 2 and m.skipped_steps == 0 for m in metrics)
    return ranks.call("export_weights")


def assert_equal_exports(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert_same_weights(name, actual[name], tensor)


CASES = {
    "zero3": (dict(zero_stage=3), dict(zero_stage=3)),
    "zero3_checkpointing": (
        dict(zero_stage=3, gradient_checkpointing=True),
        dict(zero_stage=3, gradient_checkpointing=True),
    ),
    "zero3_offload": (
        dict(zero_stage=3, offload_optimizer=True, offload_params=True),
        dict(zero_stage=3),
    ),
    "zero2_offload_checkpointing": (
        dict(zero_stage=2, offload_optimizer=True, gradient_checkpointing=True),
        dict(zero_stage=2, gradient_checkpointing=True),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_four_ranks_equal_one(groups, tiny_qwen2_dir, case):
    four_settings, one_settings = CASES[case]
    (one,) = step(groups[1], tiny_qwen2_dir, **one_settings)
    four = step(groups[4], tiny_qwen2_dir, **four_settings)
    assert all(export.state_dict == {} for export in four[1:])  # rank 0 exports
    assert "lm_head.weight" in four[0].state_dict  # the tied alias, as HF saves it
    assert_equal_exports(four[0].state_dict, one.state_dict)
    if four_settings.get("offload_optimizer"):
        offloaded = groups[4].actors[0].execute.remote(_optimizer_state_devices)
        import ray

        assert ray.get(offloaded) == {"cpu"}


def _optimizer_state_devices(rank) -> set[str]:
    """The devices of the policy optimizer's fp32 partitions (DeepSpeed's offload keeps them
    on the host; on this CPU-only machine the check is that the offload path built them)."""
    optimizer = rank.learner.policy_engine.optimizer
    groups = getattr(optimizer, "fp32_partitioned_groups_flat", None) or getattr(
        optimizer, "single_partition_of_fp32_groups", []
    )
    return {str(t.device) for t in groups}


def test_zero3_checkpoint_resumes_on_its_ranks_and_is_refused_elsewhere(
    groups, tiny_qwen2_dir, tmp_path
):
    import ray

    four = step(groups[4], tiny_qwen2_dir, zero_stage=3)
    saved = four[0].state_dict
    directory = str(tmp_path / "checkpoint")
    groups[4].call("save_checkpoint", directory)
    partitions = sorted(p.name for p in (tmp_path / "checkpoint" / "policy").rglob("*optim*"))
    assert len(partitions) == 4, partitions  # one optimizer partition per rank

    # the same 4 ranks, rebuilt from the base model, resume the saved weights and version
    config = LearnerConfig(
        dtype="fp32", num_ranks=4, zero_stage=3, train_batch_size=8, mini_batch_size=4,
        micro_batch_size=1, actor_lr=1e-3, critic_lr=1e-3,
    )  # fmt: skip
    groups[4].build(tiny_qwen2_dir, config, ALGORITHM)
    groups[4].call("load_checkpoint", directory)
    resumed = groups[4].call("export_weights")
    assert resumed[0].policy_version == four[0].policy_version == 1
    for name, tensor in saved.items():
        assert resumed[0].state_dict[name].equal(tensor), name

    # one rank refuses it, before loading anything, naming both settings
    groups[1].build(tiny_qwen2_dir, config.model_copy(update={"num_ranks": 1}), ALGORITHM)
    with pytest.raises(ray.exceptions.RayTaskError) as refused:
        groups[1].call("load_checkpoint", directory)
    assert "written with learner.num_ranks = 4, learner.zero_stage = 3" in str(refused.value)
    assert "this run has num_ranks = 1" in str(refused.value)


def test_the_bucketed_export_equals_the_whole_and_never_gathers_the_whole_model(
    groups, tmp_path_factory, tok
):
    """A deeper Qwen2 (24 layers of 256, a 4,096-token vocabulary: 94 MiB in fp32, no tensor
    over 1 MiB) on 4 ZeRO-3 ranks: rank 0's export gathered 16 MiB at a time equals the
    export gathered at once, and ranks 1-3, which keep nothing, hold at most 1.5 buckets
    more than before the export (measured: 16.1-16.2 MiB); gathered at once they hold the
    whole model (measured 96.5-96.9 MiB; asserted: at least 80% of it, so the measurement
    can fail)."""
    import ray
    import torch
    from tiny_models import save_model, tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(
        tiny_qwen2_config(
            4096, tok, hidden_size=256, intermediate_size=1024, num_hidden_layers=24,
            num_attention_heads=4, num_key_value_heads=2,
        )
    )  # fmt: skip
    model_bytes = sum({id(p): p.numel() * 4 for p in model.parameters()}.values())
    largest = max(p.numel() * 4 for p in model.parameters())
    folder = save_model(model, tok, tmp_path_factory.mktemp("deeper_qwen2"))
    del model
    config = LearnerConfig(
        dtype="fp32", num_ranks=4, zero_stage=3, train_batch_size=8, mini_batch_size=4,
        micro_batch_size=1,
    )  # fmt: skip
    ranks = groups[4]
    ranks.build(folder, config, ALGORITHM)
    bucket = 16 << 20
    bucketed = ray.get([a.execute.remote(_export_peak, bucket) for a in ranks.actors], timeout=300)
    whole = ray.get([a.execute.remote(_export_peak, 1 << 40) for a in ranks.actors], timeout=300)

    assert_equal_exports(bucketed[0][0], whole[0][0])
    assert len(bucketed[0][0]) == len(whole[0][0]) > 24 * 9
    assert largest < bucket
    allowed = 1.5 * bucket
    for rank in (1, 2, 3):
        extra_bucketed, extra_whole = bucketed[rank][1], whole[rank][1]
        print(
            f"rank {rank}: peak extra {extra_bucketed / 2**20:.1f} MiB in buckets of "
            f"{bucket / 2**20:.0f} MiB, {extra_whole / 2**20:.1f} MiB at once "
            f"(model {model_bytes / 2**20:.0f} MiB)"
        )
        assert extra_bucketed <= allowed, (rank, extra_bucketed, allowed)
        assert extra_whole >= 0.8 * model_bytes, (rank, extra_whole, model_bytes)


def _export_peak(rank, bucket_bytes: int) -> tuple[dict, int]:
    """This rank's export (its state dict: empty but on rank 0) and the peak of its
    resident memory during it over the resident memory before (bytes), sampled every
    millisecond from ``/proc/self/statm``."""
    import gc
    import os

    gc.collect()
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    baseline = resident()
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        export = rank.learner.export_weights(bucket_bytes)
    finally:
        done.set()
        sampler.join()
    return dict(export.state_dict), peak[0] - baseline
