"""The DeepSpeed learner: policy, critic and frozen reference, one ST-PPO-family step.

:class:`Learner` holds three DeepSpeed engines (one process per rank; gloo on CPU,
:mod:`learner.distributed`): ``policy_engine``, the causal LM being trained;
``critic_engine``, :class:`learner.modeling.ValueModel` (built for every variant so the
control plane can switch ppo <-> grpo live; only GAE variants run it); and
``reference_engine``, a frozen copy of the initial (or warm-started) policy for ``kl_ref``.

One :meth:`Learner.step` (spec sections 2-4), with the variant resolved once into a typed
:class:`learner.objective.Objective`:

1. select (:func:`learner.batch.select_trainable`) and collate the trajectories;
2. prepare, no grad: reference log-probs, the critic's old values, the proximal log-probs
   and behaviour weights of the decoupled objective (:mod:`learner.off_policy`), token
   rewards and advantages (:func:`learner.advantages.compute_advantages`);
3. optimise: ``ppo_epochs`` shuffled passes of mini-batches of ``mini_batch_size``
   trajectories, one optimizer step each, accumulated over micro-batches
   (:mod:`learner.micro_batches`) whose loss terms use the mini-batch's denominators, so the
   accumulated gradient is the mini-batch loss's; one clipping-bias norm ``||C||`` and one
   scale ``s`` per optimizer step (:mod:`learner.clip_bias`);
4. ``policy_version += 1``; metrics (:mod:`learner.step_metrics`).

On N ranks every rank receives the whole batch and selects, collates and shuffles it
identically, so batch-wide quantities (the token-mean denominator, whitening, group
statistics, behaviour weights) are the same everywhere; the forwards are split by whole
trajectories, the prepare outputs all-gathered, the gradients all-reduced (the loss times
the world size: DeepSpeed averages), ``||C||`` and the metrics all-reduced. The host does
not wait for the device inside an optimizer step: micro-batch metrics are read once after
the backwards are queued (:class:`learner.step_metrics.DeferredReads`) and the non-finite
guard is decided on the device (:mod:`learner.engines`).

The other rooms, each its own module: the DeepSpeed plumbing (:mod:`learner.engines`), the
warm start's SFT step (:mod:`learner.sft`), weights leaving the learner
(:mod:`learner.weights`) and checkpoints (:mod:`learner.checkpoint`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, TypeAdapter
from torch import Tensor

from actors.hardware import check_visible_gpus, resolve_dtype
from actors.trajectory import Trajectory
from learner import losses
from learner.advantages import compute_advantages
from learner.attention import set_varlen_attention
from learner.batch import TrainingBatch, collate_trajectories, select_trainable
from learner.checkpoint import CheckpointMixin
from learner.clip_bias import ClipBiasPrePass, bias_scale
from learner.config import (
    AlgorithmConfig,
    LearnerConfig,
    uses_bias_correction,
)
from learner.distributed import (
    all_gather_objects,
    all_reduce_floats,
    init_single_process_distributed,
)
from learner.engines import (
    backward,
    deepspeed_config,
    initialize_engine,
    optimizer_step,
    scaled_learning_rate,
)
from learner.logprobs import TokenStats, token_stats
from learner.memory_plan import check_at_start
from learner.micro_batches import MicroBatchPlanner
from learner.modeling import LayerCompiler, ValueModel
from learner.objective import Objective
from learner.off_policy import behavior_correction, micro_off_policy_inputs, record_logprob_gap
from learner.packing import model_inputs
from learner.sft import SupervisedMixin
from learner.step_metrics import (
    Deferred,
    StepAccumulator,
    StepMetrics,
    scalar,
    step_metrics,
    turn_advantages,
)

_ALGORITHM_ADAPTER: TypeAdapter = TypeAdapter(AlgorithmConfig)

logger = logging.getLogger(__name__)


def _pad_columns(x: Tensor, width: int) -> Tensor:
    """Right-pad a [b, t] tensor with zeros to [b, width]."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


