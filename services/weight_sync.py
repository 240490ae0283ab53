"""Weight synchronisation learner -> rollout engines, behind one Protocol.

Versioned and in memory: the learner exports its weights once per sync (contiguous CPU
clones, HF parameter names) together with its ``policy_version``. Every weight call runs on
the rollout actor's weight thread (:data:`ENGINE_WEIGHTS_GROUP`), beside a running
``rollout``: with ``rollout.interrupt_every_tokens = 0`` the load waits for the batch to
finish (:class:`actors.engines.interrupt.WeightGate`), with N > 0 it lands at the batch's
next safe point (between turns, every N tokens). Weights never change mid-token, and every
token records the version that sampled it (``Trajectory.token_versions``; the
trajectory's ``policy_version_min/max`` are the oldest and newest).

Transports:

- :class:`ObjectStoreWeightSync` (CPU, default): the state dict goes into the Ray object
  store once (``export_weights`` returns it) and each engine pulls it by reference.
- :class:`CollectiveWeightSync` (``sync.transport = "collective"``): learner rank 0 and every
  engine join one process group (:mod:`actors.weight_group`: a standalone gloo group on CPU,
  nccl when the learner has GPUs; the same code) and each sync broadcasts the weights
  tensor by tensor from rank 0; each engine receives them on its weight thread while it
  generates and loads them in place at the gate (above). No copy goes through the object
  store, and the broadcast no longer waits for the engines' running batches;
  ``sync.collective_timeout_s`` bounds it. Group membership is fixed: an engine
  that restarts (or is added by a live ``rollout.num_actors`` change) gets the weights
  through the object store at once, and the group is formed again, with every engine,
  at the next sync.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

ENGINE_WEIGHTS_GROUP = "weights"
"""The rollout actor's concurrency group for weight calls (:mod:`services.ray_actors`): a
thread of its own, so a load reaches the engine while a rollout runs and is applied at the
rollout's next safe point (``rollout.interrupt_every_tokens > 0``) or when it ends."""


def engine_weights_call(engine: Any, method: str) -> Any:
    """``engine.<method>`` as a call on the actor's weight thread (``load_weights``,
    ``receive_weights``, ``join_weight_group``, ``leave_weight_group``), e.g.
    ``engine_weights_call(e, "load_weights").remote(ref, version)``."""
    return getattr(engine, method).options(concurrency_group=ENGINE_WEIGHTS_GROUP)


class EnginesLost(RuntimeError):
    """Engines that did not answer when a sync needed them (their actors died or are being
    restarted by Ray); the driver takes them out of syncs until they are back.

    Attributes:
        engines: their actor handles.
    """

    def __init__(self, engines: list[Any]) -> None:
        super().__init__(f"{len(engines)} engine(s) did not answer")
        self.engines = engines


@dataclass
class SyncHandle:
    """A sync in progress: one acknowledgement per engine (each returns its load seconds).

    Attributes:
        policy_version: the version being pushed.
        export_s: seconds the learner spent exporting (cloning) its weights.
        acks: Ray object refs, one per engine, resolving to that engine's load seconds.
        weights_ref: the object-store reference of the exported state dict (kept so engines
            restarted after a crash can be re-synced without another export).
        started_s: ``time.perf_counter()`` when the sync was issued.
    """

    policy_version: int
    export_s: float
    acks: list[Any]
    weights_ref: Any
    started_s: float


class WeightSync(Protocol):
    """Moves the learner's weights into the engines."""

    def push(self, learner: Any, engines: list[Any], policy_version: int) -> SyncHandle:
        """Export the learner's weights and queue a load on every engine (non-blocking)."""
        ...

    def push_to(self, handle: SyncHandle, engines: list[Any]) -> list[Any]:
        """Re-send an already exported version to some engines (e.g. restarted ones)."""
        ...

    def on_broken_sync(self, error: Exception) -> bool:
        """A sync's acknowledgement raised ``error``; True if the transport recovers from it
        (the driver then goes on), False if the run must stop."""
        ...

    def on_member_lost(self, engine: Any, reason: str) -> None:
        """An engine (``None``: one not known) died or lost its node: nothing may wait for
        it any more."""
        ...


def export_to_object_store(
    learner: Any, policy_version: int, bucket_bytes: int = 1 << 30
) -> tuple[Any, float]:
    """Have the learner export its weights into the object store (gathered
    ``bucket_bytes`` at a time under ZeRO-3); returns the reference and the export seconds.

    Raises:
        RuntimeError: the learner exported another version than ``policy_version``.
    """
    import ray

    started = time.perf_counter()
    weights_ref, version_ref = learner.export_weights.options(num_returns=2).remote(bucket_bytes)
    exported_version = ray.get(version_ref)
    if exported_version != policy_version:
        raise RuntimeError(
            f"learner exported policy_version {exported_version}, driver expected {policy_version}"
        )
    return weights_ref, time.perf_counter() - started


