"""The clipping-bias norm ``||C||`` of a mini-batch measured before its first backward.

One ``||C||`` and one scale ``s`` per optimizer step (spec section 6), over the whole
mini-batch whatever ``micro_batch_size`` is: micro-batches share the mini-batch's
aggregation denominator, so their closed-form squared norms add up to the mini-batch's.
With ``scale_target = update`` and ``bias_norm = logprob`` the learner sums them during the
backwards at no extra cost and ``s`` scales the step's learning rate. Where ``s`` must be
known before the first backward (``scale_target = loss``, which multiplies the policy
loss, or ``bias_norm = param``) :class:`ClipBiasPrePass` measures it first: a no-grad
forward per micro-batch (``logprob``), or a forward + backward per micro-batch through
detached parameter aliases (``param``: ``torch.autograd.grad`` of
:func:`learner.losses.clip_bias_surrogate`, which leaves DeepSpeed's gradient buffers
alone; the vectors are summed before the norm; ZeRO stage <= 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from learner import losses
from learner.batch import TrainingBatch
from learner.distributed import all_reduce_floats
from learner.modeling import token_logprobs
from learner.objective import ClipBias, Objective
from learner.off_policy import micro_off_policy_inputs
from learner.step_metrics import Deferred, StepAccumulator, scalar


def bias_scale(norm: Tensor, any_clipped: bool, clip_bias: ClipBias) -> float:
    """The clipping-bias scale s of one optimizer step (:func:`losses.clip_bias_scale`)."""
    return scalar(
        losses.clip_bias_scale(
            norm,
            torch.tensor(any_clipped),
            normalize_mode=clip_bias.normalize_mode,
            tau=clip_bias.tau,
            delta=clip_bias.delta,
        )
    )


class ClipBiasPrePass:
    """Measures ``||C||`` of a mini-batch before any backward (module docstring).

    Args:
        policy_engine: the DeepSpeed policy engine (its ``module``'s parameters).
        logprobs: float32 [b, T] policy log-probs of a micro-batch on the device (0 off the
            policy tokens), no grad.
        device: where micro-batches go. world_size: learner ranks (the norm is global).
        temperature: the rollout engines' sampling temperature (logits are divided by it).
    """

    def __init__(
        self,
        policy_engine: Any,
        logprobs: Callable[[TrainingBatch], Tensor],
        device: Any,
        world_size: int,
        temperature: float,
    ) -> None:
        self.policy_engine, self.logprobs, self.device = policy_engine, logprobs, device
        self.world_size, self.temperature = world_size, temperature

    def measure(
        self,
        mini: TrainingBatch,
        plan: list[tuple[list[int], bool]],
        objective: Objective,
        denominator: float,
        acc: StepAccumulator,
        policy_version: int,
    ) -> tuple[Tensor, bool]:
        """(||C|| of the whole mini-batch, whether any token is clipped), before any backward.

        ``logprob``: one no-grad policy forward per micro-batch of ``plan``, closed-form
        squared norms summed. ``param``: one extra forward + backward per micro-batch
        through detached parameter aliases, gradient vectors summed, then the norm. On N
        ranks the squared norms (``logprob``) or the gradient vectors (``param``) and the
        clipped flag are all-reduced, so every rank gets the same global value.
        """
        param = objective.clip_bias is not None and objective.clip_bias.bias_norm == "param"
        norm_sq = torch.zeros((), dtype=torch.float64)
        grad_sum: list[Tensor] | None = None
        any_clipped = False
        parts: list[Deferred] = []  # logprob: read once, after the loop (acc.reads)
        for rows, real in plan:
            if param and not real:
                continue  # ZeRO <= 2: no collective in this forward, nothing to keep in step
            micro = mini.select(rows).to(self.device)
            inputs = (micro.proximal_logprobs, micro.advantages, micro.loss_mask, micro.turn_ids)
            options = {
                **objective.loss.kwargs(),
                "agg_denominator": denominator,
                "behavior_weights": micro.behavior_weights,
            }
            if param:
                grads, clipped = self._param_grad(micro, options)
                grad_sum = (
                    grads
                    if grad_sum is None
                    else [a + b for a, b in zip(grad_sum, grads, strict=True)]
                )
                any_clipped |= clipped
                continue
            with torch.no_grad():
                logprobs = self.logprobs(micro)
                old, options["behavior_weights"] = micro_off_policy_inputs(
                    micro, logprobs, objective.decoupled, acc, policy_version, record=False
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

    def _param_grad(self, micro: TrainingBatch, options: dict) -> tuple[list[Tensor], bool]:
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
        inputs = (micro.proximal_logprobs, micro.advantages, micro.loss_mask, micro.turn_ids)
        surrogate = losses.clip_bias_surrogate(logprobs, *inputs, **options)
        params = list(aliases.values())
        grads = torch.autograd.grad(surrogate, params, allow_unused=True)
        with torch.no_grad():
            clipped = losses.compute_policy_loss(logprobs.detach(), *inputs, **options)
        dense = [
            torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
        ]
        return dense, bool(clipped.metrics["clip_ratio"] > 0)
