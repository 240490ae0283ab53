"""The rollout fleet: one slot per rollout actor, the calls running on it, crashes, busy time.

A :class:`RolloutSlot` is the driver's view of one Ray rollout actor: the policy version last
pushed to it (weight loads are applied in call order), the rollout calls running on it (up
to ``rollout.calls_per_actor``), whether it is lost (crashed, and not back until Ray has
restarted it and it loaded the weights queued at the crash). :class:`Fleet` owns the slots:
it creates and removes actors, submits calls, hands back a finished call's trajectories,
judges a crash (a restart can help, or the actor is gone for good) and measures how long the
actors were busy. It changes no run counter: the driver does, from what it returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from services.config import RunConfig
from services.loop.seams import RolloutHandle


class RolloutActorLost(RuntimeError):
    """A rollout actor cannot come back: its constructor raised, or its restarts are spent."""


@dataclass
class RunningRollout:
    """One rollout call running on an actor."""

    ref: Any  # ObjectRef of its trajectories
    submitted_version: int  # the actor's engine_version when it was submitted
    started_s: float
    first_draw: int  # sampler draw index of its first question


@dataclass
class RolloutSlot:
    """Driver-side bookkeeping of one rollout actor."""

    handle: RolloutHandle
    index: int
    engine_version: int = -1  # last version pushed (loads are applied in call order)
    running: list[RunningRollout] = field(default_factory=list)  # <= rollout.calls_per_actor
    started_s: float = 0.0  # when its last rollout was submitted
    busy_since: float | None = None  # since when a call has been running (None: idle)
    crashes_in_a_row: int = 0  # crashes since its last completed rollout
    lost: bool = False  # crashed, and not back yet (Ray restarts it where it can be placed)


@dataclass
class FleetWindow:
    """What the fleet did since the last step record: actor-seconds with a call running
    (overlapping calls counted once), the most calls running on one actor, and the duration
    of each completed call."""

    busy_s: float
    calls_running_max: int
    durations_s: list[float]


def first_line_of_cause(error: BaseException) -> str:
    """The last line of a Ray creation-task traceback: the original exception, e.g.
    ``AttributeError: 'RolloutConfig' object has no attribute 'x'``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def lost_weights(trajectories: list[Any], expected_version: int) -> bool:
    """Ray restarted the actor while it was idle, so it came back with the base weights: its
    trajectories carry an older ``policy_version`` than the last one pushed to it."""
    return bool(trajectories) and min(t.policy_version_min for t in trajectories) < expected_version


@dataclass
class RolloutOutcome:
    """What one rollout call gave back (:func:`rollout_outcome`).

    Attributes:
        trajectories: what it returned ([] when the actor died).
        crash: the crash it reveals, for the sync to re-sync the actor and the run to
            count: the actor died (``died``), or Ray restarted it while idle and it
            answered with the base weights (its trajectories are stamped with them). None
            when all is well.
        died: nothing came back; every call running on the actor is lost.
    """

    trajectories: list[Any]
    crash: BaseException | None = None
    died: bool = False


def rollout_outcome(get: Callable[[], list[Any]], expected_version: int) -> RolloutOutcome:
    """Read a rollout call's result with ``get`` and recognise a crash in it: the one place
    where the training loop (:meth:`Fleet.finish`) and the evaluations
    (:meth:`services.loop.phases.Phases.rollout_shards`) tell a dead actor and one that
    lost its weights from a good result; each then decides what to keep (training keeps
    stamped trajectories, to be dropped as stale; an evaluation runs the shard again)."""
    try:
        trajectories = get()
    except ray.exceptions.RayActorError as e:
        return RolloutOutcome([], e, died=True)
    if lost_weights(trajectories, expected_version):
        return RolloutOutcome(trajectories, RuntimeError("engine lost its weights (restarted)"))
    return RolloutOutcome(trajectories)


