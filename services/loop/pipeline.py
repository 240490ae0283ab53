"""Rollouts in, learner steps out: admission, the buffer, the step in flight.

A new rollout is admitted only if all of its output will be consumed within
``buffer.max_staleness``, counting the trajectories buffered and in flight ahead of it
(:func:`learner.admission.may_admit`, AReaL's bound per version): actors never run ahead,
no rollout is generated to be thrown away, and ``max_staleness = 0`` is synchronous PPO
through the same loop. A learner step starts when ``learner.train_batch_size`` trajectories
are ready, none older is still in flight (:func:`learner.admission.may_take`) and the
learner is idle; it takes the oldest ones (stale ones, only after a live lowering of the
bound, are dropped and counted then). :class:`Pipeline` owns the trajectory buffer (in the
driver's process: a trajectory makes two hops, rollout actor -> driver -> learner ranks, the
batch put into the object store once for all ranks), the question sampler's draws for
training and the one learner step in flight; the driver counts what its methods return.

The buffer reads its bound from the live config (:attr:`services.config.RunConfig.buffer_limits`),
the one copy of ``buffer.max_staleness``: a live change applies at the next call. It is not
checkpointed, as before when it was an actor on the driver's node: a resume regenerates
what was buffered or in flight from the sampler's next draws (under a new attempt, so no
trajectory id repeats) and nothing is trained on twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from learner.admission import may_admit, may_take
from learner.buffer import BufferStats, StalenessBuffer, TakeResult
from services.config import RunConfig
from services.loop.fleet import Fleet
from services.loop.seams import LearnerHandle, TrainingSampler


@dataclass
class StepInFlight:
    """The learner step running: its ref, the batch it took, when it started."""

    ref: Any
    take: TakeResult
    started_s: float


class Pipeline:
    """Admission and learner steps (module docstring).

    Args:
        config: the live run config (a callable: live changes replace it).
        fleet: the rollout slots calls are submitted to.
        learner: the learner group handle (``step.remote``).
        sampler: the training questions (:class:`services.sampler.QuestionSampler`).
    """

    def __init__(
        self,
        config: Callable[[], RunConfig],
        fleet: Fleet,
        learner: LearnerHandle,
        sampler: TrainingSampler | None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.buffer = StalenessBuffer(lambda: config().buffer_limits)
        self.learner = learner
        self.sampler = sampler
        self.step: StepInFlight | None = None

    def refs(self) -> list[Any]:
        return [self.step.ref] if self.step is not None else []

    def owns(self, ref: Any) -> bool:
        return self.step is not None and (ref is self.step.ref or ref == self.step.ref)

    def _per_call(self) -> int:
        rollout = self.config().rollout
        return rollout.prompts_per_batch * rollout.group_size

    def admit(self, policy_version: int) -> int:
        """Start a rollout on every actor with a free call whose output will be consumed
        within the bound; returns the trajectories admitted."""
        live = self.config()
        per_call = self._per_call()
        take_version = policy_version + int(self.step is not None)
        # what is already over the bound at the next take will be dropped, not consumed
        unconsumed = self.buffer.ready_counts(take_version)
        for v, c in self.fleet.in_flight_counts(per_call).items():
            unconsumed[v] = unconsumed.get(v, 0) + c
        admitted = 0
        for slot in self.fleet.idle_first():
            if not may_admit(
                unconsumed, slot.engine_version, per_call, take_version,
                live.buffer.max_staleness, live.learner.train_batch_size,
            ):  # fmt: skip
                continue
            first_draw = self.sampler.num_drawn
            self.fleet.submit(slot, self.sampler.sample(live.rollout.prompts_per_batch), first_draw)
            unconsumed[slot.engine_version] = unconsumed.get(slot.engine_version, 0) + per_call
            admitted += per_call
        return admitted

    def accept(
        self, trajectories: list[Any], first_draw: int, attempt: int, rollbacks: int = 0
    ) -> int:
        """Stamp a finished rollout call's trajectory ids (:func:`stamp_ids`) and buffer
        them; returns how many the buffer accepted."""
        group_size = self.config().rollout.group_size
        stamp_ids(trajectories, first_draw, group_size, attempt, rollbacks)
        return self.buffer.put(trajectories)

    def start_step(self, policy_version: int) -> TakeResult | None:
        """Take a batch and start a learner step on it if one may start now (the learner is
        idle, enough ready, none older in flight); returns the take
        (:class:`learner.buffer.TakeResult`: its ``dropped_stale`` are for the driver to
        count) or None.

        Raises:
            RuntimeError: the buffer returned fewer trajectories than it said were ready.
        """
        if self.step is not None:
            return None
        n = self.config().learner.train_batch_size
        ready = self.buffer.ready_counts(policy_version)
        if not may_take(ready, self.fleet.in_flight_counts(self._per_call()), n):
            return None  # too few ready, or an older rollout still runs (oldest first)
        take = self.buffer.take(n, policy_version)
        # nothing else touches the buffer, so n ready means take returns n
        if len(take.trajectories) != n:
            raise RuntimeError(
                f"buffer returned {len(take.trajectories)} trajectories, expected {n}"
            )
        # the learner trains on tokens: the transcripts stay here (for samples.jsonl)
        ref = self.learner.step.remote([t.without_transcript() for t in take.trajectories])
        self.step = StepInFlight(ref, take, time.perf_counter())
        return take

    def finish_step(
        self, expected_version: int, variant: str
    ) -> tuple[dict[str, Any], StepInFlight]:
        """Wait for the step in flight; returns (its metrics as a dict, the step).

        Raises:
            RuntimeError: no step in flight, or the learner ended at another version than
                ``expected_version`` or trained another variant than the live config's.
        """
        step, self.step = self.step, None
        if step is None:
            raise RuntimeError("no learner step in flight")
        metrics = ray.get(step.ref).to_dict()
        version = metrics.get("policy_version", expected_version)
        if version != expected_version:
            raise RuntimeError(
                f"learner is at policy_version {version}, driver expected {expected_version}"
            )
        if metrics.get("variant", variant) != variant:
            raise RuntimeError(
                f"learner trained {metrics['variant']} but the live config says {variant}"
            )
        return metrics, step

    def buffer_stats(self) -> BufferStats:
        """The buffer's depth and counters now."""
        return self.buffer.stats()


def stamp_ids(
    trajectories: list[Any], first_draw: int, group_size: int, attempt: int, rollbacks: int = 0
) -> None:
    """Set ``extra["trajectory_id"] = "a<attempt>-d<draw>-g<k>"``: the run's attempt, the
    sampler draw of its question and its index in the group; after the stability guard's
    ``n``-th rollback (which re-issues the draws made after its checkpoint within the
    attempt) ``"a<attempt>r<n>-d<draw>-g<k>"``. Unique across a run, its resumes and its
    rollbacks: within an attempt and rollback the sampler never re-issues a draw, and a
    resume re-issues the draws made after its checkpoint under a new attempt.
    ``RolloutWorker.rollout`` returns ``group_size`` trajectories per record, in record
    order."""
    prefix = f"a{attempt}" if rollbacks == 0 else f"a{attempt}r{rollbacks}"
    for k, t in enumerate(trajectories):
        draw, g = first_draw + k // group_size, k % group_size
        t.extra["trajectory_id"] = f"{prefix}-d{draw}-g{g}"
