"""One function puts a new config into effect: a live change, or the config a resume restores.

The fields that may change while a job runs (:data:`services.control.LIVE_FIELDS`) take
effect in two places besides the driver: the learner (the algorithm and its options,
learning rates) and the rollout actors (their number, ``rollout.interrupt_every_tokens``).
The trajectory buffer reads the staleness bound, stale policy and capacity from the live
config itself; a lowered bound also purges what is already over it, counted here.
:func:`apply_config` pushes what changed
between two configs (everything with ``old = None``: a resume, whose actors were built from
the command line's config) and returns what it did; the driver counts and logs it. Ray-free:
the handles' ``.remote`` calls are awaited through ``wait`` (``ray.get`` in a run, a fake in
tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from learner.buffer import StalenessBuffer
from services.config import RunConfig
from services.control import LIVE_FIELDS, changed_fields
from services.loop.seams import LearnerHandle

if TYPE_CHECKING:  # the fleet imports ray; this part runs without it
    from services.loop.fleet import Fleet


@dataclass
class Targets:
    """Where a config takes effect.

    Attributes:
        buffer: the driver's :class:`learner.buffer.StalenessBuffer` (``purge_stale``).
        learner: the learner group handle.
        fleet: :class:`services.loop.fleet.Fleet` (``slots``, ``resize``, ``set_interrupt``).
        wait: waits for a ``.remote`` call's result (``ray.get``).
    """

    buffer: StalenessBuffer
    learner: LearnerHandle
    fleet: Fleet
    wait: Callable[[Any], Any]


@dataclass
class Applied:
    """What :func:`apply_config` did: the dotted fields that changed, trajectories dropped
    as stale by a lowered bound, and the rollout slots created (they need weights)."""

    fields: list[str]
    purged: int = 0
    new_slots: list[Any] = field(default_factory=list)


def apply_config(
    old: RunConfig | None, new: RunConfig, targets: Targets, policy_version: int
) -> Applied:
    """Put ``new`` into effect where it differs from ``old`` (all of it when ``old`` is None).

    A lowered staleness bound also purges what is already over it at ``policy_version``
    (counted in :attr:`Applied.purged`). On a resume the actors were built from the command
    line's config, so every field is pushed, the interrupt setting included.
    """
    everything = old is None
    fields = sorted(LIVE_FIELDS) if everything else changed_fields(old, new)
    buffer, learner, wait = targets.buffer, targets.learner, targets.wait
    applied = Applied(fields=fields)

    def changed(get: Callable[[RunConfig], Any]) -> bool:
        return everything or get(old) != get(new)

    if not everything and new.buffer.max_staleness < old.buffer.max_staleness:
        applied.purged = buffer.purge_stale(policy_version)  # it reads the bound from new
    if changed(lambda c: c.algorithm):
        wait(learner.set_algorithm.remote(new.algorithm))
    if changed(lambda c: (c.learner.actor_lr, c.learner.critic_lr)):
        wait(learner.set_lr.remote(new.learner.actor_lr, new.learner.critic_lr))
    interrupt = new.rollout.interrupt_every_tokens
    if everything or old.rollout.interrupt_every_tokens != interrupt:
        targets.fleet.set_interrupt(targets.fleet.slots, interrupt)
    if new.rollout.num_actors != len(targets.fleet.slots):
        applied.new_slots = targets.fleet.resize(new.rollout.num_actors)
    return applied


def restore_live_fields(cfg: RunConfig, saved: dict[str, Any]) -> RunConfig:
    """``cfg`` with every :data:`services.control.LIVE_FIELDS` value taken from ``saved`` (a
    checkpoint's ``config.json``): a resumed run continues with the last applied live change.

    Raises:
        services.config.ConfigError: the saved values do not validate with ``cfg``.
    """
    from services.config import update_config

    changes: dict[str, Any] = {}
    for dotted in LIVE_FIELDS:
        *parents, leaf = dotted.split(".")
        node, target = saved, changes
        for p in parents:
            node = node.get(p, {})
            target = target.setdefault(p, {})
        if leaf in node:
            target[leaf] = node[leaf]
    algorithm = changes.get("algorithm")
    if isinstance(algorithm, dict) and algorithm.get("off_policy") == "behavior":
        # a checkpoint of an earlier version dumped the default correction under the
        # behaviour objective, where it did nothing (it may no longer be set there)
        algorithm.pop("rollout_correction", None)
    return update_config(cfg, changes)
