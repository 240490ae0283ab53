"""The DeepSpeed learner: policy, critic and frozen reference, one ST-PPO-family step.

:class:`Learner` holds three DeepSpeed engines (one process per rank; gloo on CPU,
:mod:`learner.distributed`):

- ``policy_engine``: the causal LM being trained (AdamW, ZeRO stage and dtype from
  :class:`learner.config.LearnerConfig`);
- ``critic_engine``: :class:`learner.modeling.ValueModel`, a value head on a copy of the
  backbone. Built for every variant so the control plane can switch ppo <-> grpo live;
  only GAE variants run it;
- ``reference_engine``: a frozen copy of the initial policy (KL to reference, ``kl_ref``),
  replaced by the warm-started policy after the warm start
  (:attr:`learner.config.SFTConfig.reference_from_warm_start`).

One :meth:`Learner.step` (spec sections 2-4) is a sequence of named stages:

1. select: drop trajectories whose retrieval failed, that have no policy token, or (group
   variants) whose group has a single member; each drop is counted.
2. collate into a :class:`learner.batch.TrainingBatch`.
3. prepare (no grad): reference log-probs, old values (critic variants), the proximal
   policy's log-probs and the behaviour weights of the rollout correction and M2PO
   (``off_policy = decoupled``, :mod:`learner.corrections`; with ``proximal = loglinear``
   the proximal log-probs and weights are approximated per micro-batch instead),
   token rewards (outcome reward on the last policy token, minus ``kl_coef * KL`` with
   ``kl_mode = in_reward``), advantages (GAE and optional whitening, or group-relative).
4. optimise: ``ppo_epochs`` shuffled passes, mini-batches of ``mini_batch_size``
   trajectories (one optimizer step each), accumulated over micro-batches of
   ``micro_batch_size``. Loss terms are weighted with the mini-batch denominators, so the
   accumulated gradient equals the mini-batch loss's gradient. One clipping-bias norm
   ``||C||`` and one scale ``s`` per optimizer step; ``s`` multiplies that step's learning
   rate (``scale_target = update``) or its policy loss (``loss``).
5. ``policy_version += 1``; metrics.

The other rooms of the learner, each its own module: the warm start's SFT step
(:mod:`learner.sft`), weights leaving the learner (export, the collective weight-sync group:
:mod:`learner.weights`) and checkpoints (:mod:`learner.checkpoint`), which :class:`Learner`
inherits; what a step measures and how it is gathered across micro-batches and ranks
(:mod:`learner.step_metrics`).

Data parallel (``num_ranks`` > 1; one learner per rank, ``services/learner_group.py``):
every rank receives the whole batch and selects, collates, shuffles and cuts mini-batches
identically, so the quantities the loss defines over the batch (the token-mean denominator,
advantage whitening, GRPO group statistics, behaviour weights) are computed over the whole
batch on every rank. The forwards and backwards are split: each stage's rows (the batch for
the no-grad prepare, each mini-batch for its optimizer step) go to ranks by whole
trajectories, balanced by token count (:func:`learner.distributed.balanced_shards`), and
``micro_batch_size`` counts trajectories per forward on one rank. The prepare outputs are
all-gathered; gradients are all-reduced by DeepSpeed (the loss is multiplied by the world
size, since DeepSpeed averages over ranks and the global denominators already make it a
sum); ``||C||^2`` and the clipped flag are all-reduced before the step, so one ``||C||`` and
one ``s`` hold on every rank; metrics are token-weighted sums all-reduced once per learner
step. A rank with fewer micro-batches than another runs padding micro-batches (a real row,
loss times 0), so every rank runs the same forwards: ZeRO-3 gathers parameters in each.

Non-finite guard: a micro-batch whose loss is NaN/inf poisons that engine's gradients with
NaN, so DeepSpeed's overflow check (ZeRO >= 1, or bf16) skips the optimizer step and clears
them; fp32 ZeRO-0 has no such check, so the learner checks the gradient norm itself and
zeroes instead of stepping. Skipped steps are counted, weights never become NaN.

The host does not wait for the GPU inside an optimizer step's micro-batches: their metrics
stay on the device until all their backwards are queued and are read in one transfer
(:class:`learner.step_metrics.DeferredReads`), the non-finite guard is decided on the device,
and a micro-batch goes up without a blocking copy (:func:`learner.batch.to_device`; its
packed layout is built from lengths kept on the host). So the host slices, packs and uploads
micro-batch k + 1 while the GPU runs micro-batch k's backward. Nor does it wait between a
forward and its backward: the policy tokens' positions come from the host
(:meth:`TrainingBatch.to`), and the loss skips its checks of values the collation
guarantees. What still waits, in the padded layout only, is transformers' mask check at
the start of each forward; the packed layouts pass their mask prepared
(:mod:`learner.packing`) and add no sync (``tests/unit/learner/test_host_syncs.py``). DeepSpeed's
throughput timer, which synchronised the device at every engine forward, is off.

Clipping-bias norm ||C|| is the norm over the whole mini-batch (spec section 6: one per
optimizer step), whatever ``micro_batch_size`` is: micro-batches share the mini-batch's
aggregation denominator, so their closed-form squared norms add up to the mini-batch's.
With ``scale_target = update`` and ``bias_norm = logprob`` it costs nothing extra (summed
during the backwards, ``s`` applied to the learning rate at the step); with
``scale_target = loss`` a no-grad forward pre-pass per micro-batch measures it before the
first backward. ``bias_norm = param`` costs one extra forward + backward per micro-batch
(``torch.autograd.grad`` of :func:`learner.losses.clip_bias_surrogate`, which does not touch
DeepSpeed's gradient buffers; the vectors are summed before the norm); ZeRO stage <= 2.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, TypeAdapter
from torch import Tensor

from actors.hardware import resolve_dtype
from actors.trajectory import Trajectory
from learner import advantages as adv_fns
from learner import corrections, losses
from learner.attention import set_varlen_attention
from learner.batch import (
    CPU_AUTO_TOKEN_BUDGET,
    OPTIMIZER_BYTES_PER_PARAMETER,
    MemoryProbe,
    TrainingBatch,
    collate_trajectories,
    memory_token_budget,
    settled_token_budget,
    token_budget_micro_batches,
)
from learner.checkpoint import CheckpointMixin
from learner.config import (
    AlgorithmConfig,
    GSPOConfig,
    LearnerConfig,
    policy_objective,
    ratio_level,
    uses_bias_correction,
    uses_critic,
    uses_turn_ratio,
)
from learner.distributed import (
    all_gather_objects,
    all_reduce_floats,
    balanced_shards,
    init_single_process_distributed,
)
from learner.logprobs import TokenStats, lm_head_of, masked_token_stats
from learner.modeling import LayerCompiler, ValueModel, response_logits, token_logprobs
from learner.packing import model_inputs
from learner.sft import SupervisedMixin
from learner.step_metrics import (
    Deferred,
    Selection,
    StepAccumulator,
    StepMetrics,
    step_metrics,
    turn_advantages,
)

_ALGORITHM_ADAPTER: TypeAdapter = TypeAdapter(AlgorithmConfig)

FIRST_STEP_TOKEN_BUDGET = 8192
"""Cap of the ``micro_batch_tokens = -1`` budget before the first step on CUDA, while the
optimizer states' size is an estimate (:meth:`Learner._memory_token_budget`)."""