class Learner(CheckpointMixin, SupervisedMixin):
    """Policy + critic + reference under DeepSpeed, trained with the ST-PPO family.

    Args:
        model_path: HF folder (weights + tokenizer) the policy, critic backbone and
            reference start from.
        config: the learner section (ZeRO stage, dtype, lrs, batch sizes, epochs).
        algorithm: one of the eight variants (``learner.config.AlgorithmConfig``); switchable
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
        actors.hardware.GPUUnavailableError: GPUs given to this process that torch cannot
            use (a CPU torch, or a driver older than torch's CUDA).
        learner.memory_plan.MemoryPlanError: on CUDA, the model states cannot fit in
            ``gpu_memory_fraction`` of the device (checked before anything is allocated).

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
        check_visible_gpus("a learner rank")  # GPUs given and unusable: no quiet CPU run
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
        if torch.cuda.is_available():  # fail before allocating what cannot fit
            check_at_start(
                self.model_path, zero_stage=config.zero_stage, ranks=self.world_size,
                bf16=config.dtype == "bf16", rank=self.rank,
                device_bytes=int(torch.cuda.mem_get_info()[1] * config.gpu_memory_fraction),
                offload_optimizer=config.offload_optimizer, offload_params=config.offload_params,
            )  # fmt: skip
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
        self.policy_engine = initialize_engine(deepspeed, policy, config.actor_lr, config)
        self.critic_engine = initialize_engine(deepspeed, critic, config.critic_lr, config)
        self.reference_engine, *_ = deepspeed.initialize(
            model=reference, config=deepspeed_config(config, 0.0, with_optimizer=False)
        )
        self.device = self.policy_engine.device
        self.micro_batches = MicroBatchPlanner(
            lambda: self.config, self.rank, self.world_size, self.device
        )
        self.micro_batches.auto_micro_batch_tokens = self.micro_batches.initial_budget(
            [self.policy_engine, self.critic_engine]
        )
        self.clip_bias = ClipBiasPrePass(
            self.policy_engine,
            lambda micro: self._logprobs(self.policy_engine, micro),
            self.device,
            self.world_size,
            temperature,
        )

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
        objective = Objective.from_config(self.algorithm)
        selection = select_trainable(trajectories, group_relative=objective.critic is None)
        batch = collate_trajectories(selection.kept, self.pad_token_id)
        staleness = [self.policy_version - int(v) for v in batch.policy_version_min]
        acc = StepAccumulator()
        self._prepare(batch, objective, acc)
        self._optimize(batch, objective, acc)
        self.global_step += 1
        self.policy_version += 1
        self.micro_batches.settle()
        step_s = time.perf_counter() - start
        metrics = step_metrics(
            batch, objective, selection, acc, staleness, step_s,
            policy_version=self.policy_version, global_step=self.global_step,
            nonfinite_steps_total=self.nonfinite_steps_total, ppo_epochs=self.config.ppo_epochs,
        )  # fmt: skip
        metrics.turn_advantages = turn_advantages(trajectories, selection.kept, batch)
        return metrics

    # ------------------------------------------------------------------ prepare (no grad)

    @torch.no_grad()
    def _prepare(self, batch: TrainingBatch, objective: Objective, acc: StepAccumulator) -> None:
        """The no-grad pass over the whole batch: reference log-probs, the critic's old
        values, the proximal log-probs and behaviour weights (``proximal = recompute``),
        then the advantages (:func:`learner.advantages.compute_advantages`)."""
        width = batch.response_ids.shape[1]
        decoupled = objective.decoupled
        recompute = decoupled is not None and decoupled.proximal == "recompute"
        on_device: dict[str, list[Tensor]] = defaultdict(list)
        kept_rows: list[int] = []
        for rows, real in self.micro_batches.plan(batch, range(batch.batch_size)):
            micro = batch.select(rows).to(self.device)
            computed = {"ref": self._logprobs(self.reference_engine, micro)}
            if objective.critic is not None:
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
            batch.proximal_logprobs = stacked("proximal")
            batch.behavior_weights, metrics = behavior_correction(
                batch, batch.proximal_logprobs, decoupled
            )
            acc.behavior = {name: scalar(value) for name, value in metrics.items()}
            record_logprob_gap(batch, batch.proximal_logprobs, acc, self.policy_version)
            acc.gap_replicated = True  # the whole batch, identical on every rank
        elif decoupled is not None:  # loglinear: approximated per micro-batch in the loss
            batch.proximal_logprobs = None
        else:  # the behaviour objective: the behaviour policy is the proximal one
            batch.proximal_logprobs = batch.behavior_logprobs
        if objective.critic is not None:
            batch.old_values = stacked("values") * batch.loss_mask
        compute_advantages(batch, objective)

    def _logprobs(self, engine: Any, micro: TrainingBatch) -> Tensor:
        """float32 [b, T] log-probs of ``micro``'s response tokens under ``engine``, 0 off
        the policy tokens."""
        return self._token_stats(engine, micro).logprobs * micro.loss_mask

    def _token_stats(
        self, engine: Any, micro: TrainingBatch, *, with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> TokenStats:  # fmt: skip
        """Per-token log-probs (and entropy) of ``micro``'s response under ``engine``, as
        the config says (:func:`learner.logprobs.token_stats`)."""
        return token_stats(
            engine, micro, chunk_tokens=self.config.logprob_chunk_tokens,
            temperature=self.temperature, packed=self.config.pack_sequences,
            varlen=self._varlen, with_entropy=with_entropy, entropy_grad=entropy_grad,
        )  # fmt: skip

    def _values(self, micro: TrainingBatch) -> Tensor:
        """float32 [b, T] critic values of ``micro``'s response tokens (packed or padded as
        ``config.pack_sequences`` says)."""
        inputs = model_inputs(micro, self.config.pack_sequences, self._varlen)
        return self.critic_engine(**inputs.forward_kwargs(), state_index=inputs.state_index)

    # ------------------------------------------------------------------ optimise

    def _optimize(self, batch: TrainingBatch, objective: Objective, acc: StepAccumulator) -> None:
        """``ppo_epochs`` shuffled passes of mini-batches, one optimizer step each."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.global_step)
        mini_batches = -(-batch.batch_size // self.config.mini_batch_size)
        acc.updates_per_version = mini_batches * self.config.ppo_epochs
        for epoch in range(self.config.ppo_epochs):
            order = torch.randperm(batch.batch_size, generator=generator)
            for start in range(0, batch.batch_size, self.config.mini_batch_size):
                rows = order[start : start + self.config.mini_batch_size]
                on_policy = epoch == 0 and start == 0
                self._train_mini_batch(batch.select(rows), objective, acc, on_policy)
        acc.reduce(self.world_size)

    @staticmethod
    def _agg_denominator(mini: TrainingBatch, objective: Objective) -> float:
        """The mini-batch's aggregation denominator: policy tokens (``token-mean``) or
        trajectories with one (``seq-mean-token-mean``)."""
        per_sequence = mini.loss_mask.sum(dim=1)
        if objective.loss.loss_agg_mode == "token-mean":
            return float(per_sequence.sum())
        return float((per_sequence > 0).sum())

    def _train_mini_batch(
        self, mini: TrainingBatch, objective: Objective, acc: StepAccumulator, on_policy: bool
    ) -> None:
        """One optimizer step: micro-batch backwards, one ``||C||`` and one ``s``, the step.

        ``||C||`` is the norm over the whole mini-batch: the micro-batches share its
        aggregation denominator, so their closed-form (``logprob``) squared norms add up to
        it, and ``param`` gradients are summed as vectors before the norm. Where ``s`` must
        be known before the first backward (``scale_target = loss``, or ``bias_norm =
        param``), a pre-pass over the micro-batches measures it first.
        """
        denominator = self._agg_denominator(mini, objective)
        bias, critic_on = objective.clip_bias, objective.critic is not None
        plan = self.micro_batches.plan(mini, range(mini.batch_size))
        norm: Tensor | None = None
        scale = 1.0
        if bias is not None and bias.needs_pre_pass:
            norm, any_clipped = self.clip_bias.measure(
                mini, plan, objective, denominator, acc, self.policy_version
            )
            scale = bias_scale(norm, any_clipped, bias)
        loss_scale = scale if norm is not None and bias.scale_target == "loss" else 1.0
        # the micro-batches' metrics stay on the device until all their backwards are
        # queued, then are read at once (DeferredReads: no host sync per micro-batch)
        queued: list[tuple[bool, Deferred, Deferred | None]] = []
        for index, (rows, real) in enumerate(plan):
            micro = mini.select(rows).to(self.device)
            # DeepSpeed averages gradients over ranks; the global denominators make the
            # wanted gradient their sum. Padding micro-batches contribute nothing.
            weight = float(self.world_size) if real else 0.0
            with self.micro_batches.probed("policy", micro, accumulating=index > 0):
                policy = self._policy_backward(
                    micro, objective, denominator, on_policy and real, acc, loss_scale, weight
                )
            critic = None
            if critic_on:
                with self.micro_batches.probed("critic", micro, accumulating=index > 0):
                    critic = self._critic_backward(micro, objective, denominator, weight)
            critic_read = None if critic is None else acc.reads.defer(critic)
            queued.append((real, acc.reads.defer(policy), critic_read))
        acc.reads.flush()
        sums, policy_finite, critic_finite, micro_clipped = acc.add_mini_batch(queued)
        summed_norm_sq = sums.pop("clip_bias_norm_sq", 0.0)
        if norm is None:  # no pre-pass: the micro-batches' squared norms add up (all ranks)
            summed_norm_sq, clipped = all_reduce_floats(
                [summed_norm_sq, float(micro_clipped)], self.world_size, "sum"
            )
            norm = torch.tensor(math.sqrt(max(summed_norm_sq, 0.0)))
            if bias is not None:
                scale = bias_scale(norm, clipped > 0.0, bias)
        sums["clip_bias_norm"] = scalar(norm)
        sums["clip_bias_scale"] = scale
        for name in ("pg_loss", "value_loss", "clip_bias_norm", "clip_bias_scale"):
            if name in sums or name == "pg_loss" or critic_on:
                acc.mini[name].append(sums.get(name, 0.0))
        warmup = self.lr_warmup_factor()
        by_update = bias is not None and bias.scale_target == "update"
        lr_scale = warmup * (scale if by_update else 1.0)
        with scaled_learning_rate(self.policy_engine.optimizer, lr_scale):
            applied, grad_norm = self._optimizer_step(self.policy_engine, policy_finite)
        acc.optimizer_steps += 1
        if applied:
            acc.grad_norms.append(grad_norm)
        else:
            acc.skipped += 1
            self.nonfinite_steps_total += 1
        if critic_on:
            with scaled_learning_rate(self.critic_engine.optimizer, warmup):
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

    def _policy_backward(
        self,
        micro: TrainingBatch,
        objective: Objective,
        denominator: float,
        on_policy: bool,
        acc: StepAccumulator,
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
            entropy_grad=objective.entropy_coef > 0.0,
        )
        logprobs, entropy = stats.logprobs, stats.entropy
        del stats
        mask = micro.loss_mask
        if on_policy and (objective.decoupled is None or micro.proximal_logprobs is None):
            record_logprob_gap(micro, logprobs.detach(), acc, self.policy_version)
        proximal_logprobs, behavior_weights = micro_off_policy_inputs(
            micro,
            logprobs.detach(),
            objective.decoupled,
            acc,
            self.policy_version,
            record=weight != 0.0,
        )
        out = losses.compute_policy_loss(
            logprobs,
            proximal_logprobs,
            micro.advantages,
            mask,
            micro.turn_ids,
            agg_denominator=denominator,
            behavior_weights=behavior_weights,
            **objective.loss.kwargs(),
        )
        weights = losses.aggregation_weights(
            mask, loss_agg_mode=objective.loss.loss_agg_mode, agg_denominator=denominator
        )
        kl_ref = losses.kl_penalty(logprobs, micro.ref_logprobs, objective.kl_estimator)
        loss = loss_scale * out.loss
        if objective.kl_mode == "loss" and objective.kl_coef > 0.0:
            loss = loss + objective.kl_coef * (weights * kl_ref).sum()
        if objective.entropy_coef > 0.0:
            loss = loss - objective.entropy_coef * (weights * entropy).sum()
        backward(self.policy_engine, loss * weight if weight != 1.0 else loss, logprobs)
        with torch.no_grad():
            metrics = dict(out.metrics)
            metrics["kl_ref"] = losses.masked_mean(kl_ref.detach(), mask)
            metrics["entropy"] = losses.masked_mean(entropy.detach(), mask)
            metrics["loss"] = loss.detach()
            metrics["num_tokens"] = mask.sum()
        for name in ("clip_bias_norm", "clip_bias_scale"):  # per optimizer step, not micro
            metrics.pop(name)
        return metrics

    def _critic_backward(
        self, micro: TrainingBatch, objective: Objective, denominator: float, weight: float = 1.0
    ) -> dict[str, Tensor]:
        """Forward, value loss and backward of one critic micro-batch; its metrics as 0-dim
        tensors on the device, as :meth:`_policy_backward`."""
        values = self._values(micro)
        out = losses.compute_value_loss(
            values,
            micro.old_values,
            micro.returns,
            micro.loss_mask,
            value_clip=objective.critic.value_clip,
            loss_agg_mode=objective.loss.loss_agg_mode,
            agg_denominator=denominator,
        )
        loss = objective.critic.value_loss_coef * out.loss
        backward(self.critic_engine, loss * weight if weight != 1.0 else loss, values)
        return {**out.metrics, "loss": loss.detach()}

    def _optimizer_step(self, engine: Any, loss_finite: bool) -> tuple[bool, float]:
        """Step ``engine`` unless its gradients are non-finite; (applied, pre-clip norm)
        (:func:`learner.engines.optimizer_step`)."""
        return optimizer_step(
            engine, loss_finite, self.world_size, lambda: self.micro_batches.step(engine)
        )
