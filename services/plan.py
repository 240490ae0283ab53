"""``stppo plan``: a run config's GPU memory, per learner rank and per rollout engine.

The learner's side is :mod:`learner.memory_plan` (model states from DeepSpeed's
estimators, activations calibrated on the committed H200 runs, the transients). The
engine's side, per rollout actor on its GPU share: vLLM's budget
(``rollout.vllm_gpu_memory_utilization`` of the GPU, or the weights and
``rollout.vllm_kv_cache_gib``) plus, with ``sync.transport = "collective"``, the tensor
being received, outside vLLM's budget (the engine loads each as it arrives; the largest is
the embedding). The plan also states the bytes every sync moves and a checkpoint's
size (policy, critic, their optimizer states and the reference).

A plan is for GPU nodes: on a CPU run (``ray.learner_gpus = 0``) it still prints the
learner's bytes, which then come out of the machine's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from learner.memory_plan import (
    GIB,
    ModelShape,
    RankMemory,
    activation_bytes,
    describe,
    learner_rank_memory,
    settings_that_fit,
)
from learner.micro_batches import settled_token_budget
from services.config import RunConfig

CHECKPOINT_WRITE_BYTES_PER_S = 500e6
"""The write bandwidth a checkpoint's time is stated at: 500 MB/s, a conservative figure
for a shared ReadWriteMany volume (NFS, CephFS, EFS throughput tiers reach it; node-local
NVMe is several times faster)."""

GPU_BF16_FLOPS = 989e12
"""Dense bf16 peak of one H100/H200 (FLOP/s), for the learner step's time estimate."""

LEARNER_MFU = 0.25
"""The share of that peak a learner step is planned at: RL micro-batches are short and the
step also runs the critic and the reference, so well under pre-training's 40-50%."""

STOP_MARGIN_S = 60.0
"""Seconds a stopping driver needs beyond the step and the checkpoint (its own shutdown)."""

DATA_BYTES = 20 * GIB
"""The shared volume's room for what ``stppo prepare`` writes (corpus, BM25 index, QA sets:
about 6 GB) and the run folders' logs, with margin."""

PROMPT_TOKENS = 512
"""Tokens planned for a prompt (system instruction and question; Search-R1's prompt is
about 250) when micro-batches are cut by count: a trajectory is at most this plus
``rollout.max_response_tokens``."""


@dataclass(frozen=True)
class RunPlan:
    """What :func:`plan_run` found.

    Attributes:
        shape: the model counted.
        gpu_bytes: one GPU's memory.
        learner: one learner rank's plan; learner_budget: the bytes it may use
            (``gpu_bytes * learner.gpu_memory_fraction``).
        engine_bytes: one rollout engine's need on its GPU; engine_budget: its share
            (``gpu_bytes * ray.rollout_actor_gpus``), 0 on a CPU run.
        sync_bytes: bytes every weight sync sends to each engine (bf16 policy).
        checkpoint_bytes: one checkpoint on disk.
        fitting: ``(zero_stage, ranks)`` settings of up to 8 ranks that fit.
    """

    shape: ModelShape
    gpu_bytes: int
    learner: RankMemory
    learner_budget: int
    engine_bytes: int
    engine_budget: int
    sync_bytes: int
    checkpoint_bytes: int
    fitting: list[tuple[int, int]]

    @property
    def learner_fits(self) -> bool:
        return self.learner.peak <= self.learner_budget

    @property
    def engine_fits(self) -> bool:
        return self.engine_budget == 0 or self.engine_bytes <= self.engine_budget


@dataclass(frozen=True)
class ClusterSizes:
    """What a KubeRay deployment of a run needs beyond GPUs (``stppo plan`` prints it;
    ``deploy/k8s/overlays`` are checked against it).

    Attributes:
        volume_bytes: the shared volume: ``checkpoint.keep_last + 1`` checkpoints (the
            newest is written before the oldest goes), the model's weights (downloaded
            once) and :data:`DATA_BYTES`.
        checkpoint_write_s: one checkpoint at :data:`CHECKPOINT_WRITE_BYTES_PER_S`.
        step_s: a learner step's estimated time (:func:`learner_step_s`).
        grace_s: the head's ``terminationGracePeriodSeconds``: twice the step estimate
            (the step in flight), a checkpoint and :data:`STOP_MARGIN_S`.
        learner_host_bytes: host memory of the learner pod: each rank loads the policy,
            critic and reference on the host before DeepSpeed moves them to its GPU, plus
            what offload keeps there.
    """

    volume_bytes: int
    checkpoint_write_s: float
    step_s: float
    grace_s: float
    learner_host_bytes: int


