"""The seams the loop calls across: what it needs of the learner group, a rollout actor
and the question sampler, as Protocols.

Ray actor handles are typed by their methods' ``.remote``: :class:`Remote` stands for one
such method (its call returns an ``ObjectRef``). The real objects are
:class:`services.learner_group.LearnerGroup`, the Ray handle of
:class:`actors.rollout.RolloutWorker` (:func:`services.ray_actors.create_rollout_actor`) and
:class:`services.sampler.QuestionSampler`; tests pass fakes with the same members. The weight
transports have their own Protocol, :class:`services.weight_sync.WeightSync`.
"""

from __future__ import annotations

from typing import Any, Protocol


class Remote(Protocol):
    """A Ray actor method: ``handle.method.remote(*args)`` returns an ``ObjectRef``."""

    def remote(self, *args: Any, **kwargs: Any) -> Any: ...


class LearnerHandle(Protocol):
    """The learner (one rank or a group) as the loop calls it; every call returns a ref.

    Attributes:
        step: ``step.remote(trajectories)`` -> :class:`learner.step_metrics.StepMetrics`.
        warm_start: ``warm_start.remote(demonstrations, sft_config)`` ->
            :class:`learner.sft.WarmStartReport`.
        set_algorithm, set_lr: live changes (:mod:`services.loop.live_config`).
        save_checkpoint, load_checkpoint: ``.remote(path)``.
        num_ranks: learner ranks.
    """

    num_ranks: int
    step: Remote
    warm_start: Remote
    set_algorithm: Remote
    set_lr: Remote
    save_checkpoint: Remote
    load_checkpoint: Remote

    def shutdown(self) -> None: ...


class RolloutHandle(Protocol):
    """A rollout actor as the loop calls it (:class:`actors.rollout.RolloutWorker`).

    Attributes:
        rollout: ``rollout.remote(records, min_policy_version=..., greedy=...)`` ->
            trajectories.
        metrics_url: the engine's metrics endpoint or None.
    """

    rollout: Remote
    metrics_url: Remote


class TrainingSampler(Protocol):
    """The training questions (:class:`services.sampler.QuestionSampler`): draws are
    numbered, and a resume continues from ``num_drawn``."""

    num_drawn: int

    def sample(self, n: int) -> list[dict[str, Any]]: ...
