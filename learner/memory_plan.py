"""The learner's memory plan: what one rank holds, before anything is allocated.

A learner rank holds three models (:mod:`learner.trainer`): the policy and the critic,
trained with AdamW under ZeRO, and the frozen reference. Per rank, in bytes:

- **model states**, from DeepSpeed's own estimators for mixed precision without offload
  (``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``
  of the pinned DeepSpeed), per trained model of P parameters on N ranks: ZeRO-0/1/2
  ``2 P + 18 P / N`` (bf16 weights replicated; bf16 and fp32 gradients, fp32 master weights
  and the two Adam moments partitioned; stage 0 and 1 counted as 2, a lower bound), ZeRO-3
  ``4 L + 18 P / N`` (L: the largest layer's parameters, gathered whole). The reference:
  ``2 P`` (ZeRO 0-2, replicated), ``2 P / N`` under ZeRO-3. In fp32 (``dtype = fp32``) the
  weights are 4 bytes and there is no separate master copy: ``4 P + 12 P / N`` per model.
- **activations** of the largest micro-batch: tokens times bytes per token. Calibrated on
  the committed H200 learner runs (``docs/results/learner_step_h200_budget_*.json``): what a
  micro-batch held per token was 61 bytes per decoder layer and hidden unit within 5% at
  the 1.7B shape (no gradient checkpointing, 3.14 MB/token) and the 3B shape (gradient
  checkpointing, 5.04 MB/token): :data:`ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN`.
- **transients** outside a micro-batch (never at the same time as one): the optimizer
  step's fp32 copy of a gradient partition (``4 P / N``), and under ZeRO-3 the export's
  gather of one bucket of the policy (``sync.bucket_mb``, at most ``2 P``; weight sync and
  checkpoint export, :mod:`learner.weights`).
- **offload** (``learner.offload_optimizer`` / ``offload_params``): the same estimators with
  ``cpu_offload`` say what stays on the device; the optimizer states (12 bytes per
  parameter, partitioned) and, with ``offload_params``, the partitioned weights move to the
  host (:attr:`RankMemory.host`), and the optimizer step's transient with them.

The peak is the states plus the largest of the three. :func:`check_learner_fits` refuses a
plan over the device's share with a message that names the rank, the bytes and settings
that would fit (torchtitan's "fail before you allocate"). Calibration:
``tests/unit/learner/test_memory_plan.py`` keeps the model states within 15% of the two
H200 measurements (the plan is 5% above both).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2**30

ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN = 61
"""Bytes a training micro-batch held per token, per decoder layer and hidden unit (module
docstring: 3.14e6 / (24 * 2048) = 63.9 at 1.7B, 5.04e6 / (28 * 3072) = 58.6 at 3B)."""

MIN_MICRO_BATCH_TOKENS = 256
"""The smallest micro-batch a plan must leave room for (one short trajectory)."""

SHAPES_DIR = Path(__file__).resolve().parent / "shapes"
"""Named model shapes (HF ``config.json`` files, no weights): ``<name>.config.json``."""


class MemoryPlanError(ValueError):
    """A configuration cannot fit; the message names the rank, the bytes and what fits."""


@dataclass(frozen=True)
class ModelShape:
    """The parameter counts a plan needs, from an HF config.

    Attributes:
        name: where it came from (a shape name or a folder).
        policy: parameters of the causal LM (tied embeddings counted once).
        critic: parameters of the critic (the backbone without the LM head, and the
            value head: :class:`learner.modeling.ValueModel`).
        largest_layer: parameters of the largest module's own tensors (ZeRO-3 gathers it
            whole; DeepSpeed's ``largest_layer_params``).
        num_layers, hidden_size: the decoder's depth and width (activations).
    """

    name: str
    policy: int
    critic: int
    largest_layer: int
    num_layers: int
    hidden_size: int

    @classmethod
    def from_config(cls, config: Any, name: str = "") -> ModelShape:
        """Count an HF config's parameters exactly, on the meta device (no memory).

        Raises:
            ValueError: the config is not a causal LM transformers can build.
        """
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)

        def count(module: Any) -> int:  # tied tensors once
            return sum({id(p): p.numel() for p in module.parameters()}.values())

        hidden = int(config.hidden_size)
        largest = max(
            sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()
        )
        return cls(
            name=name or str(getattr(config, "_name_or_path", "")) or config.model_type,
            policy=count(model),
            critic=count(model.base_model) + hidden + 1,
            largest_layer=largest,
            num_layers=int(config.num_hidden_layers),
            hidden_size=hidden,
        )

    @classmethod
    def load(cls, source: str | Path) -> ModelShape:
        """A shape by name (:data:`SHAPES_DIR`, e.g. ``qwen2.5-7b``), an HF folder or a
        ``config.json`` file.

        Raises:
            FileNotFoundError: neither a known shape nor a config file; the message lists
                the shapes.
        """
        from transformers import AutoConfig

        path = Path(source)
        named = SHAPES_DIR / f"{source}.config.json"
        if named.is_file():
            path = named
        elif path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            known = ", ".join(shape_names())
            raise FileNotFoundError(f"no model config at {str(source)!r} (named shapes: {known})")
        data = json.loads(path.read_text())
        config = AutoConfig.for_model(data.pop("model_type"), **data)
        return cls.from_config(config, name=str(source))


def shape_names() -> list[str]:
    """The named shapes shipped in :data:`SHAPES_DIR`."""
    return sorted(p.name.removesuffix(".config.json") for p in SHAPES_DIR.glob("*.config.json"))


@dataclass(frozen=True)
class RankMemory:
    """Bytes one learner rank holds (module docstring).

    Attributes:
        policy_states, critic_states, reference: the model states on the device.
        activations: the largest micro-batch (``micro_batch_tokens`` tokens).
        optimizer_transient, export_transient: held outside micro-batches.
        micro_batch_tokens: the tokens ``activations`` is for.
        host: what offload keeps in this rank's host memory instead (0 without offload).
    """

    policy_states: int
    critic_states: int
    reference: int
    activations: int
    optimizer_transient: int
    export_transient: int
    micro_batch_tokens: int
    host: int = 0

    @property
    def states(self) -> int:
        """Held for the whole run: policy, critic and reference states."""
        return self.policy_states + self.critic_states + self.reference

    @property
    def peak(self) -> int:
        """The states plus the largest of the micro-batch and the two transients."""
        return self.states + max(self.activations, self.optimizer_transient, self.export_transient)


def model_state_bytes(
    parameters: int,
    largest_layer: int,
    zero_stage: int,
    ranks: int,
    bf16: bool,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> tuple[int, int]:
    """One trained model's states per rank, ``(device bytes, host bytes)`` (module
    docstring): DeepSpeed's own estimate in bf16 (``estimate_zero2_model_states_mem_needs``
    for stages 0-2, ``estimate_zero3_model_states_mem_needs`` for 3; one node of ``ranks``
    GPUs; its ``cpu_offload`` / ``cpu_offload_params`` for the device side of offload); in
    fp32 4 bytes of weights and gradients and 8 of Adam moments per parameter, the weights
    replicated below ZeRO-3. Host bytes: the offloaded optimizer states (12 per parameter,
    partitioned) and weights (2 or 4, partitioned)."""
    weight = 2 if bf16 else 4
    host = 0
    if offload_optimizer:
        host += math.ceil(12 * parameters / ranks)
    if offload_params:
        host += math.ceil(weight * parameters / ranks)
    if not bf16:
        if zero_stage == 3:
            device = 4 * largest_layer + math.ceil(16 * parameters / ranks)
        else:
            device = 4 * parameters + math.ceil(12 * parameters / ranks)
        if offload_optimizer:
            device -= math.ceil(8 * parameters / ranks)  # the moments (the weights are master)
        if offload_params:
            device -= math.ceil(4 * parameters / ranks)
        return device, host
    if zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            parameters, largest_layer, num_gpus_per_node=ranks, cpu_offload=offload_optimizer,
            cpu_offload_params=offload_params,
        )  # fmt: skip
        return int(gpu), host
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(
        parameters, num_gpus_per_node=ranks, cpu_offload=offload_optimizer
    )
    return int(gpu), host


def activation_bytes(shape: ModelShape, tokens: int) -> int:
    """What a training micro-batch of ``tokens`` tokens holds at its peak (calibrated:
    :data:`ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN`)."""
    per_token = ACTIVATION_BYTES_PER_TOKEN_LAYER_HIDDEN * shape.num_layers * shape.hidden_size
    return tokens * per_token


DEFAULT_BUCKET_BYTES = 1 << 30
"""The weight export's bucket when none is named (``sync.bucket_mb``'s default)."""


def learner_rank_memory(
    shape: ModelShape,
    *,
    zero_stage: int,
    ranks: int,
    bf16: bool,
    micro_batch_tokens: int,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> RankMemory:
    """The plan of one rank of ``ranks`` at ``zero_stage`` for micro-batches of at most
    ``micro_batch_tokens`` tokens, with the optimizer states / parameters offloaded to the
    host or not, exporting ``bucket_bytes`` at a time (bytes; module docstring)."""
    offload = dict(offload_optimizer=offload_optimizer, offload_params=offload_params)
    policy, policy_host = model_state_bytes(
        shape.policy, shape.largest_layer, zero_stage, ranks, bf16, **offload
    )
    critic, critic_host = model_state_bytes(
        shape.critic, shape.largest_layer, zero_stage, ranks, bf16, **offload
    )
    weight_bytes = 2 if bf16 else 4
    reference = weight_bytes * shape.policy
    reference_host = 0
    if zero_stage == 3:
        reference = math.ceil(reference / ranks)
        if offload_params:
            reference, reference_host = 0, reference
    return RankMemory(
        policy_states=policy,
        critic_states=critic,
        reference=reference,
        activations=activation_bytes(shape, micro_batch_tokens),
        optimizer_transient=0 if offload_optimizer else math.ceil(4 * shape.policy / ranks),
        export_transient=min(bucket_bytes, weight_bytes * shape.policy) if zero_stage == 3 else 0,
        micro_batch_tokens=micro_batch_tokens,
        host=policy_host + critic_host + reference_host,
    )


def fits(memory: RankMemory, device_bytes: int) -> bool:
    """Whether the plan's peak is within ``device_bytes``."""
    return memory.peak <= device_bytes