def learner_step_s(cfg: RunConfig, shape: ModelShape) -> float:
    """A learner step's time on GPUs, estimated from its FLOPs: per token of the batch (at
    most ``PROMPT_TOKENS + rollout.max_response_tokens``, ``learner.ppo_epochs`` times)
    6 P to train the policy and 6 P the critic, 2 P each for the reference's and the
    proximal log-probs' forwards (16 P; 4/3 of the forwards again with gradient
    checkpointing), over ``learner.num_ranks`` GPUs at :data:`LEARNER_MFU` of
    :data:`GPU_BF16_FLOPS`."""
    learner = cfg.learner
    tokens = (
        learner.train_batch_size
        * learner.ppo_epochs
        * (PROMPT_TOKENS + cfg.rollout.max_response_tokens)
    )
    flops = 16 * shape.policy * tokens * (4 / 3 if learner.gradient_checkpointing else 1.0)
    return flops / (learner.num_ranks * GPU_BF16_FLOPS * LEARNER_MFU)


def cluster_sizes(plan: RunPlan, cfg: RunConfig) -> ClusterSizes:
    """:class:`ClusterSizes` of ``cfg`` from its plan."""
    weight = 2 if cfg.learner.dtype != "fp32" else 4
    write_s = plan.checkpoint_bytes / CHECKPOINT_WRITE_BYTES_PER_S
    step_s = learner_step_s(cfg, plan.shape)
    loaded = weight * (2 * plan.shape.policy + plan.shape.critic)
    return ClusterSizes(
        volume_bytes=(cfg.checkpoint.keep_last + 1) * plan.checkpoint_bytes
        + weight * plan.shape.policy
        + DATA_BYTES,
        checkpoint_write_s=write_s,
        step_s=step_s,
        grace_s=2 * step_s + write_s + STOP_MARGIN_S,
        learner_host_bytes=cfg.learner.num_ranks * (loaded + plan.learner.host),
    )


def gpus_needed(cfg: RunConfig) -> float:
    """GPUs the run reserves: learner ranks and rollout actors."""
    ray = cfg.ray
    return (
        cfg.learner.num_ranks * ray.learner_gpus + cfg.rollout.num_actors * ray.rollout_actor_gpus
    )


def micro_batch_tokens(cfg: RunConfig, shape: ModelShape, states: int, budget: int) -> int:
    """The largest micro-batch a run's learner will run, in tokens: the token budget
    (``learner.micro_batch_tokens > 0``; a longer trajectory goes alone), what the memory
    left by the states holds (``-1``, as the learner sizes it:
    :func:`learner.micro_batches.settled_token_budget`), or
    ``micro_batch_size`` of the longest trajectories (0)."""
    longest = PROMPT_TOKENS + cfg.rollout.max_response_tokens
    tokens = cfg.learner.micro_batch_tokens
    if tokens > 0:
        return max(tokens, longest)
    if tokens == -1:
        return settled_token_budget(budget - states, activation_bytes(shape, 1))
    return cfg.learner.micro_batch_size * longest


def plan_run(cfg: RunConfig, shape: ModelShape, gpu_bytes: int) -> RunPlan:
    """The memory plan of ``cfg`` on GPUs of ``gpu_bytes`` each (module docstring)."""
    learner = cfg.learner
    bf16 = learner.dtype != "fp32"
    budget = int(gpu_bytes * learner.gpu_memory_fraction)
    offload = dict(
        offload_optimizer=learner.offload_optimizer, offload_params=learner.offload_params
    )
    base = dict(zero_stage=learner.zero_stage, ranks=learner.num_ranks, bf16=bf16, **offload)
    bucket = cfg.sync.bucket_mb << 20
    states = learner_rank_memory(shape, **base, micro_batch_tokens=0, bucket_bytes=bucket).states
    tokens = micro_batch_tokens(cfg, shape, states, budget)
    plan = learner_rank_memory(shape, **base, micro_batch_tokens=tokens, bucket_bytes=bucket)
    weights = (2 if bf16 else 4) * shape.policy
    rollout = cfg.rollout
    if rollout.engine == "vllm" and rollout.vllm_kv_cache_gib is None:
        engine = int(rollout.vllm_gpu_memory_utilization * gpu_bytes)
    else:
        engine = weights + int((rollout.vllm_kv_cache_gib or 0.0) * GIB)
    if cfg.sync.transport == "collective":  # one received tensor at a time, outside vLLM's
        engine += (2 if bf16 else 4) * shape.largest_layer
    optimizer_states = 12 * (shape.policy + shape.critic)  # fp32 master and moments
    return RunPlan(
        shape=shape,
        gpu_bytes=gpu_bytes,
        learner=plan,
        learner_budget=budget,
        engine_bytes=engine,
        engine_budget=int(gpu_bytes * cfg.ray.rollout_actor_gpus),
        sync_bytes=2 * shape.policy,
        checkpoint_bytes=weights + (2 if bf16 else 4) * shape.critic + optimizer_states
        + weights,
        fitting=settings_that_fit(
            shape, budget, bf16=bf16, micro_batch_tokens=tokens, max_ranks=8, **offload
        ),
    )  # fmt: skip


