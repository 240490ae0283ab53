"""The expected wall time of a CPU run, from this CPU's measured matmul speed.

``stppo train`` prints it before anything starts when the learner runs on the CPU
(``ray.learner_gpus = 0``)::

    expected on this CPU (fp32 matmul 0.14 TFLOP/s): about 7 min 40 s: start-up 1 min,
    warm start 30 s (kept), 2 evaluations 1 min 10 s, 8 RL steps 5 min

A CPU run's phases are compute-bound, so each is estimated as the model FLOPs it does over
the measured matmul throughput times an efficiency measured for that phase (the share of
the matmul speed the phase reaches, below 1: attention, padding, the optimizer, host
work). FLOPs per token, with ``P`` the policy's parameters: a trained model 6 P, a forward
2 P (Kaplan et al., 2020, "Scaling Laws for Neural Language Models", sec. 2.1). A learner
step trains the policy (6 P), the critic where the variant has one (6 P), and runs the
reference's forward (2 P) and, with ``off_policy = "decoupled"`` and a recomputed
proximal policy, one more policy forward (2 P); the SFT step trains the policy only.
Rollouts and evaluations decode, 2 P per token, at their own (lower) efficiency.

The efficiencies and the trajectory length were measured on the laptop demo
(``deploy/configs/cpu_demo.toml``) on a 2-core AMD EPYC, in bf16 (avx512_bf16) and in fp32
as an AVX2-only CPU runs it; the estimate is a plan, not a promise: expect +-30% on other
CPUs and configs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.config import RunConfig

PROMPT_TOKENS = 150
"""Mean prompt tokens of the built-in QA sets under the default system prompt (measured:
139-225)."""

RESPONSE_FILL = 0.55
"""Mean response length as a share of its bound, ``min(rollout.max_response_tokens,
max_turns * (max_new_tokens_per_turn + max_information_tokens))`` (measured on the demo:
280 of 512)."""

EVAL_RESPONSE_FILL = 0.45
"""The same for greedy evaluation episodes (fewer searches than sampled ones)."""


@dataclass(frozen=True)
class Efficiency:
    """Shares of the measured matmul speed each kind of work reaches in one dtype.

    Attributes:
        learner: an RL learner step, against the FLOPs of :func:`trajectory_tokens` (the
            objective, ZeRO-2, one rank).
        sft: a warm-start (SFT) step.
        decode: vLLM decoding an evaluation or a rollout batch.
    """

    learner: float
    sft: float
    decode: float


EFFICIENCY = {
    "bf16": Efficiency(learner=0.35, sft=0.32, decode=0.13),
    "fp32": Efficiency(learner=0.6, sft=0.4, decode=0.24),
}
"""Per resolved dtype, measured on the demo (2-core AMD EPYC; bf16 with avx512_bf16 at 0.42
TFLOP/s, fp32 as an AVX2-only CPU runs it at 0.14): an ST-PPO step 66 s in bf16 and 115 s
in fp32 (``benchmarks/learner_step.py``), an SO-GRPO step about 40 s in fp32; an SFT step
21 s in bf16, 45-55 s in fp32; 48 evaluation questions 54 s in bf16, 90 s in fp32. bf16
reaches a smaller share: only the matmuls get faster, the rest of a step does not."""

STARTUP_S = 50.0
"""Retrieval server, Ray, the vLLM engine and the learner's models loaded (measured 46-50 s
on the demo, the same on both dtypes)."""

WARM_START_LOAD_S = 30.0
"""Loading a kept warm start into the learner and syncing it to the engines."""

DEMONSTRATION_S = 0.05
"""Building one SFT demonstration (retrieval and the template, no model; measured 48 in
1.7 s)."""

MATMUL_SHAPE = (4096, 576, 1536)
"""(m, k, n) of the timed matmul: a micro-batch of 4,096 tokens through SmolLM2-135M's
MLP (``benchmarks/learner_step.py`` times the same: 2-core AMD EPYC, 0.42 TFLOP/s in bf16
with avx512_bf16, 0.14 in fp32 as an AVX2 CPU runs it)."""


@dataclass(frozen=True)
class Phase:
    """One phase of a run and its expected wall time (seconds)."""

    name: str
    seconds: float
    note: str = ""


def matmul_tflops(dtype: str, threads: int, seconds: float = 0.3) -> float:
    """Measured matmul throughput of this CPU (TFLOP/s) in ``dtype`` (``"bf16"`` or
    ``"fp32"``) on ``threads`` torch threads (0: torch's default), timed over about
    ``seconds`` after one warm-up call."""
    import torch

    previous = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        m, k, n = MATMUL_SHAPE
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        a, b = torch.randn(m, k, dtype=torch_dtype), torch.randn(k, n, dtype=torch_dtype)
        a @ b
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or calls < 3:
            a @ b
            calls += 1
        return 2 * m * k * n * calls / elapsed / 1e12
    finally:
        torch.set_num_threads(previous)


def trajectory_tokens(cfg: RunConfig, fill: float = RESPONSE_FILL) -> float:
    """Expected tokens of one trajectory (prompt and response, the policy's and the
    environment's)."""
    r = cfg.rollout
    bound = min(
        r.max_response_tokens, r.max_turns * (r.max_new_tokens_per_turn + r.max_information_tokens)
    )
    return PROMPT_TOKENS + fill * bound


def evaluations(cfg: RunConfig) -> int:
    """Evaluations the run does (greedy, and the sampled repeats with ``run.eval_sampled``
    counted at their ``rollout.group_size`` episodes per question)."""
    run = cfg.run
    if run.eval_questions == 0:
        return 0
    count = 2 + (run.num_steps - 1) // run.eval_every if run.eval_every else 2
    if run.eval_before_warm_start and cfg.sft.enabled:
        count += 1
    return count * (1 + (cfg.rollout.group_size if run.eval_sampled else 0))


def expected_phases(
    cfg: RunConfig, params: int, tflops: float, warm_start_kept: bool, dtype: str = "fp32"
) -> list[Phase]:
    """The run's phases and their expected seconds (module docstring).

    Args:
        cfg: the run config.
        params: the policy's parameters (``P``).
        tflops: the measured matmul speed (TFLOP/s, :func:`matmul_tflops`).
        warm_start_kept: a kept warm start will be loaded instead of trained.
        dtype: the learner's and engines' resolved dtype (``"bf16"`` or ``"fp32"``).
    """
    from learner.config import uses_critic

    flops, eff = tflops * 1e12, EFFICIENCY[dtype]
    learner, algorithm = cfg.learner, cfg.algorithm
    phases = [Phase("start-up", STARTUP_S)]
    if cfg.sft.enabled:
        if warm_start_kept:
            phases.append(Phase("warm start", WARM_START_LOAD_S, "kept"))
        else:
            sft = cfg.sft
            steps = math.ceil(sft.num_demonstrations / sft.batch_size) * sft.epochs
            step_s = 6 * params * sft.batch_size * trajectory_tokens(cfg) / (flops * eff.sft)
            build_s = DEMONSTRATION_S * sft.num_demonstrations
            phases.append(Phase("warm start", build_s + steps * step_s, f"{steps} SFT steps"))
    count = evaluations(cfg)
    if count:
        episode = trajectory_tokens(cfg, EVAL_RESPONSE_FILL) - PROMPT_TOKENS
        decode_s = 2 * params * episode * cfg.run.eval_questions / (flops * eff.decode)
        phases.append(Phase(f"{count} evaluation(s)", count * decode_s))
    if cfg.run.num_steps:
        per_token = 6 + (6 if uses_critic(algorithm) else 0) + 2
        if getattr(algorithm, "off_policy", "") == "decoupled":
            per_token += 0 if getattr(algorithm, "proximal", "") == "loglinear" else 2
        batch = learner.train_batch_size * learner.ppo_epochs
        learner_s = per_token * params * batch * trajectory_tokens(cfg) / (flops * eff.learner)
        episode = trajectory_tokens(cfg) - PROMPT_TOKENS
        rollout_s = 2 * params * learner.train_batch_size * episode / (flops * eff.decode)
        # with a staleness bound the next batch is generated during the learner step
        step_s = (
            max(learner_s, rollout_s) if cfg.buffer.max_staleness > 0 else learner_s + rollout_s
        )
        phases.append(Phase(f"{cfg.run.num_steps} RL step(s)", cfg.run.num_steps * step_s))
    return phases


def fmt_minutes(seconds: float) -> str:
    """``"7 min 40 s"``, ``"45 s"`` (rounded to 5 s above a minute)."""
    if seconds < 60:
        return f"{round(seconds)} s"
    seconds = 5 * round(seconds / 5)
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


def render(phases: list[Phase], dtype: str, tflops: float) -> str:
    """The line ``stppo train`` prints (module docstring)."""
    total = sum(p.seconds for p in phases)
    parts = ", ".join(
        f"{p.name} {fmt_minutes(p.seconds)}" + (f" ({p.note})" if p.note else "") for p in phases
    )
    return (
        f"expected on this CPU ({dtype} matmul {tflops:.2f} TFLOP/s): "
        f"about {fmt_minutes(total)}: {parts}"
    )
