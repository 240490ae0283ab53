"""The loop's parts, built once the services run: :func:`build_parts` creates the learner
group and the rollout actors and wires the parts of :mod:`services.loop` to them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ray

from services.config import RunConfig
from services.control import ControlState
from services.loop.bootstrap import Services
from services.loop.fleet import Fleet
from services.loop.live_config import Targets
from services.loop.phases import Phases
from services.loop.pipeline import Pipeline
from services.loop.report import Report
from services.loop.seams import LearnerHandle, TrainingSampler
from services.loop.sync import SyncCoordinator


@dataclass
class Parts:
    """The handles and parts a driver routes between."""

    report: Report
    learner: LearnerHandle  # services.learner_group.LearnerGroup
    sampler: TrainingSampler  # services.sampler.QuestionSampler
    fleet: Fleet
    sync: SyncCoordinator
    pipeline: Pipeline
    phases: Phases
    targets: Targets


def check_rollout_capacity(cfg: RunConfig, control: ControlState) -> None:
    """Set the control plane's cap on ``rollout.num_actors`` (``ray.max_rollout_actors``,
    else what the cluster's resources hold) and check the start value.

    Raises:
        services.config.ConfigError: ``rollout.num_actors`` exceeds the cap (actors would
            stay pending forever).
    """
    from services.ray_actors import rollout_actor_capacity

    if cfg.ray.max_rollout_actors is not None:
        cap, why = cfg.ray.max_rollout_actors, "ray.max_rollout_actors"
    else:
        cap, why = rollout_actor_capacity(cfg, ray.cluster_resources())
    control.max_rollout_actors, control.capacity_reason = cap, why
    control.check_rollout_actors(cfg.rollout.num_actors)


def build_parts(
    config: Callable[[], RunConfig], control: ControlState, services: Services
) -> Parts:
    """Create the learner group and ``rollout.num_actors`` rollout actors, and
    the parts around them; every part reads the live config through ``config``."""
    from services.learner_group import create_learner_group
    from services.ray_actors import create_rollout_actor
    from services.sampler import QuestionSampler
    from services.weight_sync import make_weight_sync

    cfg, s = config(), services
    report = Report(s.records, s.metrics, s.progress, s.tracker, control, cfg.run)
    report.live_config(cfg)
    learner = create_learner_group(cfg, say=s.progress.say)
    s.closers.append(learner.shutdown)
    fleet = Fleet(cfg, lambda i: create_rollout_actor(config(), s.retrieval_url, i))
    weight_sync = make_weight_sync(
        cfg.sync.transport, backend="nccl" if cfg.ray.learner_gpus > 0 else "gloo",
        timeout_s=cfg.sync.collective_timeout_s, join_timeout_s=cfg.sync.join_timeout_s,
        say=s.progress.say, bucket_bytes=cfg.sync.bucket_mb << 20,
    )  # fmt: skip
    sync = SyncCoordinator(
        config, fleet, learner, weight_sync, s.progress.say, s.metrics.observe_weight_sync
    )
    sampler = QuestionSampler.from_data(cfg.data, "train", cfg.run.seed, side="rl")
    pipeline = Pipeline(config, fleet, learner, sampler)
    phases = Phases(config, fleet, sync, learner, s.retrieval_url, report)
    check_rollout_capacity(cfg, control)
    fleet.resize(cfg.rollout.num_actors)
    report.say(f"{len(fleet.slots)} rollout actor(s), {learner.num_ranks} learner rank(s)")
    report.say("rollout actors on " + ", ".join(fleet.describe()))
    if cfg.rollout.engine_metrics_port is not None:
        urls = ray.get([slot.handle.metrics_url.remote() for slot in fleet.slots])
        for slot, url in zip(fleet.slots, urls, strict=True):
            report.say(f"rollout actor {slot.index} engine metrics: {url or 'none'}")
    targets = Targets(pipeline.buffer, learner, fleet, ray.get)
    return Parts(report, learner, sampler, fleet, sync, pipeline, phases, targets)