def settings_that_fit(
    shape: ModelShape, device_bytes: int, *, bf16: bool, micro_batch_tokens: int,
    max_ranks: int, offload_optimizer: bool = False, offload_params: bool = False,
) -> list[tuple[int, int]]:  # fmt: skip
    """``(zero_stage, ranks)`` pairs up to ``max_ranks`` whose plan fits with the given
    offload (``offload_params`` only where it applies, at ZeRO-3), the fewest ranks first
    (ZeRO-2 before 3 at equal ranks)."""
    out = []
    for ranks in range(1, max_ranks + 1):
        for stage in (2, 3):
            plan = learner_rank_memory(
                shape, zero_stage=stage, ranks=ranks, bf16=bf16,
                micro_batch_tokens=micro_batch_tokens, offload_optimizer=offload_optimizer,
                offload_params=offload_params and stage == 3,
            )  # fmt: skip
            if fits(plan, device_bytes):
                out.append((stage, ranks))
    return out


def check_learner_fits(
    shape: ModelShape,
    *,
    zero_stage: int,
    ranks: int,
    bf16: bool,
    micro_batch_tokens: int,
    device_bytes: int,
    rank: int | None = None,
    max_ranks: int = 8,
    offload_optimizer: bool = False,
    offload_params: bool = False,
) -> RankMemory:
    """The plan, or an error when its peak is over ``device_bytes``.

    Raises:
        MemoryPlanError: naming the rank (all ranks plan alike), the bytes by part, and the
            ZeRO stage and rank counts up to ``max_ranks`` that would fit (or that none
            does).
    """
    offload = dict(offload_optimizer=offload_optimizer, offload_params=offload_params)
    plan = learner_rank_memory(
        shape, zero_stage=zero_stage, ranks=ranks, bf16=bf16,
        micro_batch_tokens=micro_batch_tokens, **offload,
    )  # fmt: skip
    if fits(plan, device_bytes):
        return plan
    options = settings_that_fit(
        shape, device_bytes, bf16=bf16, micro_batch_tokens=micro_batch_tokens,
        max_ranks=max_ranks, **offload,
    )  # fmt: skip
    who = f"learner rank {rank}" if rank is not None else "every learner rank"
    hint = (
        "fits with " + ", ".join(f"zero_stage {s} on {n} rank(s)" for s, n in options[:3])
        if options
        else f"nothing up to {max_ranks} ranks fits: more GPU memory or fewer tokens per "
        "micro-batch"
    )
    if not offload_optimizer:
        hint += "; or keep the optimizer states on the host (learner.offload_optimizer)"
    raise MemoryPlanError(
        f"{shape.name} does not fit: {who} of {ranks} at zero_stage {zero_stage} needs "
        f"{describe(plan)}, over the {device_bytes / GIB:.1f} GiB it may use; {hint} "
        f"(learner.num_ranks, learner.zero_stage)"
    )