logger = logging.getLogger(__name__)


class EmptyBatchError(ValueError):
    """No trajectory of a step is trainable (all excluded); the message says why."""


@contextlib.contextmanager
def _scaled_learning_rate(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Multiply every param group's ``lr`` by ``scale`` for one ``step`` (restored after).

    AdamW's update, weight decay included, is linear in ``lr``, so from the same optimizer
    state this moves the parameters exactly ``scale`` times as far: the clipping-bias
    scale acts on the update, which a loss multiplier does not do under Adam.
    """
    if scale == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def deepspeed_config(
    config: LearnerConfig, lr: float, *, with_optimizer: bool, client_optimizer: bool = False
) -> dict:
    """The DeepSpeed config dict for one engine.

    Accumulation is unmanaged (``managed_gradient_accumulation = false``): the learner calls
    ``backward`` per micro-batch and ``step`` once per mini-batch, since the number of
    micro-batches varies with excluded trajectories. DeepSpeed's throughput timer is off: it
    would synchronise the device at engine forwards and at each step. ``torch_adam`` avoids
    DeepSpeed's own Adam extension (a 54 s JIT build on CPU).

    Args:
        config: the learner section.
        lr: learning rate of this engine's AdamW.
        with_optimizer: False for the frozen reference (ZeRO 0, no optimizer).
        client_optimizer: the learner builds the optimizer itself (the fused AdamW of
            :meth:`Learner._initialize`, :func:`use_fused_adamw`): no ``optimizer`` section.
    """
    bf16 = (
        resolve_dtype(config.dtype, "cuda" if torch.cuda.is_available() else "cpu").name == "bf16"
    )
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.mini_batch_size // config.micro_batch_size,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at engine forwards and at
        # each step (its default "synchronized" timing); the learner times its own steps
        "timers": {"throughput": {"enabled": False}},
    }
    if not with_optimizer:
        if config.zero_stage == 3:  # the frozen reference is sharded like the policy
            ds["zero_optimization"] = {"stage": 3}
            ds["bf16"] = {"enabled": bf16}
            return ds
        ds["zero_optimization"] = {"stage": 0}
        ds["bf16"] = {"enabled": False}  # weights are already bf16; no optimizer wrapper
        return ds
    ds.update(
        {
            "managed_gradient_accumulation": False,
            "gradient_clipping": config.max_grad_norm,
            "zero_optimization": {"stage": config.zero_stage},
        }
    )
    if not client_optimizer:
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "weight_decay": config.weight_decay, "torch_adam": True},
        }
    return ds


def use_fused_adamw(config: LearnerConfig) -> bool:
    """``config.fused_adamw``, None resolved: fused on CUDA, DeepSpeed's foreach elsewhere."""
    return torch.cuda.is_available() if config.fused_adamw is None else config.fused_adamw


def _pad_columns(x: Tensor, width: int) -> Tensor:
    """Right-pad a [b, t] tensor with zeros to [b, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def _scalar(x: Tensor | float | None) -> float:
    if x is None:
        return float("nan")
    return float(x.item()) if isinstance(x, Tensor) else float(x)


class Learner(CheckpointMixin, SupervisedMixin):
    """Policy + critic + reference under DeepSpeed, trained with the ST-PPO family.

    Args:
        model_path: HF folder (weights + tokenizer) the policy, critic backbone and
            reference start from.
        config: the learner section (ZeRO stage, dtype, lrs, batch sizes, epochs).
        algorithm: one of the six variants (``learner.config.AlgorithmConfig``); switchable
            with :meth:`set_algorithm`.
        seed: seeds initialisation and the mini-batch shuffles.
        temperature: sampling temperature of the rollout engines; learner logits are divided
            by it so ratios compare like with like.

    With ``config.num_ranks`` > 1 every rank constructs its own :class:`Learner` inside a
    process group of that size (``services.learner_group.LearnerGroup`` does this) and every
    method is called on every rank with the same arguments, in the same order.

    Raises:
        ValueError: ``bias_norm = param`` with ZeRO stage 3; temperature <= 0; a process
            group whose size is not ``config.num_ranks``.

    Example::

        learner = Learner("data/model/smollm2-135m-instruct", LearnerConfig(), STPPOConfig())
        metrics = learner.step(trajectories)
        weights, version = learner.export_weights()
    """

    def __init__(
        self,
        model_path: str | Path,
        config: LearnerConfig,
        algorithm: BaseModel,
        *,
        seed: int = 0,
        temperature: float = 1.0,
    ) -> None:
        if temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        info = init_single_process_distributed("nccl" if torch.cuda.is_available() else "gloo")
        if info.world_size != config.num_ranks:
            raise ValueError(
                f"learner.num_ranks = {config.num_ranks} but this process is rank {info.rank} "
                f"of a group of {info.world_size} (start ranks with services.learner_group)"
            )
        self.rank, self.world_size = info.rank, info.world_size
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = Path(model_path)
        self.config = config
        self.seed = seed
        self.temperature = temperature
        self.algorithm = self._validated_algorithm(algorithm)
        self.policy_version = 0
        self.global_step = 0
        self.nonfinite_steps_total = 0
        self.reference_version: int | None = None  # None: the reference is the base model
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)

        # dtype "auto": bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere (actors.hardware)
        self.dtype_choice = resolve_dtype(
            config.dtype, "cuda" if torch.cuda.is_available() else "cpu"
        )
        config = self.config = config.model_copy(update={"dtype": self.dtype_choice.name})
        logger.info("learner dtype %s (%s)", self.dtype_choice.name, self.dtype_choice.reason)
        dtype = self.dtype_choice.torch_dtype
        torch.manual_seed(seed)
        policy = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        critic = ValueModel.from_pretrained(self.model_path, dtype=dtype)
        reference = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        reference.requires_grad_(False).eval()
        if config.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
            critic.gradient_checkpointing_enable()
        self._models = [policy, critic, reference]  # the engines' modules
        self.layer_compiler = LayerCompiler(self._models)
        self._attention_default = str(policy.config._attn_implementation)
        self._set_forward_options()
        self.policy_engine = self._initialize(deepspeed, policy, config.actor_lr)
        self.critic_engine = self._initialize(deepspeed, critic, config.critic_lr)
        self.reference_engine, *_ = deepspeed.initialize(
            model=reference, config=deepspeed_config(config, 0.0, with_optimizer=False)
        )
        self.device = self.policy_engine.device
        self.auto_micro_batch_tokens = self._memory_token_budget()
        self.budget_settled = self.device.type != "cuda"
        self.memory_probe = MemoryProbe()

    @property
    def engines(self) -> list[Any]:
        """The three DeepSpeed engines: policy, critic, reference (every variant has all
        three)."""
        return [self.policy_engine, self.critic_engine, self.reference_engine]

    # ------------------------------------------------------------------ control

    @property
    def _varlen(self) -> bool:
        """Whether forwards use the varlen layout (``packed_attention = "varlen"``)."""
        return self.config.pack_sequences and self.config.packed_attention == "varlen"

    def _set_forward_options(self) -> None:
        """Apply the config's compiled layers and attention implementation to the policy,
        critic and reference (at start-up and at every step: the config can change)."""
        self.layer_compiler.set(self.config.compile_layers)
        set_varlen_attention(self._models, self._varlen, default=self._attention_default)

    def _initialize(self, deepspeed: Any, model: torch.nn.Module, lr: float) -> Any:
        """A DeepSpeed engine with AdamW for ``model``: fused (built here, on the model's
        training device) or DeepSpeed's ``torch_adam`` (:func:`use_fused_adamw`)."""
        fused = use_fused_adamw(self.config)
        optimizer = None
        if fused:
            if torch.cuda.is_available():
                model.to(torch.device("cuda", torch.cuda.current_device()))
            optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=lr,
                weight_decay=self.config.weight_decay,
                fused=True,
            )
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=None if fused else [p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            config=deepspeed_config(self.config, lr, with_optimizer=True, client_optimizer=fused),
        )
        return engine

    def _validated_algorithm(self, algorithm: BaseModel | dict) -> BaseModel:
        algorithm = _ALGORITHM_ADAPTER.validate_python(
            algorithm.model_dump() if isinstance(algorithm, BaseModel) else algorithm
        )
        if (
            uses_bias_correction(algorithm)
            and algorithm.bias_norm == "param"
            and self.config.zero_stage == 3
        ):
            raise ValueError(
                "bias_norm='param' needs full parameters for its extra backward: "
                "use zero_stage <= 2 or bias_norm='logprob'"
            )
        return algorithm

    def set_algorithm(self, algorithm: BaseModel | dict) -> None:
        """Switch the variant / its options; takes effect at the next :meth:`step`.

        Raises:
            pydantic.ValidationError: not a valid algorithm config.
            ValueError: ``bias_norm = param`` with ZeRO stage 3.
        """
        self.algorithm = self._validated_algorithm(algorithm)

    def set_lr(self, actor_lr: float | None = None, critic_lr: float | None = None) -> None:
        """Change learning rates from the next optimizer step on.

        Raises:
            ValueError: a learning rate that is not > 0.
        """
        for engine, lr in ((self.policy_engine, actor_lr), (self.critic_engine, critic_lr)):
            if lr is None:
                continue
            if not lr > 0.0:
                raise ValueError(f"learning rates must be > 0, got {lr}")
            for group in engine.optimizer.param_groups:
                group["lr"] = lr

    def learning_rates(self) -> dict[str, float]:
        """Current ``{"actor_lr": ..., "critic_lr": ...}``."""
        return {
            "actor_lr": float(self.policy_engine.optimizer.param_groups[0]["lr"]),
            "critic_lr": float(self.critic_engine.optimizer.param_groups[0]["lr"]),
        }

    # ------------------------------------------------------------------ data parallel

    def _micro_plan(
        self, batch: TrainingBatch, rows: Sequence[int]
    ) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches over ``rows`` of ``batch``: ``(rows, real)`` pairs.

        ``rows`` go to ranks by :func:`balanced_shards` (token counts = real tokens per
        row), each shard is cut in micro-batches (:meth:`_micro_chunks`: by count or by
        token budget), and a rank with fewer chunks than the busiest rank gets padding chunks (``real = False``: ``rows[:1]``,
        to be run with weight 0), so every rank runs the same number of forwards.
        """
        rows = [int(r) for r in rows]
        if self.world_size == 1:
            return [(chunk, True) for chunk in self._micro_chunks(batch, rows)]
        tokens = batch.attention_mask.sum(dim=1)
        shards = balanced_shards(rows, [int(tokens[r]) for r in rows], self.world_size)
        chunks = [self._micro_chunks(batch, shard) for shard in shards]
        count = max(len(c) for c in chunks)
        plan = [(chunk, True) for chunk in chunks[self.rank]]
        return plan + [(rows[:1], False)] * (count - len(plan))

    def _memory_token_budget(self) -> int:
        """The token budget ``micro_batch_tokens = -1`` stands for (CPU: 4,096).

        On CUDA it is sized twice, within ``gpu_memory_fraction`` of the device. At
        start-up, from the memory free (at most that share less what the learner reserved)
        less the AdamW states still to come
        (:data:`learner.batch.OPTIMIZER_BYTES_PER_PARAMETER` per trainable parameter) and
        the estimate of :func:`learner.batch.memory_token_budget`, at most
        :data:`FIRST_STEP_TOKEN_BUDGET`; after the first RL learner step
        (:meth:`_settle_token_budget`) from what that step measured. Ranks take the
        smallest of their budgets: each one cuts every rank's micro-batches
        (:meth:`_micro_plan`), and their counts must agree."""
        if self.device.type != "cuda":
            return CPU_AUTO_TOKEN_BUDGET
        free, total = torch.cuda.mem_get_info(self.device)
        # within the learner's share of the device, less what it holds (its weights)
        share = self.config.gpu_memory_fraction * total
        free = min(free, int(share) - torch.cuda.memory_reserved(self.device))
        trainable = sum(
            p.numel()
            for engine in (self.policy_engine, self.critic_engine)
            for p in engine.module.parameters()
            if p.requires_grad
        )
        pending = trainable * OPTIMIZER_BYTES_PER_PARAMETER
        budget = memory_token_budget(
            free,
            self.policy_engine.module.config,
            gradient_checkpointing=self.config.gradient_checkpointing,
            pending_bytes=pending,
        )
        logger.info(
            "first-step micro-batch token budget from %.1f GiB free, %.1f GiB of optimizer "
            "states to come: %d tokens (at most %d)",
            free / 2**30,
            pending / 2**30,
            budget,
            FIRST_STEP_TOKEN_BUDGET,
        )
        return self._smallest_over_ranks(min(budget, FIRST_STEP_TOKEN_BUDGET))

    def _smallest_over_ranks(self, budget: int) -> int:
        """The smallest of every rank's ``budget`` (a collective; itself on one rank)."""
        (largest_negated,) = all_reduce_floats([-float(budget)], self.world_size, "max")
        return int(-largest_negated)

    def _settle_token_budget(self) -> None:
        """After the first RL learner step on CUDA: the ``micro_batch_tokens = -1`` budget
        from what that step measured (:class:`learner.batch.MemoryProbe`), once. The memory
        held while its micro-batches ran (``state_bytes``: weights, gradients, optimizer
        states; not an optimizer step's temporaries) comes off the device's total
        less what is not torch's (the CUDA contexts, other processes), or off
        ``gpu_memory_fraction`` of the total where that is less; what is left, divided by
        the bytes a training micro-batch held per token, gives
        :func:`learner.batch.settled_token_budget`.
        SFT steps do not settle it: the critic's optimizer states do not exist yet then.
        Every rank settles at the same step and all take the smallest budget."""
        if self.budget_settled:
            return
        self.budget_settled = True
        probe = self.memory_probe
        measured = probe.optimizer_steps > 0 and probe.bytes_per_token > 0.0
        budget = self.auto_micro_batch_tokens  # nothing measured (fp32 ZeRO-0): it stays
        if measured:
            free, total = torch.cuda.mem_get_info(self.device)
            not_torch = total - free - torch.cuda.memory_reserved(self.device)
            device = min(total - not_torch, int(self.config.gpu_memory_fraction * total))
            available = device - probe.state_bytes
            budget = settled_token_budget(available, probe.bytes_per_token)
        self.auto_micro_batch_tokens = self._smallest_over_ranks(budget)
        if measured:
            logger.info(
                "micro-batch token budget from the first step: %.1f GiB left by its states, "
                "%.0f KiB per token held by a micro-batch: %d tokens "
                "(the smallest over ranks)",
                available / 2**30,
                probe.bytes_per_token / 2**10,
                self.auto_micro_batch_tokens,
            )

    @contextlib.contextmanager
    def _probed(self, model: str, micro: TrainingBatch, accumulating: bool) -> Iterator[None]:
        """Measures a training micro-batch's forward and backward for the memory probe while
        the token budget is not settled (on CUDA, the first RL step); else nothing.
        ``accumulating``: not the first micro-batch of its mini-batch (the model's gradients
        are held before its forward)."""
        if self.budget_settled:
            yield
            return
        mask = micro.attention_mask  # the budget counts real tokens packed, slots padded
        tokens = int(mask.sum()) if self.config.pack_sequences else mask.numel()
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        peak = torch.cuda.max_memory_allocated(self.device)
        self.memory_probe.micro_batch(model, start, peak, tokens, accumulating)

    def _micro_chunks(self, batch: TrainingBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` cut into micro-batches: by token budget (``micro_batch_tokens > 0``, or
        -1: the budget sized from memory, :meth:`_memory_token_budget`), else
        ``micro_batch_size`` at a time in order. Empty ``rows``: no micro-batch."""
        if not rows:
            return []
        budget = self.config.micro_batch_tokens
        if budget == -1:
            budget = self.auto_micro_batch_tokens
        if budget > 0:
            return token_budget_micro_batches(
                rows,
                batch.prompt_lengths,
                batch.response_lengths,
                budget,
                packed=self.config.pack_sequences,
            )
        size = self.config.micro_batch_size
        return [rows[s : s + size] for s in range(0, len(rows), size)]

    # ------------------------------------------------------------------ step

    def step(self, trajectories: Sequence[Trajectory]) -> StepMetrics:
        """One learner step on a batch of trajectories (stages in the module docstring).

        Args:
            trajectories: rollouts, any number >= 1 (mini-batches of
                ``config.mini_batch_size``; the last one may be smaller).

        Returns:
            :class:`StepMetrics`.

        Raises:
            EmptyBatchError: every trajectory was excluded (the step is not taken and the
                version does not change).
            ValueError: a trajectory that fails :meth:`Trajectory.validate`.
        """
        start = time.perf_counter()
        self._set_forward_options()
        algorithm = self.algorithm
        selection = self._select(trajectories, algorithm)
        batch = collate_trajectories(selection.kept, self.pad_token_id)
        staleness = [self.policy_version - int(v) for v in batch.policy_version_min]
        acc = StepAccumulator()
        self._prepare(batch, algorithm, acc)
        self._optimize(batch, algorithm, acc)
        self.global_step += 1
        self.policy_version += 1
        self._settle_token_budget()
        step_s = time.perf_counter() - start
        metrics = step_metrics(
            batch, algorithm, selection, acc, staleness, step_s,
            policy_version=self.policy_version, global_step=self.global_step,
            nonfinite_steps_total=self.nonfinite_steps_total, ppo_epochs=self.config.ppo_epochs,
        )  # fmt: skip
        metrics.turn_advantages = turn_advantages(trajectories, selection.kept, batch)
        return metrics

    def _select(self, trajectories: Sequence[Trajectory], algorithm: BaseModel) -> Selection:
        kept = [t for t in trajectories if not t.retrieval_failed]
        retrieval_failed = len(trajectories) - len(kept)
        with_tokens = [t for t in kept if t.num_policy_tokens > 0]
        no_tokens = len(kept) - len(with_tokens)
        singleton = 0
        if not uses_critic(algorithm):
            sizes: dict[str, int] = defaultdict(int)
            for t in with_tokens:
                sizes[t.group_id] += 1
            grouped = [t for t in with_tokens if sizes[t.group_id] >= 2]
            singleton = len(with_tokens) - len(grouped)
            with_tokens = grouped
        if not with_tokens:
            raise EmptyBatchError(
                f"no trainable trajectory among {len(trajectories)}: {retrieval_failed} "
                f"retrieval failed, {no_tokens} without policy tokens, {singleton} alone "
                "in their group (group-relative advantages need >= 2 per group)"
            )
        return Selection(with_tokens, retrieval_failed, no_tokens, singleton)

    # ------------------------------------------------------------------ prepare (no grad)

    @torch.no_grad()
    def _prepare(self, batch: TrainingBatch, algorithm: BaseModel, acc: StepAccumulator) -> None:
        width = batch.response_ids.shape[1]
        decoupled = algorithm.off_policy == "decoupled"
        recompute = decoupled and algorithm.proximal == "recompute"
        on_device: dict[str, list[Tensor]] = defaultdict(list)
        kept_rows: list[int] = []
        for rows, real in self._micro_plan(batch, range(batch.batch_size)):
            micro = batch.select(rows).to(self.device)
            computed = {"ref": self._logprobs(self.reference_engine, micro)}
            if uses_critic(algorithm):
                computed["values"] = self._values(micro)
            if recompute:
                computed["proximal"] = self._logprobs(self.policy_engine, micro)
            if not real:
                continue  # padding forward (keeps ZeRO-3's gathers in step); result unused
            kept_rows += rows
            for name, value in computed.items():
                on_device[name].append(_pad_columns(value, width))
        outputs: dict[str, dict[int, Tensor]] = defaultdict(dict)
        for name, parts in on_device.items():  # one read per output, after every forward
            host = torch.cat(parts).cpu()
            outputs[name].update((r, host[i].clone()) for i, r in enumerate(kept_rows))
        if self.world_size > 1:  # every rank needs every row (whole-batch advantages)
            for part in all_gather_objects(dict(outputs), self.world_size):
                for name, by_row in part.items():
                    outputs[name].update(by_row)

        def stacked(name: str) -> Tensor:
            return torch.stack([outputs[name][r] for r in range(batch.batch_size)])

        batch.ref_logprobs = stacked("ref")
        if recompute:
            batch.old_logprobs = stacked("proximal")
            batch.behavior_weights, metrics = self._behavior_correction(
                batch, batch.old_logprobs, algorithm
            )
            acc.behavior = {name: _scalar(value) for name, value in metrics.items()}
            self._record_logprob_gap(batch, batch.old_logprobs, acc)
            acc.gap_replicated = True  # the whole batch, identical on every rank
        elif decoupled:  # proximal = loglinear: approximated per micro-batch in the loss
            batch.old_logprobs = None
        else:
            batch.old_logprobs = batch.behavior_logprobs
        if uses_critic(algorithm):
            batch.old_values = stacked("values") * batch.loss_mask
        self._compute_advantages(batch, algorithm)

    @staticmethod
    def _behavior_correction(
        batch: TrainingBatch, proximal_logprobs: Tensor, algorithm: BaseModel
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The decoupled objective's per-token weights [b, T] for ``batch`` (all of a
        step's rows, or one micro-batch with the log-linear proximal) and their metrics:
        the rollout correction (TIS / MIS / IcePop), then M2PO's mask."""
        rc = algorithm.correction
        out = corrections.rollout_correction(
            proximal_logprobs,
            batch.behavior_logprobs,
            batch.loss_mask,
            batch.turn_ids,
            is_level=rc.is_level,
            is_statistic=rc.is_statistic,
            is_cap=rc.is_cap,
            mask_level=rc.mask_level,
            mask_statistic=rc.mask_statistic,
            mask_low=rc.mask_low,
            mask_high=float("inf") if rc.mask_high is None else rc.mask_high,
        )
        weights, metrics = out.weights, dict(out.metrics)
        if algorithm.m2po_threshold is not None:
            keep = corrections.m2po_keep_mask(
                proximal_logprobs,
                batch.behavior_logprobs,
                batch.loss_mask,
                threshold=algorithm.m2po_threshold,
            )
            weights = weights * keep.to(weights.dtype)
            policy = batch.loss_mask != 0
            metrics["m2po_masked"] = losses.masked_mean(
                (policy & ~keep).to(weights.dtype), policy.to(weights.dtype)
            )
        return weights, metrics

    def _proximal_alpha(self, micro: TrainingBatch, acc: StepAccumulator) -> Tensor:
        """:func:`corrections.loglinear_proximal_alpha` of ``micro``'s tokens at this point
        of the step (``acc.optimizer_steps`` updates done)."""
        versions = micro.token_versions
        if versions is None:  # one version per trajectory
            versions = micro.policy_version_min.unsqueeze(1).expand_as(micro.loss_mask)
        return corrections.loglinear_proximal_alpha(
            versions.to(micro.loss_mask.device),
            self.policy_version,
            updates_done=acc.optimizer_steps,
            updates_per_version=acc.updates_per_version,
        )

    def _micro_off_policy_inputs(
        self,
        micro: TrainingBatch,
        current_logprobs: Tensor,
        algorithm: BaseModel,
        acc: StepAccumulator,
        *,
        record: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """(the log-probs the ratio is taken against, the behaviour weights) of ``micro``.

        Precomputed for the whole step except with ``proximal = loglinear``, where the
        proximal log-probs are approximated from ``current_logprobs`` (detached) and the
        weights computed on this micro-batch. With recomputed proximal log-probs the
        approximation is computed anyway and its error recorded. ``record``: add the
        metrics to ``acc`` (False for a pre-pass or a padding micro-batch).
        """
        if micro.old_logprobs is not None:
            if record and algorithm.off_policy == "decoupled":
                approx = corrections.loglinear_proximal_logprobs(
                    micro.behavior_logprobs, current_logprobs, self._proximal_alpha(micro, acc)
                )
                error = losses.masked_mean((micro.old_logprobs - approx).abs(), micro.loss_mask)
                acc.reads.defer(
                    {"error": error, "tokens": micro.loss_mask.sum()},
                    lambda v: acc.add_token_mean(
                        "proximal_approx_abs_error", v["error"], v["tokens"]
                    ),
                )
            return micro.old_logprobs, micro.behavior_weights
        proximal = corrections.loglinear_proximal_logprobs(
            micro.behavior_logprobs, current_logprobs, self._proximal_alpha(micro, acc)
        )
        weights, metrics = self._behavior_correction(micro, proximal, algorithm)
        if not record:
            return proximal, weights

        def add(values: dict[str, float]) -> None:
            tokens = values.pop("_tokens")
            for name, value in values.items():
                if name == "behavior_weight_max":
                    acc.behavior_max = max(acc.behavior_max, value)
                else:
                    acc.add_token_mean(name, value, tokens)

        acc.reads.defer({**metrics, "_tokens": micro.loss_mask.sum()}, add)
        return proximal, weights

    def _record_logprob_gap(
        self, batch: TrainingBatch, learner_logprobs: Tensor, acc: StepAccumulator
    ) -> None:
        """Inference/training mismatch: mean |behaviour - learner| log-prob (nats) over the
        staleness-0 policy tokens only (sampled by the weights the learner holds now: per
        token, so a trajectory whose later tokens came after a mid-rollout update counts
        those), so staleness does not leak into it. Adds 0 tokens without such a token.
        Read at the next flush of ``acc.reads``."""
        if batch.token_versions is not None:
            fresh = batch.token_versions == self.policy_version
        else:
            fresh = (batch.policy_version_min == self.policy_version).unsqueeze(1)
        mask = batch.loss_mask * fresh.to(batch.loss_mask.dtype)
        gap = (batch.behavior_logprobs - learner_logprobs).abs()

        def add(values: dict[str, float]) -> None:
            acc.gap_sum += values["sum"]
            acc.gap_count += values["count"]

        # where, not gap * mask: a NaN log-prob off the counted tokens stays out of the sum
        total = torch.where(mask != 0, gap * mask, 0.0).sum()
        acc.reads.defer({"sum": total, "count": mask.sum()}, add)

    def _logprobs(self, engine: Any, micro: TrainingBatch) -> Tensor:
        """float32 [b, T] log-probs of ``micro``'s response tokens under ``engine``, 0 off
        the policy tokens."""
        return self._token_stats(engine, micro).logprobs * micro.loss_mask

    def _token_stats(
        self,
        engine: Any,
        micro: TrainingBatch,
        *,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> TokenStats:
        """Per-token log-probs (and entropy) of ``micro``'s response under ``engine``.

        Chunked through the LM head on the policy tokens only (:mod:`learner.logprobs`;
        values off ``loss_mask`` are 0) when ``config.logprob_chunk_tokens > 0`` and the
        model allows it (:func:`learner.logprobs.lm_head_of`), else the full-vocabulary
        logits (values everywhere; the entropy differentiable only with ``entropy_grad``).
        Both are differentiable in the policy where grad is enabled.
        """
        chunk = self.config.logprob_chunk_tokens
        head = lm_head_of(engine) if chunk > 0 else None
        if head is not None:
            return masked_token_stats(
                engine,
                micro,
                micro.policy_token_positions(),
                head,
                temperature=self.temperature,
                chunk_tokens=chunk,
                with_entropy=with_entropy,
                packed=self.config.pack_sequences,
                varlen=self._varlen,
            )
        logits = response_logits(engine, micro, self.temperature)
        logprobs = token_logprobs(logits, micro.response_ids)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad):
                entropy = losses.entropy_from_logits(logits)
        return TokenStats(logprobs, entropy)

    def _values(self, micro: TrainingBatch) -> Tensor:
        """float32 [b, T] critic values of ``micro``'s response tokens (packed or padded as
        ``config.pack_sequences`` says)."""
        inputs = model_inputs(micro, self.config.pack_sequences, self._varlen)
        return self.critic_engine(**inputs.forward_kwargs(), state_index=inputs.state_index)

    def _compute_advantages(self, batch: TrainingBatch, algorithm: BaseModel) -> None:
        """Token rewards and advantages (and returns for critic variants), in place."""
        mask = batch.loss_mask
        kl = torch.zeros_like(mask)
        if algorithm.kl_mode == "in_reward" and algorithm.kl_coef > 0.0:
            # the log-linear proximal has no log-probs here: the behaviour policy's stand in
            old = batch.behavior_logprobs if batch.old_logprobs is None else batch.old_logprobs
            kl = losses.kl_penalty(old, batch.ref_logprobs, algorithm.kl_estimator)
            kl = kl * mask
        if uses_critic(algorithm):
            token_rewards = torch.zeros_like(mask)
            rows = torch.arange(batch.batch_size)
            token_rewards[rows, batch.last_policy_index] = batch.rewards
            token_rewards = token_rewards - algorithm.kl_coef * kl
            gae = adv_fns.compute_gae(
                token_rewards, batch.old_values, mask, gamma=algorithm.gamma, lam=algorithm.lam
            )
            advantages = gae.advantages
            if algorithm.whiten_advantages:
                advantages = adv_fns.whiten(advantages, mask)
            batch.advantages, batch.returns = advantages.float(), gae.returns.float()
            return
        # group-relative: KL-in-reward lowers the scalar reward by the trajectory's total KL
        rewards = batch.rewards - algorithm.kl_coef * kl.sum(dim=1)
        per_sequence = adv_fns.group_relative_advantages(
            rewards,
            batch.group_ids,
            std_normalize=algorithm.group_std_normalize,
            eps=algorithm.group_eps,
        )
        batch.advantages = adv_fns.broadcast_sequence_advantages(per_sequence, mask).float()

    # ------------------------------------------------------------------ optimise

    def _optimize(self, batch: TrainingBatch, algorithm: BaseModel, acc: StepAccumulator) -> None:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.global_step)
        mini_batches = -(-batch.batch_size // self.config.mini_batch_size)
        acc.updates_per_version = mini_batches * self.config.ppo_epochs
        for epoch in range(self.config.ppo_epochs):
            order = torch.randperm(batch.batch_size, generator=generator)
            for start in range(0, batch.batch_size, self.config.mini_batch_size):
                rows = order[start : start + self.config.mini_batch_size]
                on_policy = epoch == 0 and start == 0
                self._train_mini_batch(batch.select(rows), algorithm, acc, on_policy)
        acc.reduce(self.world_size)

    def _agg_denominator(self, mini: TrainingBatch, algorithm: BaseModel) -> float:
        per_sequence = mini.loss_mask.sum(dim=1)
        if algorithm.loss_agg_mode == "token-mean":
            return float(per_sequence.sum())
        return float((per_sequence > 0).sum())

    def _train_mini_batch(
        self, mini: TrainingBatch, algorithm: BaseModel, acc: StepAccumulator, on_policy: bool
    ) -> None:
        """One optimizer step: micro-batch backwards, one ``||C||`` and one ``s``, the step.

        ``||C||`` is the norm over the whole mini-batch: the micro-batches share its
        aggregation denominator, so their closed-form (``logprob``) squared norms add up to
        it, and ``param`` gradients are summed as vectors before the norm. Where ``s`` must
        be known before the first backward (``scale_target = loss``, or ``bias_norm =
        param``), a pre-pass over the micro-batches measures it first.
        """
        denominator = self._agg_denominator(mini, algorithm)
        kwargs = self._policy_loss_kwargs(algorithm)
        bias = uses_bias_correction(algorithm)
        plan = self._micro_plan(mini, range(mini.batch_size))
        norm: Tensor | None = None
        scale = 1.0
        if bias and (algorithm.bias_norm == "param" or algorithm.scale_target == "loss"):
            norm, any_clipped = self._mini_batch_clip_bias(
                mini, plan, algorithm, denominator, kwargs, acc
            )
            scale = self._bias_scale(norm, any_clipped, algorithm)
        loss_scale = scale if norm is not None and algorithm.scale_target == "loss" else 1.0
        # the micro-batches' metrics stay on the device until all their backwards are
        # queued, then are read at once (DeferredReads: no host sync per micro-batch)
        queued: list[tuple[bool, Deferred, Deferred | None]] = []
        for index, (rows, real) in enumerate(plan):
            micro = mini.select(rows).to(self.device)
            # DeepSpeed averages gradients over ranks; the global denominators make the
            # wanted gradient their sum. Padding micro-batches contribute nothing.
            weight = float(self.world_size) if real else 0.0
            with self._probed("policy", micro, accumulating=index > 0):
                policy = self._policy_backward(
                    micro,
                    algorithm,
                    denominator,
                    on_policy and real,
                    acc,
                    kwargs,
                    loss_scale,
                    weight,
                )
            critic = None
            if uses_critic(algorithm):
                with self._probed("critic", micro, accumulating=index > 0):
                    critic = self._critic_backward(micro, algorithm, denominator, weight)
            critic_read = None if critic is None else acc.reads.defer(critic)
            queued.append((real, acc.reads.defer(policy), critic_read))
        acc.reads.flush()
        sums: dict[str, float] = defaultdict(float)
        policy_finite, critic_finite = True, True
        micro_clipped = False
        for real, policy_read, critic_read in queued:
            metrics = dict(policy_read.get())
            policy_finite &= math.isfinite(metrics["loss"])
            if critic_read is not None:
                value_metrics = critic_read.get()
                critic_finite &= math.isfinite(value_metrics["loss"])
                if real:
                    sums["value_loss"] += value_metrics["value_loss"]
            if not real:
                continue
            sums["pg_loss"] += metrics.pop("pg_loss")
            sums["clip_bias_norm_sq"] += metrics.pop("clip_bias_norm_sq")
            micro_clipped |= metrics["clip_ratio"] > 0.0
            acc.token_log_ratio_abs_max = max(
                acc.token_log_ratio_abs_max, metrics.pop("token_log_ratio_abs_max")
            )
            acc.add_micro(metrics, metrics["num_tokens"], metrics["num_turns"])
        summed_norm_sq = sums.pop("clip_bias_norm_sq", 0.0)
        if norm is None:  # no pre-pass: the micro-batches' squared norms add up (all ranks)
            summed_norm_sq, clipped = all_reduce_floats(
                [summed_norm_sq, float(micro_clipped)], self.world_size, "sum"
            )
            norm = torch.tensor(math.sqrt(max(summed_norm_sq, 0.0)))
            if bias:
                scale = self._bias_scale(norm, clipped > 0.0, algorithm)
        sums["clip_bias_norm"] = _scalar(norm)
        sums["clip_bias_scale"] = scale
        for name in ("pg_loss", "value_loss", "clip_bias_norm", "clip_bias_scale"):
            if name in sums or name == "pg_loss" or uses_critic(algorithm):
                acc.mini[name].append(sums.get(name, 0.0))
        warmup = self.lr_warmup_factor()
        lr_scale = warmup * (scale if bias and algorithm.scale_target == "update" else 1.0)
        with _scaled_learning_rate(self.policy_engine.optimizer, lr_scale):
            applied, grad_norm = self._optimizer_step(self.policy_engine, policy_finite)
        acc.optimizer_steps += 1
        if applied:
            acc.grad_norms.append(grad_norm)
        else:
            acc.skipped += 1
            self.nonfinite_steps_total += 1
        if uses_critic(algorithm):
            with _scaled_learning_rate(self.critic_engine.optimizer, warmup):
                applied, grad_norm = self._optimizer_step(self.critic_engine, critic_finite)
            if applied:
                acc.critic_grad_norms.append(grad_norm)
            else:
                acc.critic_skipped += 1

    def lr_warmup_factor(self) -> float:
        """Linear warm-up of both learning rates over the first ``config.lr_warmup_steps``
        learner steps: ``min(1, (global_step + 1) / lr_warmup_steps)`` (1 when 0). Counted
        in learner steps, which checkpoints keep, so a resumed run continues the ramp."""
        steps = self.config.lr_warmup_steps
        return 1.0 if steps <= 0 else min(1.0, (self.global_step + 1) / steps)

    @staticmethod
    def _bias_scale(norm: Tensor, any_clipped: bool, algorithm: BaseModel) -> float:
        """The clipping-bias scale s of one optimizer step (:func:`losses.clip_bias_scale`)."""
        return _scalar(
            losses.clip_bias_scale(
                norm,
                torch.tensor(any_clipped),
                normalize_mode=algorithm.normalize_mode,
                tau=algorithm.tau,
                delta=algorithm.delta,
            )
        )

    def _policy_backward(
        self,
        micro: TrainingBatch,
        algorithm: BaseModel,
        denominator: float,
        on_policy: bool,
        acc: StepAccumulator,
        kwargs: dict[str, Any],
        loss_scale: float,
        weight: float = 1.0,
    ) -> dict[str, Tensor]:
        """Forward, loss and backward of one policy micro-batch; returns its metrics as
        0-dim tensors on the device (read by the caller through ``acc.reads``).

        ``loss = loss_scale * L_pg (+ KL loss) (- entropy bonus)``: ``loss_scale`` is the
        clipping-bias scale with ``scale_target = loss``, else 1. The backward runs on
        ``weight * loss`` (the world size, or 0 for a padding micro-batch); the metrics
        describe the unweighted loss.
        """
        stats = self._token_stats(
            self.policy_engine,
            micro,
            with_entropy=True,
            entropy_grad=algorithm.entropy_coef > 0.0,
        )
        logprobs, entropy = stats.logprobs, stats.entropy
        del stats
        mask = micro.loss_mask
        if on_policy and (algorithm.off_policy == "behavior" or micro.old_logprobs is None):
            self._record_logprob_gap(micro, logprobs.detach(), acc)
        old_logprobs, behavior_weights = self._micro_off_policy_inputs(
            micro, logprobs.detach(), algorithm, acc, record=weight != 0.0
        )
        out = losses.compute_policy_loss(
            logprobs,
            old_logprobs,
            micro.advantages,
            mask,
            micro.turn_ids,
            agg_denominator=denominator,
            behavior_weights=behavior_weights,
            **kwargs,
        )
        weights = losses.aggregation_weights(
            mask, loss_agg_mode=algorithm.loss_agg_mode, agg_denominator=denominator
        )
        kl_ref = losses.kl_penalty(logprobs, micro.ref_logprobs, algorithm.kl_estimator)
        loss = loss_scale * out.loss
        if algorithm.kl_mode == "loss" and algorithm.kl_coef > 0.0:
            loss = loss + algorithm.kl_coef * (weights * kl_ref).sum()
        if algorithm.entropy_coef > 0.0:
            loss = loss - algorithm.entropy_coef * (weights * entropy).sum()
        self._backward(self.policy_engine, loss * weight if weight != 1.0 else loss, logprobs)
        with torch.no_grad():
            metrics = dict(out.metrics)
            metrics["kl_ref"] = losses.masked_mean(kl_ref.detach(), mask)
            metrics["entropy"] = losses.masked_mean(entropy.detach(), mask)
            metrics["loss"] = loss.detach()
            metrics["num_tokens"] = mask.sum()
        for name in ("clip_bias_norm", "clip_bias_scale"):  # per optimizer step, not micro
            metrics.pop(name)
        return metrics

    def _policy_loss_kwargs(self, algorithm: BaseModel) -> dict[str, Any]:
        """Loss options of :func:`losses.compute_policy_loss` (the clipping-bias scale is
        applied by the trainer, once per optimizer step). Without the loss's checks of its
        inputs' values (a host read between a forward and its backward): every row comes
        from :func:`collate_trajectories`, which validated its trajectory and that it has a
        policy token."""
        turn = uses_turn_ratio(algorithm)
        return {
            "ratio_level": ratio_level(algorithm),
            "clip_eps_low": algorithm.clip_eps_low,
            "clip_eps_high": algorithm.clip_eps_high,
            "turn_advantage": algorithm.turn_advantage if turn else "token",
            "loss_agg_mode": algorithm.loss_agg_mode,
            "token_log_ratio_bound": algorithm.token_log_ratio_bound,
            "clip_ratio_c": algorithm.clip_ratio_c,
            "segment_gradient": "token" if isinstance(algorithm, GSPOConfig) else "mean",
            "objective": policy_objective(algorithm),
            "check_values": False,
        }

    def _mini_batch_clip_bias(
        self,
        mini: TrainingBatch,
        plan: list[tuple[list[int], bool]],
        algorithm: BaseModel,
        denominator: float,
        kwargs: dict,
        acc: StepAccumulator,
    ) -> tuple[Tensor, bool]:
        """(||C|| of the whole mini-batch, whether any token is clipped), before any backward.

        ``logprob``: one no-grad policy forward per micro-batch of ``plan``, closed-form
        squared norms summed. ``param``: one extra forward + backward per micro-batch
        through detached parameter aliases, gradient vectors summed, then the norm. On N
        ranks the squared norms (``logprob``) or the gradient vectors (``param``) and the
        clipped flag are all-reduced, so every rank gets the same global value.
        """
        param = algorithm.bias_norm == "param"
        norm_sq = torch.zeros((), dtype=torch.float64)
        grad_sum: list[Tensor] | None = None
        any_clipped = False
        parts: list[Deferred] = []  # logprob: read once, after the loop (acc.reads)
        for rows, real in plan:
            if param and not real:
                continue  # ZeRO <= 2: no collective in this forward, nothing to keep in step
            micro = mini.select(rows).to(self.device)
            inputs = (micro.old_logprobs, micro.advantages, micro.loss_mask, micro.turn_ids)
            options = {
                **kwargs,
                "agg_denominator": denominator,
                "behavior_weights": micro.behavior_weights,
            }
            if param:
                grads, clipped = self._param_clip_bias_grad(micro, options)
                grad_sum = (
                    grads
                    if grad_sum is None
                    else [a + b for a, b in zip(grad_sum, grads, strict=True)]
                )
                any_clipped |= clipped
                continue
            with torch.no_grad():
                logprobs = self._logprobs(self.policy_engine, micro)
                old, options["behavior_weights"] = self._micro_off_policy_inputs(
                    micro, logprobs, algorithm, acc, record=False
                )
                out = losses.compute_policy_loss(logprobs, old, *inputs[1:], **options)
            if real:
                wanted = ("clip_bias_norm_sq", "clip_ratio")
                parts.append(acc.reads.defer({k: out.metrics[k] for k in wanted}))
        acc.reads.flush()
        for part in (deferred.get() for deferred in parts):
            norm_sq += part["clip_bias_norm_sq"]
            any_clipped |= part["clip_ratio"] > 0
        if param and self.world_size > 1:
            import torch.distributed as dist

            params = [p for p in self.policy_engine.module.parameters() if p.requires_grad]
            if grad_sum is None:  # this rank had no row
                grad_sum = [torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1).double() for g in grad_sum])
            dist.all_reduce(flat)
            grad_sum = [flat]
        if grad_sum is not None:
            norm_sq = torch.stack([g.double().square().sum() for g in grad_sum]).sum().cpu()
        norm_sq_global, clipped = all_reduce_floats(
            [0.0 if param else float(norm_sq), float(any_clipped)], self.world_size, "sum"
        )
        if not param:
            norm_sq = torch.tensor(norm_sq_global, dtype=torch.float64)
        return norm_sq.sqrt().float(), clipped > 0.0

    def _param_clip_bias_grad(
        self, micro: TrainingBatch, options: dict
    ) -> tuple[list[Tensor], bool]:
        """grad_theta of this micro-batch's clip-bias surrogate (``bias_norm = param``), one
        tensor per trainable policy parameter (zeros where unused), and whether it clipped.

        The gradient is taken on a separate forward through detached aliases of the
        parameters (``torch.func.functional_call``; same storage, no copy): DeepSpeed hooks
        the engine's forward outputs and parameters to drive its gradient reduction, and a
        ``torch.autograd.grad`` through that graph would run its backward epilogue. Cost:
        one extra policy forward + backward per micro-batch.
        """
        from torch.func import functional_call

        module = self.policy_engine.module
        aliases = {
            name: p.detach().requires_grad_(True)
            for name, p in module.named_parameters()
            if p.requires_grad
        }
        tensors = {**dict(module.named_buffers()), **aliases}
        num_response = micro.response_ids.shape[1]
        out = functional_call(
            module,
            tensors,
            args=(),
            kwargs={
                "input_ids": micro.input_ids,
                "attention_mask": micro.attention_mask,
                "position_ids": micro.position_ids,
                "logits_to_keep": num_response + 1,
                "use_cache": False,
            },
        )
        logits = out.logits[:, :-1, :]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logprobs = token_logprobs(logits, micro.response_ids)
        del out, logits
        inputs = (micro.old_logprobs, micro.advantages, micro.loss_mask, micro.turn_ids)
        surrogate = losses.clip_bias_surrogate(logprobs, *inputs, **options)
        params = list(aliases.values())
        grads = torch.autograd.grad(surrogate, params, allow_unused=True)
        with torch.no_grad():
            clipped = losses.compute_policy_loss(logprobs.detach(), *inputs, **options)
        dense = [
            torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
        ]
        return dense, bool(clipped.metrics["clip_ratio"] > 0)

    def _critic_backward(
        self, micro: TrainingBatch, algorithm: BaseModel, denominator: float, weight: float = 1.0
    ) -> dict[str, Tensor]:
        """Forward, value loss and backward of one critic micro-batch; its metrics as 0-dim
        tensors on the device, as :meth:`_policy_backward`."""
        values = self._values(micro)
        out = losses.compute_value_loss(
            values,
            micro.old_values,
            micro.returns,
            micro.loss_mask,
            value_clip=algorithm.value_clip,
            loss_agg_mode=algorithm.loss_agg_mode,
            agg_denominator=denominator,
        )
        loss = algorithm.value_loss_coef * out.loss
        self._backward(self.critic_engine, loss * weight if weight != 1.0 else loss, values)
        return {**out.metrics, "loss": loss.detach()}

    @staticmethod
    def _backward(engine: Any, loss: Tensor, output: Tensor) -> None:
        """``engine.backward(loss)``; a non-finite loss also poisons every gradient with NaN
        (the gradient reaching ``output``, which depends on all trained parameters, gets
        NaN added), so the step's overflow check cannot miss it even where the loss's NaN
        would not reach a gradient. Decided on the device: the host does not wait for the
        loss (a finite one adds 0, which changes no gradient)."""
        poison = torch.where(torch.isfinite(loss.detach()), 0.0, math.nan)
        handle = output.register_hook(lambda grad: grad + poison) if output.requires_grad else None
        try:
            engine.backward(loss, scale_wrt_gas=False)
        finally:
            if handle is not None:
                handle.remove()

    def _optimizer_step(self, engine: Any, loss_finite: bool) -> tuple[bool, float]:
        """Step ``engine`` unless its gradients are non-finite; (applied, pre-clip norm)."""
        if not (engine.zero_optimization() or engine.bfloat16_enabled()):
            # fp32 ZeRO-0: a plain torch optimizer, which would write NaN weights.
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            norm = _scalar(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if self.world_size > 1:  # gradients are reduced inside step(): agree first
                (bad,) = all_reduce_floats(
                    [float(not (loss_finite and math.isfinite(norm)))], self.world_size, "max"
                )
                if bad > 0.0:
                    engine.zero_grad()
                    return False, float("nan")
                return True, self._fp32_zero0_step(engine)
            if not (loss_finite and math.isfinite(norm)):
                engine.zero_grad()
                return False, norm
            engine.step()
            return True, norm
        if self.budget_settled:
            engine.step()
        else:  # the first step's peaks size the token budget (_settle_token_budget)
            torch.cuda.reset_peak_memory_stats(self.device)
            engine.step()
            self.memory_probe.optimizer_step(
                torch.cuda.max_memory_allocated(self.device),
                torch.cuda.memory_allocated(self.device),
                applied=bool(engine.was_step_applied()),
            )
        return bool(engine.was_step_applied()), _scalar(engine.get_global_grad_norm())

    @staticmethod
    def _fp32_zero0_step(engine: Any) -> float:
        """``engine.step()`` for fp32 ZeRO-0 on N ranks, returning the pre-clip norm of the
        reduced gradient. DeepSpeed reduces inside ``step`` and then clips with
        ``clip_grad_norm_`` without keeping its result (``get_global_grad_norm`` is None at
        ZeRO-0), so the clip is wrapped for this one call to record it."""
        from deepspeed.runtime.utils import clip_grad_norm_

        norms: list[float] = []

        def clip() -> None:
            norm = clip_grad_norm_(
                parameters=engine.module.parameters(),
                max_norm=engine.gradient_clipping(),
                mpu=engine.mpu,
            )
            norms.append(_scalar(norm))

        engine.clip_fp32_gradients = clip
        try:
            engine.step()
        finally:
            del engine.clip_fp32_gradients
        return norms[0] if norms else float("nan")