class Fleet:
    """The rollout actors of a run (module docstring).

    Args:
        cfg: the run config (``rollout.calls_per_actor``, ``ray.max_actor_restarts``).
        create_actor: ``index -> actor handle`` (``services.ray_actors.create_rollout_actor``
            bound to the config and the retrieval URL; a fake in tests).
    """

    def __init__(self, cfg: RunConfig, create_actor: Callable[[int], RolloutHandle]) -> None:
        self.cfg = cfg
        self.create_actor = create_actor
        self.slots: list[RolloutSlot] = []
        self._busy_s = 0.0
        self._calls_running_max = 0
        self._durations_s: list[float] = []

    # ------------------------------------------------------------------ actors

    def resize(self, n: int) -> list[RolloutSlot]:
        """Grow to ``n`` actors (returns the new slots: they need the current weights) or
        shrink (the removed actors are killed, their running calls abandoned)."""
        added = []
        while len(self.slots) < n:
            self.slots.append(RolloutSlot(self.create_actor(len(self.slots)), len(self.slots)))
            added.append(self.slots[-1])
        while len(self.slots) > n:
            ray.kill(self.slots.pop().handle, no_restart=True)
        return added

    def live(self) -> list[RolloutSlot]:
        """The slots that are not lost."""
        return [s for s in self.slots if not s.lost]

    def set_interrupt(self, slots: list[RolloutSlot], every_tokens: int) -> None:
        """Set ``rollout.interrupt_every_tokens`` on ``slots``' actors (from their next
        rollout on), through their weight thread so a running rollout does not delay it."""
        from services.weight_sync import engine_weights_call

        ray.get([
            engine_weights_call(s.handle, "set_interrupt_every_tokens").remote(every_tokens)
            for s in slots if not s.lost
        ])  # fmt: skip

    def describe(self) -> list[str]:
        """``"<index>: <node address>"`` per actor."""
        nodes = ray.get([slot.handle.node_address.remote() for slot in self.slots])
        return [f"{slot.index}: {ip}" for slot, ip in zip(self.slots, nodes, strict=True)]

    # ------------------------------------------------------------------ calls

    def idle_first(self) -> list[RolloutSlot]:
        """Slots that may take another call (not full, weights pushed, not lost), least
        recently started first: when admission lets in fewer rollouts than there are idle
        actors (learner-bound), they take turns, so none sits unused for the whole run."""
        free = [s for s in self.slots if len(s.running) < self.cfg.rollout.calls_per_actor]
        free = [s for s in free if s.engine_version >= 0 and not s.lost]
        return sorted(free, key=lambda s: s.started_s)

    def submit(self, slot: RolloutSlot, records: list[dict[str, Any]], first_draw: int) -> None:
        """Start a rollout of ``records`` on ``slot``: the actor waits for the load of its
        ``engine_version`` to land first, so its oldest token is at least the version
        admission counted it at."""
        ref = slot.handle.rollout.remote(records, min_policy_version=slot.engine_version)
        slot.started_s = time.perf_counter()
        if slot.busy_since is None:
            slot.busy_since = slot.started_s
        slot.running.append(RunningRollout(ref, slot.engine_version, slot.started_s, first_draw))
        self._calls_running_max = max(self._calls_running_max, len(slot.running))

    def refs(self) -> list[Any]:
        """The refs of every running call."""
        return [r.ref for s in self.slots for r in s.running]

    def owner(self, ref: Any) -> tuple[RolloutSlot, RunningRollout] | None:
        """The slot and call whose result ``ref`` is, or None."""
        return next(((s, r) for s in self.slots for r in s.running if r.ref == ref), None)

    def finish(self, slot: RolloutSlot, call: RunningRollout) -> RolloutOutcome:
        """The outcome of a finished call (:func:`rollout_outcome`; its slot is then free
        for another, unless the actor died: the sync's ``on_crash`` takes the crash)."""
        return rollout_outcome(lambda: self._collect(slot, call), call.submitted_version)

    def _collect(self, slot: RolloutSlot, call: RunningRollout) -> list[Any]:
        trajectories = ray.get(call.ref)
        slot.running.remove(call)
        if not slot.running:
            self._end_busy(slot)
        slot.crashes_in_a_row = 0
        self._durations_s.append(time.perf_counter() - call.started_s)
        return trajectories

    def wait_ready(self, slot: RolloutSlot, timeout_s: float = 300.0) -> bool:
        """Block until the actor answers (Ray has restarted it); False if it is dead for good
        or not back within ``timeout_s``. An actor that is restarting answers
        ``ActorUnavailableError`` at once, so it is asked again every second."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(slot.handle.__ray_ready__.remote(), timeout=deadline - time.monotonic())
                return True
            except ray.exceptions.ActorUnavailableError:
                time.sleep(1.0)
            except ray.exceptions.RayError:
                return False
        return False

    def in_flight_counts(self, per_call: int) -> dict[int, int]:
        """version -> trajectories being generated (``per_call`` per running call)."""
        counts: dict[int, int] = {}
        for r in (r for s in self.slots for r in s.running):
            counts[r.submitted_version] = counts.get(r.submitted_version, 0) + per_call
        return counts

    def abandon_running(self) -> None:
        """Forget every running call (the loop ended: never trained on, regenerated on a
        resume)."""
        for slot in self.slots:
            slot.running.clear()
            slot.busy_since = None

    # ------------------------------------------------------------------ crashes

    def on_crash(self, slot: RolloutSlot, error: BaseException) -> None:
        """An actor died mid-call: every call running on it is lost; the caller counts the
        crash and has its weights re-synced once Ray restarts it.

        Raises:
            RolloutActorLost: its constructor raised (a bad engine config, a missing model:
                a restart cannot help), or it crashed more than ``ray.max_actor_restarts``
                + 1 times in a row without completing a rollout (Ray no longer restarts it).
        """
        slot.crashes_in_a_row += 1
        if getattr(error, "actor_init_failed", False):
            raise RolloutActorLost(
                f"rollout actor {slot.index} failed to start: {first_line_of_cause(error)}"
            ) from error
        limit = self.cfg.ray.max_actor_restarts
        if slot.crashes_in_a_row > limit + 1:
            raise RolloutActorLost(
                f"rollout actor {slot.index} crashed {slot.crashes_in_a_row} times in a row "
                f"(ray.max_actor_restarts = {limit}): {error}"
            ) from error
        slot.running.clear()
        self._end_busy(slot)

    # ------------------------------------------------------------------ busy time

    def _end_busy(self, slot: RolloutSlot) -> None:
        """The actor has no call running any more: add its busy interval to the window."""
        if slot.busy_since is not None:
            self._busy_s += time.perf_counter() - slot.busy_since
            slot.busy_since = None

    def take_window(self) -> FleetWindow:
        """What happened since the last call (:class:`FleetWindow`), then start a new window
        (a call still running counts from now on)."""
        now = time.perf_counter()
        busy = self._busy_s + sum(
            now - s.busy_since for s in self.slots if s.busy_since is not None
        )
        window = FleetWindow(busy, self._calls_running_max, self._durations_s)
        self._busy_s, self._durations_s = 0.0, []
        for slot in self.slots:
            if slot.busy_since is not None:
                slot.busy_since = now
        self._calls_running_max = max((len(s.running) for s in self.slots), default=0)
        return window
