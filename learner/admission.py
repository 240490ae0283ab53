"""Staleness-aware admission: start only rollouts whose output will be consumed in bound.

Pure Python, no Ray, no clock: the driver (``services.driver``) calls these two functions
on every loop iteration, and ``tests/unit/learner/test_admission_sim.py`` drives them with simulated
rollout and learner durations.

Notation. ``B`` = ``learner.train_batch_size``, ``s`` = ``buffer.max_staleness``, ``V`` = the
policy version at which the *next* learner step will take its batch (the learner's version,
plus 1 while a step is in flight). Every trajectory carries the version ``e`` of the weights
that generated it; it is consumed in bound iff it is taken at a version ``<= e + s``.
``C(e)`` = trajectories started but not yet consumed (in flight or buffered) with version
``<= e``.

The rule (AReaL's bound, made per version and order-proof):

1. **Consume oldest first.** A learner step takes the ``B`` oldest-version trajectories
   among all unconsumed ones (:func:`may_take` makes it wait while an in-flight rollout is
   strictly older than the ``B``-th oldest ready one).
2. **Admit** ``n`` more trajectories at engine version ``e0`` only if, for every version
   ``e >= e0``, ``C(e) + n <= (e + s + 1 - V) * B`` (:func:`may_admit`).

Why it is exact: the steps at versions ``V .. e+s`` are ``e + s + 1 - V`` steps of ``B``
trajectories each; under rule 1 each of them takes ``min(B, C(e))`` trajectories of version
``<= e``, so ``C(e) <= (e + s + 1 - V) * B`` is kept by every step and ``C(e) = 0`` after
the step at ``e + s``: nothing is ever too stale, and nothing is dropped, whatever the
rollout and learner durations or the order in which rollouts finish. With every engine at
``e = V`` this is AReaL's ``consumed + buffered + in_flight <= (V + s + 1) * B`` (consumed =
``V * B``); it is stricter where engines lag (``sync.every_k_steps > 1``, a step in flight).

Consequences used by the config (:class:`services.config.RunConfig` validates them):
unconsumed trajectories never exceed ``(s + 1) * B``, so ``buffer.capacity`` must be at
least that; one rollout call (``prompts_per_batch * group_size``) must fit in it; and
``sync.every_k_steps <= s + 1`` (otherwise nothing may start until the next sync: deadlock).

Live changes: raising ``s`` or ``B`` or changing the number of actors keeps the invariant;
lowering ``s`` (or ``B``) can leave already-started trajectories over the new bound: the
buffer drops them and counts them, and admission resumes once the invariant holds again.
"""

from __future__ import annotations

from collections.abc import Mapping


def may_admit(
    unconsumed: Mapping[int, int],
    engine_version: int,
    n: int,
    next_take_version: int,
    max_staleness: int,
    batch_size: int,
) -> bool:
    """May ``n`` trajectories generated at ``engine_version`` start now?

    Args:
        unconsumed: version -> count of trajectories started and not yet consumed (in
            flight and buffered; trajectories that will be dropped anyway may be left out).
        engine_version: the weights the new rollout will use.
        n: trajectories the rollout will produce (``prompts_per_batch * group_size``).
        next_take_version: ``V``, the version of the next learner step's take.
        max_staleness: ``s >= 0``.
        batch_size: ``B >= 1``, trajectories per learner step.

    Returns:
        True iff ``C(e) + n <= (e + s + 1 - V) * B`` for every ``e >= engine_version``.

    Raises:
        ValueError: ``n < 1``, ``batch_size < 1`` or ``max_staleness < 0``.
    """
    if n < 1 or batch_size < 1 or max_staleness < 0:
        raise ValueError(f"need n >= 1, batch_size >= 1, max_staleness >= 0; got {n}, "
                         f"{batch_size}, {max_staleness}")  # fmt: skip
    points = sorted({engine_version, *(v for v in unconsumed if v >= engine_version)})
    for e in points:
        c = sum(count for v, count in unconsumed.items() if v <= e)
        if c + n > (e + max_staleness + 1 - next_take_version) * batch_size:
            return False
    return True


def may_take(ready: Mapping[int, int], in_flight: Mapping[int, int], batch_size: int) -> bool:
    """May the learner take its batch now (rule 1: the ``B`` oldest unconsumed)?

    Args:
        ready: version -> count of consumable trajectories in the buffer.
        in_flight: version -> count of trajectories still being generated.
        batch_size: ``B``.

    Returns:
        True iff ``B`` are ready and no in-flight trajectory is strictly older than the
        ``B``-th oldest ready one (so the take is the ``B`` globally oldest, up to ties).
    """
    if sum(ready.values()) < batch_size:
        return False
    seen = 0
    for version in sorted(ready):
        seen += ready[version]
        if seen >= batch_size:
            return not any(count and v < version for v, count in in_flight.items())
    raise AssertionError("unreachable")


def required_capacity(max_staleness: int, batch_size: int) -> int:
    """Most trajectories ever unconsumed under :func:`may_admit`: ``(s + 1) * B``."""
    return (max_staleness + 1) * batch_size