def check_at_start(
    model_path: str | Path, *, zero_stage: int, ranks: int, bf16: bool, device_bytes: int,
    rank: int, offload_optimizer: bool = False, offload_params: bool = False,
) -> RankMemory:  # fmt: skip
    """What a learner rank checks before it allocates anything (on CUDA): the model states
    and the smallest micro-batch (:data:`MIN_MICRO_BATCH_TOKENS`) within ``device_bytes``.
    The micro-batch size itself is the token budget's business (or ``stppo plan``'s).

    Raises:
        MemoryPlanError: see :func:`check_learner_fits`.
    """
    return check_learner_fits(
        ModelShape.load(model_path), zero_stage=zero_stage, ranks=ranks, bf16=bf16,
        micro_batch_tokens=MIN_MICRO_BATCH_TOKENS, device_bytes=device_bytes, rank=rank,
        offload_optimizer=offload_optimizer, offload_params=offload_params,
    )  # fmt: skip


def describe(plan: RankMemory) -> str:
    """``"81.2 GiB (policy 31.0 + critic 29.4 + reference 14.2 + micro-batch of 4096 tokens
    6.5 GiB)"``: the peak and its parts."""
    largest = max(
        (f"micro-batch of {plan.micro_batch_tokens} tokens", plan.activations),
        ("optimizer step", plan.optimizer_transient),
        ("weight export", plan.export_transient),
        key=lambda item: item[1],
    )
    host = f"; {plan.host / GIB:.1f} GiB offloaded to the host" if plan.host else ""
    return (
        f"{plan.peak / GIB:.1f} GiB (policy {plan.policy_states / GIB:.1f} + critic "
        f"{plan.critic_states / GIB:.1f} + reference {plan.reference / GIB:.1f} + "
        f"{largest[0]} {largest[1] / GIB:.1f}{host})"
    )
