"""Warm-start SFT: teach the policy the search-agent tool format before RL.

Token-mean cross-entropy on the policy tokens of demonstrations
(:mod:`actors.demonstrations`: the rollout's own prompt and turn layout, the real retrieval
server's passages), so the learned format is exactly the one the rollout parses; the
mask selects what is trained. :func:`run_warm_start` runs the passes;
:class:`SupervisedMixin` is the learner's side (one SFT optimizer step).

Source of the format: Search-R1 (Jin et al., 2025); the warm start itself is our choice (a
135M model does not follow the tool format zero-shot).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel
from torch import Tensor

from actors.trajectory import Trajectory
from learner.batch import collate_trajectories
from learner.config import SFTConfig
from learner.distributed import all_reduce_floats
from learner.engines import backward
from learner.step_metrics import SupervisedStepMetrics, read_scalars


@dataclass
class WarmStartReport:
    """What :func:`run_warm_start` did.

    Attributes:
        losses: token-mean cross-entropy (nats/token) of each optimizer step, in order.
        num_steps: optimizer steps taken (skipped ones included).
        num_skipped: steps skipped by the non-finite guard.
        num_demonstrations: demonstrations trained on.
        wall_s: total seconds.
        policy_version: the learner's version afterwards.
    """

    losses: list[float]
    num_steps: int
    num_skipped: int
    num_demonstrations: int
    wall_s: float
    policy_version: int


def print_progress(step: int, total: int, loss: float, elapsed_s: float) -> None:
    """The warm start's progress line (stdout; a Ray actor's stdout reaches the driver):
    ``[warm start] step 3/12 loss 1.234, 55.0 s/step, ETA 8m15s``."""
    per_step = elapsed_s / step
    eta = round(per_step * (total - step))
    print(
        f"[warm start] step {step}/{total} loss {loss:.3f}, {per_step:.1f} s/step, "
        f"ETA {eta // 60}m{eta % 60:02d}s",
        flush=True,
    )


def run_warm_start(
    learner,
    demonstrations: Sequence[Trajectory],
    config: SFTConfig,
    *,
    seed: int = 0,
    progress: Callable[[int, int, float, float], None] | None = None,
) -> WarmStartReport:
    """Supervised warm start of ``learner``'s policy on demonstrations.

    ``config.epochs`` shuffled passes in batches of ``config.batch_size`` (the last batch of
    a pass may be smaller), one :meth:`learner.trainer.Learner.supervised_step` each, at
    learning rate ``config.lr``; the learner's RL learning rate is restored afterwards.

    ``progress(step, total_steps, loss, elapsed_s)`` is called after every step (e.g.
    :func:`print_progress`).

    Raises:
        ValueError: no demonstrations.
    """
    if not demonstrations:
        raise ValueError("run_warm_start needs at least one demonstration")
    start = time.perf_counter()
    previous_lr = learner.learning_rates()["actor_lr"]
    learner.set_lr(actor_lr=config.lr)
    rng = random.Random(seed)
    total = config.epochs * math.ceil(len(demonstrations) / config.batch_size)
    losses: list[float] = []
    skipped = 0
    try:
        for _ in range(config.epochs):
            order = list(range(len(demonstrations)))
            rng.shuffle(order)
            for i in range(0, len(order), config.batch_size):
                batch = [demonstrations[j] for j in order[i : i + config.batch_size]]
                metrics = learner.supervised_step(batch)
                losses.append(metrics.loss)
                skipped += int(metrics.skipped)
                if progress is not None:
                    progress(len(losses), total, metrics.loss, time.perf_counter() - start)
    finally:
        learner.set_lr(actor_lr=previous_lr)
    return WarmStartReport(
        losses=losses,
        num_steps=len(losses),
        num_skipped=skipped,
        num_demonstrations=len(demonstrations),
        wall_s=time.perf_counter() - start,
        policy_version=learner.policy_version,
    )


class SupervisedMixin:
    """The warm start's side of :class:`learner.trainer.Learner` (split out by
    responsibility, as :mod:`learner.weights` and :mod:`learner.checkpoint`): one SFT
    optimizer step, the warm start over demonstrations, and the reference reset after it.
    It uses the learner's engines, micro-batch plan, token statistics and non-finite
    guard."""

    def supervised_step(self, trajectories: Sequence[Trajectory]) -> SupervisedStepMetrics:
        """One optimizer step of token-mean cross-entropy on policy tokens (warm-start SFT).

        ``loss = -(1/N) sum_t m_t log pi(y_t)`` over the whole batch (N = policy tokens),
        accumulated over micro-batches of ``micro_batch_size``; same non-finite guard as
        :meth:`step`. The critic and reference are untouched. ``policy_version`` increments
        (the weights changed).

        Raises:
            ValueError: empty input or a trajectory that fails validation / has no policy
                token.
        """
        start = time.perf_counter()
        self._set_forward_options()
        batch = collate_trajectories(list(trajectories), self.pad_token_id)
        denominator = float(batch.num_policy_tokens)
        micro_losses: list[Tensor] = []  # read once, after every backward is queued
        for rows, real in self.micro_batches.plan(batch, range(batch.batch_size)):
            micro = batch.select(rows).to(self.device)
            logprobs = self._token_stats(self.policy_engine, micro).logprobs
            loss = -(logprobs * micro.loss_mask).sum() / denominator
            weight = float(self.world_size) if real else 0.0
            backward(self.policy_engine, loss * weight if weight != 1.0 else loss, logprobs)
            if real:
                micro_losses.append(loss.detach())
        values = read_scalars(micro_losses)
        finite = all(math.isfinite(v) for v in values)
        (total,) = all_reduce_floats([sum(values, 0.0)], self.world_size, "sum")
        applied, grad_norm = self._optimizer_step(self.policy_engine, finite)
        if not applied:
            self.nonfinite_steps_total += 1
        self.policy_version += 1
        step_s = time.perf_counter() - start
        return SupervisedStepMetrics(
            loss=total,
            grad_norm=grad_norm,
            num_policy_tokens=batch.num_policy_tokens,
            skipped=not applied,
            policy_version=self.policy_version,
            step_s=step_s,
            tokens_per_s=batch.num_tokens / step_s,
        )

    def warm_start(
        self, demonstrations: Sequence[Trajectory], config: SFTConfig
    ) -> WarmStartReport:
        """Warm-start SFT on demonstrations (:func:`learner.sft.run_warm_start`, seeded with
        the learner's seed); returns its :class:`learner.sft.WarmStartReport`."""
        report = run_warm_start(
            self,
            demonstrations,
            config,
            seed=self.seed,
            progress=print_progress if self.rank == 0 else None,
        )
        if config.reference_from_warm_start:
            self.reset_reference_to_policy()
        return report

    def save_warm_start(self, directory: str) -> None:
        """Keep the learner's state after the warm start for later runs
        (:mod:`services.loop.warm_start_cache`): a learner checkpoint in ``directory``,
        outside the run's own checkpoints (collective: every rank calls it)."""
        self.save_checkpoint(directory)

    def load_warm_start(self, directory: str, algorithm: BaseModel | dict) -> int:
        """Continue from a kept warm start (:meth:`save_warm_start`) with this run's
        ``algorithm`` (the warm start does not depend on it); returns the policy version.

        Raises:
            FileNotFoundError / ValueError: as :meth:`load_checkpoint`."""
        self.load_checkpoint(directory)
        self.set_algorithm(algorithm)
        return self.policy_version

    def reset_reference_to_policy(self) -> None:
        """Copy the current policy weights into the frozen reference (``kl_ref`` is measured
        against these from now on); :meth:`save_checkpoint` then saves the reference too.
        """
        reference = self.reference_engine.module
        # a replicated reference loads the full state on every rank; a ZeRO-3 one on rank 0
        keep = self.rank == 0 or not self._zero3(reference)
        state = self._module_state(self.policy_engine.module, keep=keep)
        self._load_module_state(reference, state)
        self.reference_version = self.policy_version
