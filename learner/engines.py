"""The DeepSpeed engines of the learner: their config, construction, backward and step.

Everything here is DeepSpeed plumbing the ST-PPO step does not need to know about: the
config dict of an engine (:func:`deepspeed_config`), AdamW fused or DeepSpeed's
(:func:`initialize_engine`), a backward that cannot lose a non-finite loss
(:func:`backward`), and an optimizer step that skips non-finite gradients and reports the
pre-clip gradient norm (:func:`optimizer_step`).

Non-finite guard: a micro-batch whose loss is NaN/inf poisons that engine's gradients with
NaN, so DeepSpeed's overflow check (ZeRO >= 1, or bf16) skips the optimizer step and clears
them; fp32 ZeRO-0 has no such check, so :func:`optimizer_step` checks the gradient norm
itself and zeroes instead of stepping. Weights never become NaN.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from actors.hardware import resolve_dtype
from learner.config import LearnerConfig
from learner.distributed import all_reduce_floats
from learner.step_metrics import scalar


@contextlib.contextmanager
def scaled_learning_rate(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
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
            :func:`initialize_engine`, :func:`use_fused_adamw`): no ``optimizer`` section.
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
    pin = torch.cuda.is_available()  # page-locked host buffers make the copies faster
    if not with_optimizer:
        if config.zero_stage == 3:  # the frozen reference is sharded like the policy
            ds["zero_optimization"] = {"stage": 3}
            if config.offload_params:
                ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
            ds["bf16"] = {"enabled": bf16}
            return ds
        ds["zero_optimization"] = {"stage": 0}
        ds["bf16"] = {"enabled": False}  # weights are already bf16; no optimizer wrapper
        return ds
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if config.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    ds.update(
        {
            "managed_gradient_accumulation": False,
            "gradient_clipping": config.max_grad_norm,
            "zero_optimization": zero,
        }
    )
    if not client_optimizer:
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": lr, "weight_decay": config.weight_decay, "torch_adam": True},
        }
    return ds


def use_fused_adamw(config: LearnerConfig) -> bool:
    """``config.fused_adamw``, None resolved: fused on CUDA, DeepSpeed's foreach elsewhere
    and wherever the optimizer is offloaded (its step runs on the host)."""
    if config.fused_adamw is None:
        return torch.cuda.is_available() and not config.offload_optimizer
    return config.fused_adamw


def initialize_engine(
    deepspeed: Any, model: torch.nn.Module, lr: float, config: LearnerConfig
) -> Any:
    """A DeepSpeed engine with AdamW for ``model``: fused (built here, on the model's
    training device) or DeepSpeed's ``torch_adam`` (:func:`use_fused_adamw`)."""
    fused = use_fused_adamw(config)
    optimizer = None
    if fused:
        if torch.cuda.is_available():
            model.to(torch.device("cuda", torch.cuda.current_device()))
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=lr,
            weight_decay=config.weight_decay,
            fused=True,
        )
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=None if fused else [p for p in model.parameters() if p.requires_grad],
        optimizer=optimizer,
        config=deepspeed_config(config, lr, with_optimizer=True, client_optimizer=fused),
    )
    return engine


def backward(engine: Any, loss: Tensor, output: Tensor) -> None:
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


def optimizer_step(
    engine: Any, loss_finite: bool, world_size: int, run_step: Callable[[], None]
) -> tuple[bool, float]:
    """Step ``engine`` unless its gradients are non-finite; returns (applied, the pre-clip
    gradient norm).

    Args:
        engine: a DeepSpeed engine with its gradients accumulated.
        loss_finite: every micro-batch's loss was finite (host-side, after their reads).
        world_size: learner ranks; with fp32 ZeRO-0 on several they agree before stepping.
        run_step: runs ``engine.step()`` under ZeRO or bf16, where DeepSpeed's overflow
            check decides (the micro-batch planner measures the first step's memory there).
    """
    if not (engine.zero_optimization() or engine.bfloat16_enabled()):
        # fp32 ZeRO-0: a plain torch optimizer, which would write NaN weights.
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        norm = scalar(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        if world_size > 1:  # gradients are reduced inside step(): agree first
            (bad,) = all_reduce_floats(
                [float(not (loss_finite and math.isfinite(norm)))], world_size, "max"
            )
            if bad > 0.0:
                engine.zero_grad()
                return False, float("nan")
            return True, fp32_zero0_step(engine)
        if not (loss_finite and math.isfinite(norm)):
            engine.zero_grad()
            return False, norm
        engine.step()
        return True, norm
    run_step()
    return bool(engine.was_step_applied()), scalar(engine.get_global_grad_norm())


def fp32_zero0_step(engine: Any) -> float:
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
        norms.append(scalar(norm))

    engine.clip_fp32_gradients = clip
    try:
        engine.step()
    finally:
        del engine.clip_fp32_gradients
    return norms[0] if norms else float("nan")
