"""The learner as a group of ``learner.num_ranks`` Ray actors (data-parallel DeepSpeed).

:class:`LearnerGroup` starts one :class:`LearnerRank` actor per rank in one placement group
(a bundle of ``ray.learner_cpus`` CPUs, ``ray.learner_gpus`` GPUs and
``ray.learner_resources`` per rank, ``PACK`` strategy: on one node when it fits), asks rank 0
for a rendezvous address (its node IP and a free port), and has every rank join one
``torch.distributed`` group there (:func:`learner.distributed.init_rank_distributed`: gloo
on CPU, nccl on CUDA) before building its :class:`learner.trainer.Learner`. How the batch
and the reductions are split is in ``learner/trainer.py``'s module docstring.

The group looks like the single learner actor it replaces: ``group.step.remote(batch)``
calls ``step`` on every rank with the same arguments and returns *one* object ref, that of
a small collector task (:func:`_collect`) which resolves to rank 0's result, or raises
:class:`LearnerRankError` as soon as a rank's actor died, naming the rank and the last
checkpoint the group saved or loaded (an exception the learner raised is passed on as it
is). So a crashed rank stops the run with that message instead of leaving the other ranks
blocked in a collective (their collectives also time out after ``timeout_s``). ``group.export_weights.options(
num_returns=2).remote()`` returns rank 0's two refs directly (the state dict is not copied
through the collector); the other ranks take part (ZeRO-3 gathers) and return ``{}``.

Sources: Ray placement groups (``ray.util.placement_group``), OpenRLHF's and verl's Ray
actor groups of DeepSpeed/FSDP ranks (rank 0 publishes ``MASTER_ADDR``/``MASTER_PORT``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from services.config import RunConfig
from services.ray_actors import learner_actor_options, on_driver_node

PLACEMENT_TIMEOUT_S = 300.0
"""Seconds to wait for the cluster to grant the learner group's bundles."""


class LearnerRankError(RuntimeError):
    """A learner rank died or raised; the run cannot go on with a partial group."""