class ObjectStoreWeightSync:
    """Ray object store transport (see module docstring); the learner exports
    ``bucket_bytes`` at a time (``sync.bucket_mb``)."""

    def __init__(self, bucket_bytes: int = 1 << 30) -> None:
        self.bucket_bytes = bucket_bytes

    def push(self, learner: Any, engines: list[Any], policy_version: int) -> SyncHandle:
        started = time.perf_counter()
        weights_ref, export_s = export_to_object_store(learner, policy_version, self.bucket_bytes)
        handle = SyncHandle(policy_version, export_s, [], weights_ref, started)
        handle.acks = self.push_to(handle, engines)
        return handle

    def push_to(self, handle: SyncHandle, engines: list[Any]) -> list[Any]:
        return [
            engine_weights_call(e, "load_weights").remote(handle.weights_ref, handle.policy_version)
            for e in engines
        ]

    def on_broken_sync(self, error: Exception) -> bool:
        return False  # a load that raised is a bug, not a transient fault

    def on_member_lost(self, engine: Any, reason: str) -> None:
        """Nothing waits on a lost engine here (each engine pulls on its own)."""


class CollectiveWeightSync:
    """Process-group broadcast transport (see module docstring).

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (learner rank 0's device decides: nccl needs CUDA
            tensors on every member).
        timeout_s: per-broadcast timeout of every member.
        join_timeout_s: how long forming the group may take; while it forms, ``say`` is
            told every :data:`JOIN_PROGRESS_S` who has joined.
        say: where progress lines go (the driver's console).
        bucket_bytes: the learner gathers and broadcasts the model this much at a time
            (``sync.bucket_mb``); engines load each tensor as it arrives.
    """

    def __init__(
        self,
        backend: str = "gloo",
        timeout_s: float = 1800.0,
        join_timeout_s: float = 60.0,
        say: Callable[[str], None] = print,
        bucket_bytes: int = 1 << 30,
    ) -> None:
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s
        self.say = say
        self._members: list[Any] = []  # engine handles in the group, in rank order
        self._store_address: tuple[str, int] | None = None  # the formed group's store
        self._lock = threading.Lock()
        self._metas: list[Any] = []
        self._learner: Any = None
        self.groups_formed = 0

    def _form_group(self, learner: Any, engines: list[Any]) -> None:
        """Form the group from ``engines``.

        Raises:
            EnginesLost: some engines did not answer (dead, or being restarted by Ray: a
                lost node's actor waits for a new one); the caller forms it without them.
        """
        import ray

        # leave first (membership changes need a new group); engines not in the old group
        # (restarted, added) are not in any
        self._members = []
        ray.get(learner.leave_weight_group.remote())
        leaves = [engine_weights_call(e, "leave_weight_group").remote() for e in engines]
        lost = []
        for engine, ref in zip(engines, leaves, strict=True):
            try:
                ray.get(ref, timeout=self.join_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.append(engine)
        if lost:
            raise EnginesLost(lost)
        self._try_form_group(learner, engines)

    def _try_form_group(self, learner: Any, engines: list[Any]) -> None:
        import ray

        # on the weight thread: the default thread may hold a rollout that waits for the
        # very version this sync is about to deliver
        addresses = ray.get([engine_weights_call(e, "node_address").remote() for e in engines])
        host, port = ray.get(learner.weight_group_address.remote())
        world = len(engines) + 1
        names = {0: f"learner ({host})"}
        names.update({r: f"engine {r} ({ip})" for r, ip in enumerate(addresses, start=1)})
        self.say(
            f"[sync] forming the weight-sync group at {host}:{port}: "
            + ", ".join(names[r] for r in range(world))
            + f" (join timeout {self.join_timeout_s:g} s)"
        )
        metas_ref = learner.join_weight_group.remote(
            host, port, world, self.backend, self.timeout_s, self.join_timeout_s
        )
        joins = [
            engine_weights_call(e, "join_weight_group").remote(
                host, port, rank, world, self.backend, self.timeout_s, self.join_timeout_s
            )
            for rank, e in enumerate(engines, start=1)
        ]
        wait_for_group(
            [metas_ref, *joins], host, port, names, self.join_timeout_s, "the weight-sync group",
            self.say,
        )  # fmt: skip
        self._metas = ray.get(metas_ref)
        self._members = list(engines)
        self._store_address = (host, port)
        self.groups_formed += 1

    def push(self, learner: Any, engines: list[Any], policy_version: int) -> SyncHandle:
        """Broadcast to ``engines`` (forming the group first if its members changed).

        Raises:
            EnginesLost: some of ``engines`` did not answer while the group was formed.
        """
        started = time.perf_counter()
        self._learner = learner
        if not engines:  # all lost: they get the weights when Ray has them back (push_to)
            self._members = []
            return SyncHandle(policy_version, 0.0, [], None, started)
        if _ids(self._members) != _ids(engines):
            self._form_group(learner, engines)
        sent = learner.broadcast_weights.remote(self.bucket_bytes)
        acks = [engine_weights_call(e, "receive_weights").remote(self._metas) for e in engines]
        self._watch(acks)
        return SyncHandle(policy_version, 0.0, [sent, *acks], None, started)

    def _watch(self, acks: list[Any]) -> None:
        """Abort the group as soon as an engine's receive fails because the engine died,
        from a thread of its own: the driver's main loop may be blocked on the learner
        (a checkpoint queued behind the broadcast), and the broadcast would otherwise
        wait for the dead engine until ``collective_timeout_s``."""
        import ray

        def watch() -> None:
            pending = list(acks)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                try:
                    ray.get(ready[0])
                except ray.exceptions.RayActorError as e:
                    self.on_member_lost(
                        None, f"an engine died during the broadcast ({type(e).__name__})"
                    )
                    return
                except Exception:  # a broken broadcast: the driver handles its ack
                    return

        threading.Thread(target=watch, name="weight-sync-watch", daemon=True).start()

    def push_to(self, handle: SyncHandle, engines: list[Any]) -> list[Any]:
        """Engines outside the group (restarted or added): the learner's current weights
        through the object store now, at the learner's current version (``handle``'s or a
        later one: no copy of older weights is kept, and newer weights only make the
        engine less stale); the group is formed again, with them, at the next :meth:`push`.

        Raises:
            RuntimeError: before the first :meth:`push`.
        """
        if self._learner is None:
            raise RuntimeError("push_to before the first push")
        weights_ref, version_ref = self._learner.export_weights.options(num_returns=2).remote(
            self.bucket_bytes
        )
        self._members = []  # re-form at the next push, with every engine
        return [
            engine_weights_call(e, "load_weights").remote(weights_ref, version_ref) for e in engines
        ]

    def on_broken_sync(self, error: Exception) -> bool:
        """A member died mid-broadcast (gloo/nccl report the closed connection to the
        others): forget the group; the next :meth:`push` forms it again and re-syncs every
        engine. Other errors (a bug, a bad tensor plan) are not recovered from."""
        text = str(error)
        if not any(sign in text for sign in _PEER_LOST):
            return False
        # the members still waiting in this broadcast (the learner's side broke, theirs
        # did not) must give up too: forgetting the group alone left a surviving engine in
        # its receive until collective_timeout_s, and its next rollout waiting behind it
        self._abort(None, "the broadcast broke (a member was lost)")
        return True

    def on_member_lost(self, engine: Any, reason: str) -> None:
        """Abort the group if ``engine`` (``None``: any) is a member: every member's pending
        broadcast raises :class:`actors.weight_group.GroupAborted` (instead of waiting for
        the lost one until ``collective_timeout_s``), and the next :meth:`push` forms the
        group again from the engines that are left."""
        self._abort(engine, reason)

    def _abort(self, engine: Any, reason: str) -> None:
        """Abort the formed group (once) if ``engine`` (``None``: any) is a member, and
        forget it."""
        with self._lock:  # the watcher thread and the driver may both get here
            if not self._members or self._store_address is None:
                return
            if engine is not None and _ids([engine])[0] not in _ids(self._members):
                return
            self._members = []
            host, port = self._store_address
        from actors.weight_group import abort_group

        try:
            abort_group(host, port, reason)
            self.say(
                f"[sync] aborted the weight-sync group: {reason}; re-forming it at the next sync"
            )
        except Exception as e:  # the learner's store is out of reach: the timeout still bounds it
            self.say(f"[sync] could not abort the weight-sync group at {host}:{port} ({e})")


_PEER_LOST = (
    "Connection closed by peer", "Connection reset", "Timed out", "timed out", "NCCL",
    "weight-sync group aborted",
)  # fmt: skip
"""Error texts of a collective whose peer died or stopped answering (gloo, nccl)."""


JOIN_PROGRESS_S = 5.0
"""Seconds between two progress lines while a process group forms."""

JOIN_GRACE_S = 15.0
"""Past the members' own join timeout, how long the driver waits for them to report."""


def wait_for_group(
    refs: list[Any],
    host: str,
    port: int,
    names: dict[int, str],
    join_timeout_s: float,
    what: str,
    say: Callable[[str], None] = print,
) -> None:
    """Wait for the members' join calls (``refs``) while the group forms, saying every
    :data:`JOIN_PROGRESS_S` who has joined (read from the group's store at ``host:port``,
    which the driver reaches as a client; if it cannot, it says so once and keeps waiting).

    Args:
        refs: one object ref per member's join call.
        host, port: rank 0's store.
        names: rank -> a label with its address, for messages.
        join_timeout_s: the members' join timeout.
        what: the group's name for messages.
        say: where progress lines go.

    Raises:
        actors.rendezvous.GroupJoinError: the members gave up (their error, which names who
            did not join), or they did not report within ``join_timeout_s`` +
            :data:`JOIN_GRACE_S` (then the driver's own view of the store names them).
    """
    import ray

    from actors.rendezvous import GroupJoinError

    started = time.monotonic()
    pending = list(refs)
    peek = StorePeek(host, port, len(names))
    last = ""
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=JOIN_PROGRESS_S)
        if not pending:
            break
        waited = time.monotonic() - started
        joined = peek.joined()
        status = join_status(joined, names)
        if status != last:
            say(f"[sync] {what}: {status} ({waited:.0f} s of {join_timeout_s:g})")
            last = status
        if waited > join_timeout_s + JOIN_GRACE_S:
            raise GroupJoinError(
                what, len(names), join_timeout_s, joined or {}, names,
                cause=f"no member reported after {waited:.0f} s",
            )  # fmt: skip
    try:
        ray.get(refs)
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), GroupJoinError) else None
        if cause is not None:  # the members' view, with the driver's names for them
            raise GroupJoinError(
                what, len(names), join_timeout_s, cause.joined, names, cause.cause
            ) from None
        raise


