"""Weights from the learner to the engines: pushes, their acknowledgements, lost engines.

:class:`SyncCoordinator` pushes the learner's weights to every engine that is not lost
(with ``sync.fixed_lag``, the export ``buffer.max_staleness`` versions older:
:mod:`services.lagged_sync`), records which version each slot was given, and handles the
acks as they finish: a load's seconds go to the metrics; an engine that died during a sync
is re-synced when Ray has restarted it (a load queued on it at the crash, which runs first
when it comes back: :meth:`SyncCoordinator.mark_lost`, :meth:`SyncCoordinator._on_revived`);
the survivors of a broken collective broadcast get the weights through the object store at
once (:meth:`SyncCoordinator._resync_after_broken_broadcast`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray

from services.config import RunConfig
from services.loop.fleet import Fleet, RolloutSlot
from services.loop.seams import LearnerHandle
from services.weight_sync import WeightSync

log = logging.getLogger("stppo.driver")


class SyncCoordinator:
    """The weight syncs of a run (module docstring).

    Args:
        config: the live run config (a callable: live changes replace it).
        fleet: the rollout slots (their ``engine_version`` and ``lost`` flags are set here).
        learner: the learner group handle (its weights are exported).
        weight_sync: the transport (:func:`services.weight_sync.make_weight_sync`).
        say: progress lines. on_load_s: the seconds of every completed load (export + load,
            the weight-sync histogram).
    """

    def __init__(
        self,
        config: Callable[[], RunConfig],
        fleet: Fleet,
        learner: LearnerHandle,
        weight_sync: WeightSync,
        say: Callable[[str], None],
        on_load_s: Callable[[float], None] = lambda s: None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.learner = learner
        self.weight_sync = weight_sync
        self.say = say
        self.on_load_s = on_load_s
        self.current: Any = None  # the SyncHandle last pushed
        self.pending: dict[Any, float] = {}  # ack -> export seconds of its sync
        self.revivals: dict[Any, RolloutSlot] = {}  # weight loads queued on lost actors
        self._lagged: Any = None
        self._resynced: Any = None  # the broken sync last re-sent to the survivors

    def refs(self) -> list[Any]:
        """The acks still awaited."""
        return list(self.pending)

    def owns(self, ref: Any) -> bool:
        return ref in self.pending

    def push(self, policy_version: int, blocking: bool, exact: bool = False) -> float:
        """Push the learner's weights (version ``policy_version``) to every engine that is
        not lost (a lost one gets them when Ray has restarted it); returns the export
        seconds. ``blocking``: wait for every load (a crashed actor is re-synced later).
        ``exact``: this very version also under ``sync.fixed_lag`` (which otherwise pushes
        the one ``buffer.max_staleness`` versions older): what the final evaluation needs."""
        cfg = self.config()
        live = self.fleet.live()
        if cfg.sync.fixed_lag:  # engines exactly buffer.max_staleness versions behind
            from services.lagged_sync import LaggedWeightSync

            self._lagged = self._lagged or LaggedWeightSync()
            lag = 0 if exact else cfg.buffer.max_staleness
            handle = self._lagged.push(self.learner, [s.handle for s in live], policy_version, lag)
        else:
            handle = self._push_to_live(live, policy_version)
        self.current = handle
        for slot in live:
            slot.engine_version = handle.policy_version
        self._track(handle.acks)
        if blocking:
            for ack in list(handle.acks):
                self.on_ack(ack)
        return handle.export_s

    def push_final(self, policy_version: int) -> None:
        """Give every engine the learner's final policy (``policy_version``) before the end
        evaluation, which must measure it: wait for the loads in flight, then push it to
        the engines still behind (``sync.fixed_lag`` holds them ``buffer.max_staleness``
        versions back, a sync period skips versions) and wait for those loads too."""
        self.settle()
        if any(s.engine_version != policy_version for s in self.fleet.live()):
            self.push(policy_version, blocking=True, exact=True)

    def rewind(self) -> None:
        """Before the stability guard's rollback pushes the restored weights: wait for the
        loads in flight, and forget the exports ``sync.fixed_lag`` keeps (the abandoned
        policy's versions; the restored one is the oldest from now on)."""
        self.settle()
        self._lagged = None

    def push_to_new(self, slots: list[RolloutSlot]) -> None:
        """Give actors created after the first sync the current weights."""
        if self.current is None or not slots:
            return
        self._track(self.weight_sync.push_to(self.current, [s.handle for s in slots]))
        for slot in slots:
            slot.engine_version = self.current.policy_version

    def _push_to_live(self, live: list[RolloutSlot], policy_version: int) -> Any:
        """``weight_sync.push`` to ``live``; engines found gone while the collective group
        forms are marked lost (and removed from ``live``) and the push made again."""
        from services.weight_sync import EnginesLost

        while True:
            try:
                return self.weight_sync.push(self.learner, [s.handle for s in live], policy_version)
            except EnginesLost as e:
                gone = {id(h) for h in e.engines}
                for slot in [s for s in live if id(s.handle) in gone]:
                    live.remove(slot)
                    self.mark_lost(slot, f"rollout actor {slot.index} did not answer the sync")

    def _track(self, acks: list[Any]) -> None:
        export_s = self.current.export_s if self.current is not None else 0.0
        for ack in acks:
            self.pending[ack] = export_s

    def mark_lost(self, slot: RolloutSlot, reason: str) -> None:
        """Take a crashed actor out of syncs and admission until Ray has it back: the
        collective group (if it is a member) is aborted so no survivor waits for it, and a
        weight load is queued on it, which runs first when it restarts (its success brings
        the slot back, :meth:`on_ack`)."""
        self.weight_sync.on_member_lost(slot.handle, reason)
        if slot.lost or self.current is None:
            return  # before the first sync there is nothing to re-send: that sync reaches it
        slot.lost = True
        acks = self.weight_sync.push_to(self.current, [slot.handle])
        self._track(acks)
        self.revivals.update({ack: slot for ack in acks})
        slot.engine_version = self.current.policy_version

    def on_crash(self, slot: RolloutSlot, error: BaseException) -> None:
        """A rollout actor died mid-call: judge it and queue its re-sync (the caller counts
        the restart).

        Raises:
            services.loop.fleet.RolloutActorLost: a restart cannot bring it back
                (:meth:`services.loop.fleet.Fleet.on_crash`).
        """
        self.fleet.on_crash(slot, error)
        self.say(
            f"rollout actor {slot.index} crashed ({type(error).__name__}); restarting "
            "(it rejoins with current weights once Ray has placed it again)"
        )
        log.warning("rollout actor %d crashed: %s", slot.index, error)
        self.mark_lost(slot, f"rollout actor {slot.index} lost ({type(error).__name__})")

    def settle(self, rounds: int = 3) -> None:
        """Wait for every pending ack (re-synced weights must land before a rerun), also the
        loads an ack queues anew (an actor lost again), for at most ``rounds`` rounds."""
        for _ in range(rounds):
            for ack in list(self.pending):
                self.on_ack(ack)
            if not self.pending:
                return

    def on_ack(self, ack: Any) -> None:
        """A load finished (or failed): record it, re-sync where needed (module docstring).

        Raises:
            ray.exceptions.RayTaskError: a load failed for another reason than a broken
                collective broadcast.
        """
        export_s = self.pending.pop(ack)
        revived = self.revivals.pop(ack, None)
        try:
            load_s = ray.get(ack)
        except ray.exceptions.RayActorError as e:
            # an engine died before or during this sync: no survivor may wait for it
            self.weight_sync.on_member_lost(
                None, f"an engine died during a sync ({type(e).__name__})"
            )
            if revived is not None:
                revived.lost = False  # it crashed again: mark_lost queues another load
                self.mark_lost(revived, f"rollout actor {revived.index} lost again")
            return  # a crashed actor is re-synced by mark_lost
        except ray.exceptions.RayTaskError as e:
            if not self.weight_sync.on_broken_sync(e):
                raise
            self._resync_after_broken_broadcast()
            return
        if isinstance(load_s, int | float):
            self.on_load_s(export_s + float(load_s))
        if revived is not None:
            self._on_revived(revived)

    def _resync_after_broken_broadcast(self) -> None:
        """The engines that survived a broken broadcast did not get the current weights, yet
        their next rollouts wait for that version (``min_policy_version``): send them the
        learner's weights through the object store now, once per broken sync, instead of at
        the next sync (which may need their trajectories first: the run would stall for
        ``rollout.weight_wait_timeout_s``). The group is formed again at the next sync."""
        if self.current is None or self._resynced is self.current:
            return
        self._resynced = self.current
        live = self.fleet.live()
        self.say(
            "weight sync: the collective broadcast broke (an engine died); re-sending "
            f"policy_version {self.current.policy_version} to {len(live)} engine(s) through "
            "the object store, re-forming the group at the next sync"
        )
        self._track(self.weight_sync.push_to(self.current, [s.handle for s in live]))

    def _on_revived(self, slot: RolloutSlot) -> None:
        """A lost actor is back (Ray restarted it and it loaded the weights queued at the
        crash): bring it up to the current version before its first rollout, then let it
        take part in syncs and admission again."""
        from services.weight_sync import engine_weights_call

        slot.lost = False
        # a restarted actor starts from its creation config; a live change must survive it
        self.fleet.set_interrupt([slot], self.config().rollout.interrupt_every_tokens)
        if self.current is not None and self.current.policy_version > slot.engine_version:
            ray.get(self.weight_sync.push_to(self.current, [slot.handle]))
            slot.engine_version = self.current.policy_version
        node = ray.get(engine_weights_call(slot.handle, "node_address").remote())
        self.say(
            f"rollout actor {slot.index} is back on {node} with policy_version "
            f"{slot.engine_version}"
        )