class LearnerRank:
    """Ray actor body of one rank: rendezvous, then a :class:`learner.trainer.Learner`.

    Args:
        rank: this actor's rank.
        world_size: ranks in the group.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.learner: Any = None
        self.store: Any = None

    def rendezvous_address(self) -> tuple[str, int]:
        """(node IP, port) of the ``torch.distributed`` store this rank (rank 0) hosts, bound
        now on a port the OS picks and kept for :meth:`join`: a port found free and bound
        only later could be taken in between by another process."""
        from actors.rendezvous import bind_master_store

        self.store = bind_master_store()
        return ray.util.get_node_ip_address(), int(self.store.port)

    def node_address(self) -> str:
        """The address this rank listens on (its node's IP as Ray knows it)."""
        from actors.rendezvous import node_ip

        return node_ip()

    def setup(
        self,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        model_path: str,
        config: Any,
        algorithm: Any,
        seed: int,
        temperature: float,
        join_timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        """Join the group, build the learner; returns this rank's pid, node and device."""
        backend = self.join(master_addr, master_port, timeout_s, join_timeout_s)
        self.build(model_path, config, algorithm, seed, temperature)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "device": str(self.learner.device),
            "backend": backend,
        }

    def join(
        self,
        master_addr: str,
        master_port: int,
        timeout_s: float = 600.0,
        join_timeout_s: float = 120.0,
    ) -> str:
        """Join the ``torch.distributed`` group (every rank at once, listening on this
        node's IP; at most ``join_timeout_s``); returns the backend.

        Raises:
            actors.rendezvous.GroupJoinError: the group did not form in time."""
        import torch

        from learner.distributed import init_rank_distributed

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_rank_distributed(
            self.rank, self.world_size, master_addr, master_port, backend, timeout_s,
            join_timeout_s, store=self.store,
        )  # fmt: skip
        return backend

    def build(
        self, model_path: str, config: Any, algorithm: Any, seed: int, temperature: float
    ) -> None:
        """(Re)build this rank's learner inside the joined group (every rank at once)."""
        import gc

        from learner.trainer import Learner

        self.learner = None
        gc.collect()
        self.learner = Learner(model_path, config, algorithm, seed=seed, temperature=temperature)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``learner.<method>(*args, **kwargs)``."""
        return getattr(self.learner, method)(*args, **kwargs)

    def execute(self, fn: Any, *args: Any) -> Any:
        """``fn(self, *args)`` in this rank's process (benchmarks and diagnostics ship a
        function by value, e.g. to read this process's peak memory)."""
        return fn(self, *args)

    def pid(self) -> int:
        """This rank's process id (tests kill it to simulate a crash)."""
        return os.getpid()


DEATH_GRACE_S = 10.0
"""After a rank raised, seconds to wait for another rank to turn out dead: a killed rank
makes its peers' collectives fail first (connection reset), and the death is the cause."""


def _rank_died_error(rank: int, error: Exception, method: str, checkpoint: str | None):
    detail = str(error).strip().splitlines()[-1] if str(error).strip() else ""
    return LearnerRankError(
        f"learner rank {rank} died during {method} ({type(error).__name__}: {detail}); the "
        f"run stops. Last checkpoint: {checkpoint or 'none saved yet'}; "
        "`stppo train --resume` continues from it"
    )


@ray.remote(num_cpus=0, max_retries=0)
def _collect(refs: list[Any], last_checkpoint: str | None, method: str) -> Any:
    """Rank 0's result once every rank finished ``method``; the first failure raises.
    Runs on the driver's node (:func:`services.ray_actors.on_driver_node`), so losing a
    rollout pod cannot fail a learner call.

    A rank whose actor died raises :class:`LearnerRankError` (naming the last
    checkpoint). An exception raised by the learner's method (a bad argument, a checkpoint
    written with another ``num_ranks``) is re-raised as it is, unless a rank turns out dead
    within :data:`DEATH_GRACE_S` (the exception was then its consequence). ``refs`` is
    wrapped in a list so Ray passes the refs themselves, not their values.
    """
    index = {ref: rank for rank, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            raise _rank_died_error(index[ready[0]], e, method, last_checkpoint) from None
        except Exception as raised:
            deadline = DEATH_GRACE_S
            while pending and deadline > 0:
                started = time.monotonic()
                done, pending = ray.wait(pending, num_returns=1, timeout=deadline)
                deadline -= time.monotonic() - started
                for ref in done:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as e:
                        raise _rank_died_error(index[ref], e, method, last_checkpoint) from None
                    except Exception:
                        pass
            raise raised
    return ray.get(refs[0])


class _Method:
    """``group.<name>``: ``.remote(*args)`` on every rank, one collected ref back."""

    def __init__(self, group: LearnerGroup, name: str, num_returns: int = 1) -> None:
        self._group = group
        self._name = name
        self._num_returns = num_returns

    def options(self, num_returns: int = 1) -> _Method:
        return _Method(self._group, self._name, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._submit(self._name, self._num_returns, args, kwargs)


def reserve_learner_bundles(cfg: RunConfig, timeout_s: float = PLACEMENT_TIMEOUT_S) -> Any:
    """A placement group of ``learner.num_ranks`` bundles (``ray.learner_cpus`` CPUs,
    ``ray.learner_gpus`` GPUs, ``ray.learner_resources``), packed, once the cluster has
    granted it: the ranks' GPUs are reserved together before any rank starts.

    Raises:
        TimeoutError: not granted within ``timeout_s`` (the message names the bundle and
            the settings to change).
    """
    from ray.util.placement_group import placement_group

    ranks = cfg.learner.num_ranks
    bundle = {"CPU": cfg.ray.learner_cpus, "GPU": cfg.ray.learner_gpus}
    bundle.update(cfg.ray.learner_resources)
    bundle = {k: float(v) for k, v in bundle.items() if v > 0}
    group = placement_group([bundle] * ranks, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise TimeoutError(
            f"the Ray cluster did not grant {ranks} learner bundle(s) of {bundle} "
            f"within {timeout_s:.0f} s: lower learner.num_ranks or add nodes "
            "with these resources (ray.learner_cpus / learner_gpus / learner_resources)"
        )
    return group


def learner_rank_options(cfg: RunConfig, group: Any, rank: int) -> dict[str, Any]:
    """``.options`` of learner rank ``rank``: :func:`services.ray_actors.learner_actor_options`
    in bundle ``rank`` of ``group`` (:func:`reserve_learner_bundles`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = learner_actor_options(cfg, rank)
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=rank
    )
    return options


class LearnerGroup:
    """``cfg.learner.num_ranks`` learner ranks behind one actor-like handle.

    Args:
        cfg: the run config (model path, learner and algorithm sections, seed, temperature,
            Ray resources).
        timeout_s: collective timeout of the process group (seconds); forming it is bounded
            by ``ray.learner_join_timeout_s`` instead.
        say: where the group's join progress goes (the driver's console).

    Raises:
        TimeoutError: the cluster did not grant the bundles within
            :data:`PLACEMENT_TIMEOUT_S` (the message lists the bundle asked for).
        LearnerRankError: a rank failed while joining the group or building its learner.

    Example::

        group = LearnerGroup(cfg)
        metrics = ray.get(group.step.remote(trajectories))
        weights_ref, version_ref = group.export_weights.options(num_returns=2).remote()
        group.shutdown()
    """

    def __init__(
        self, cfg: RunConfig, timeout_s: float = 600.0, say: Callable[[str], None] = print
    ) -> None:
        self.ranks: list[Any] = []
        self.placement_group: Any = None
        self.num_ranks = cfg.learner.num_ranks
        self.last_checkpoint: str | None = None
        self._pending_checkpoint: tuple[Any, str] | None = None
        self.placement_group = reserve_learner_bundles(cfg)
        self.ranks = [
            ray.remote(LearnerRank)
            .options(**learner_rank_options(cfg, self.placement_group, rank))
            .remote(rank, self.num_ranks)
            for rank in range(self.num_ranks)
        ]
        addr, port = ray.get(self.ranks[0].rendezvous_address.remote())
        # asked before setup is queued: an actor runs one call at a time, so asked after, the
        # addresses would only come back once every rank had joined and built its engines
        ips = ray.get([r.node_address.remote() for r in self.ranks])
        join_timeout_s = cfg.ray.learner_join_timeout_s
        setups = [
            r.setup.remote(
                addr,
                port,
                timeout_s,
                str(cfg.model.path),
                cfg.learner,
                cfg.algorithm,
                cfg.run.seed,
                cfg.rollout.temperature,
                join_timeout_s,
            )
            for r in self.ranks
        ]
        try:
            if self.num_ranks > 1:
                self._wait_for_join(addr, port, ips, join_timeout_s, say)
            ray.get(
                _collect.options(scheduling_strategy=on_driver_node()).remote(setups, None, "setup")
            )
        except Exception:
            self.shutdown()
            raise
        self.rank_info = ray.get(setups)

    def _wait_for_join(
        self,
        addr: str,
        port: int,
        ips: list[str],
        join_timeout_s: float,
        say: Callable[[str], None],
    ) -> None:
        """Say who has joined the ranks' group while it forms (read from rank 0's store);
        returns when all have, or after ``join_timeout_s`` (the ranks then raise their own
        :class:`actors.rendezvous.GroupJoinError`, naming who did not join)."""
        from services.weight_sync import JOIN_PROGRESS_S, StorePeek, join_status

        names = {rank: f"learner rank {rank} ({ip})" for rank, ip in enumerate(ips)}
        say(
            f"[learner] forming the learner group at {addr}:{port}: "
            + ", ".join(names.values()) + f" (join timeout {join_timeout_s:g} s)"
        )  # fmt: skip
        peek = StorePeek(addr, port, self.num_ranks)
        started = time.monotonic()
        last = ""
        while (waited := time.monotonic() - started) < join_timeout_s:
            joined = peek.joined() or {}  # rank 0 may not have bound its store yet
            if len(joined) == self.num_ranks:
                return
            status = join_status(joined, names)
            if status != last and waited > JOIN_PROGRESS_S:
                say(f"[learner] learner group: {status} ({waited:.0f} s of {join_timeout_s:g})")
                last = status
            time.sleep(1.0)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def _submit(self, method: str, num_returns: int, args: tuple, kwargs: dict) -> Any:
        self._promote_checkpoint()
        if method in ("save_checkpoint", "load_checkpoint"):
            path = args[0] if args else kwargs.get("directory")
        if len(self.ranks) > 1:
            # a batch (a list of trajectories) goes into the object store once for every
            # rank: passed by value, Ray would store one copy per rank's call
            args = tuple(ray.put(a) if isinstance(a, list) else a for a in args)
        if num_returns != 1:
            first = (
                self.ranks[0].call.options(num_returns=num_returns).remote(method, *args, **kwargs)
            )
            for r in self.ranks[1:]:
                r.call.remote(method, *args, **kwargs)
            return first
        refs = [r.call.remote(method, *args, **kwargs) for r in self.ranks]
        collected = _collect.options(scheduling_strategy=on_driver_node()).remote(
            refs, self.last_checkpoint, method
        )
        if method in ("save_checkpoint", "load_checkpoint"):
            self._pending_checkpoint = (collected, str(path))
        return collected

    def _promote_checkpoint(self) -> None:
        """The last save/load becomes ``last_checkpoint`` once it finished without error."""
        if self._pending_checkpoint is None:
            return
        ref, path = self._pending_checkpoint
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return
        self._pending_checkpoint = None
        try:
            ray.get(ref)
        except Exception:
            return
        self.last_checkpoint = path

    def shutdown(self) -> None:
        """Kill every rank and release the placement group (idempotent)."""
        for r in self.ranks:
            with contextlib.suppress(Exception):
                ray.kill(r)
        self.ranks = []
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None


def create_learner_group(cfg: RunConfig, say: Callable[[str], None] = print) -> LearnerGroup:
    """The learner group of ``cfg`` (one rank when ``learner.num_ranks = 1``)."""
    return LearnerGroup(cfg, say=say)