def join_status(joined: dict[int, dict] | None, names: dict[int, str]) -> str:
    """One progress line of a forming group: how many of ``names`` (rank -> label) have
    joined and who is awaited (``joined`` None: the store is out of reach from here)."""
    if joined is None:
        return "store not reachable from the driver to show progress"
    missing = ", ".join(names[r] for r in sorted(names) if r not in joined)
    return f"{len(joined)}/{len(names)} joined; waiting for {missing}"


class StorePeek:
    """A client of a group's store that reads who has joined; it (re)connects on each
    call until it can, so a store that is not bound yet only means "nothing to show"."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        self.host, self.port, self.world_size = host, port, world_size
        self.store: Any = None

    def joined(self) -> dict[int, dict] | None:
        """Rank -> info of the members registered so far; None if the store is out of
        reach from here."""
        from datetime import timedelta

        import torch.distributed as dist

        from actors.rendezvous import joined_members

        try:
            if self.store is None:
                self.store = dist.TCPStore(
                    self.host, self.port, is_master=False, timeout=timedelta(seconds=2),
                    wait_for_workers=False,
                )  # fmt: skip
            return joined_members(self.store, self.world_size)
        except Exception:
            self.store = None
            return None


def _ids(handles: list[Any]) -> list[Any]:
    """Ray actor ids of ``handles`` (handles to one actor are different objects)."""
    return [getattr(h, "_actor_id", h) for h in handles]


def make_weight_sync(
    transport: str,
    backend: str = "gloo",
    timeout_s: float = 1800.0,
    join_timeout_s: float = 60.0,
    say: Callable[[str], None] = print,
    bucket_bytes: int = 1 << 30,
) -> WeightSync:
    """The transport named in ``sync.transport``.

    Args:
        transport: ``"object_store"`` or ``"collective"``.
        backend: the ``collective`` group's backend (``"gloo"`` / ``"nccl"``).
        timeout_s: the ``collective`` group's per-broadcast timeout.
        join_timeout_s: how long forming the ``collective`` group may take.
        say: where the ``collective`` group's join progress goes.
        bucket_bytes: how much of the model the learner gathers and sends at a time
            (``sync.bucket_mb``).

    Raises:
        ValueError: an unknown transport.
    """
    if transport == "object_store":
        return ObjectStoreWeightSync(bucket_bytes)
    if transport == "collective":
        return CollectiveWeightSync(backend, timeout_s, join_timeout_s, say, bucket_bytes)
    raise ValueError(f"unknown weight-sync transport {transport!r}")