def render(plan: RunPlan, cfg: RunConfig) -> str:
    """The plan as the lines ``stppo plan`` prints."""
    s, lr = plan.shape, cfg.learner
    verdict = "fits" if plan.learner_fits else "DOES NOT FIT"
    lines = [
        f"model {s.name}: policy {s.policy / 1e9:.2f}B parameters, critic "
        f"{s.critic / 1e9:.2f}B, {s.num_layers} layers of {s.hidden_size}",
        f"GPU: {plan.gpu_bytes / GIB:.1f} GiB; the learner may use "
        f"{plan.learner_budget / GIB:.1f} (learner.gpu_memory_fraction {lr.gpu_memory_fraction})",
        f"learner, each of {lr.num_ranks} rank(s) at zero_stage {lr.zero_stage}, "
        f"{'bf16' if lr.dtype != 'fp32' else 'fp32'}: {describe(plan.learner)}: {verdict}",
        f"  optimizer step transient {plan.learner.optimizer_transient / GIB:.1f} GiB, "
        f"weight export transient {plan.learner.export_transient / GIB:.1f} GiB "
        f"(sync.bucket_mb {cfg.sync.bucket_mb})",
    ]
    if plan.learner.host:
        lines.append(
            f"  offloaded to host memory: {plan.learner.host / GIB:.1f} GiB per rank, "
            f"{lr.num_ranks * plan.learner.host / GIB:.1f} GiB per node "
            f"(learner.offload_optimizer {lr.offload_optimizer}, "
            f"learner.offload_params {lr.offload_params})"
        )
    if plan.engine_budget:
        fit = "fits" if plan.engine_fits else "DOES NOT FIT"
        lines.append(
            f"rollout engine ({cfg.rollout.engine}, {cfg.ray.rollout_actor_gpus:g} GPU each, "
            f"sync {cfg.sync.transport}): {plan.engine_bytes / GIB:.1f} GiB of "
            f"{plan.engine_budget / GIB:.1f}: {fit}"
        )
    lines.append(
        f"GPUs in all: {gpus_needed(cfg):g} ({lr.num_ranks} learner rank(s) x "
        f"{cfg.ray.learner_gpus:g}, {cfg.rollout.num_actors} engine(s) x "
        f"{cfg.ray.rollout_actor_gpus:g})"
    )
    sizes = cluster_sizes(plan, cfg)
    lines.append(
        f"each weight sync sends {plan.sync_bytes / GIB:.1f} GiB to every engine; a "
        f"checkpoint is {plan.checkpoint_bytes / GIB:.1f} GiB on disk, "
        f"{sizes.checkpoint_write_s:.0f} s to write at "
        f"{CHECKPOINT_WRITE_BYTES_PER_S / 1e6:.0f} MB/s"
    )
    lines.append(
        f"on KubeRay: a shared volume of at least {sizes.volume_bytes / GIB:.0f} GiB "
        f"({cfg.checkpoint.keep_last + 1} checkpoints, the model, data), the head's "
        f"terminationGracePeriodSeconds at least {sizes.grace_s:.0f} (a step in flight, "
        f"estimated {sizes.step_s:.0f} s at {LEARNER_MFU:.0%} of a GPU's bf16 peak, twice; "
        "then a checkpoint), the learner pod's memory at least "
        f"{sizes.learner_host_bytes / GIB:.0f} GiB (each rank loads its three models on the "
        "host first)"
    )
    if plan.fitting:
        options = ", ".join(f"zero_stage {z} on {n}" for z, n in plan.fitting[:4])
        lines.append(f"learner settings that fit (up to 8 ranks): {options}")
    else:
        lines.append("no learner setting of up to 8 ranks fits: fewer tokens per micro-batch")
    return "\n".join(lines)
