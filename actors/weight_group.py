"""A process group for weight sync: learner rank 0 broadcasts, every rollout engine receives.

The ``collective`` weight-sync transport (``sync.transport = "collective"``,
:mod:`services.weight_sync`). Learner rank 0 is rank 0 of this group and each rollout
engine one more rank; every sync broadcasts the policy tensor by tensor from rank 0, in a
fixed order agreed once (:class:`TensorMeta`), between two generation batches.

The group is a *standalone* ``torch.distributed`` process group built on its own
``TCPStore`` (rank 0 hosts it), not the default group: the learner process already has
its default group (the DeepSpeed ranks) and a vLLM worker has vLLM's own, and neither may
be disturbed. gloo on CPU, nccl on CUDA: the same code, only the backend and the device
of the buffers differ (verl, OpenRLHF and AReaL sync weights this way on GPUs, with a
stateless NCCL group).

Nothing here imports Ray: learner and actors use it directly.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.rendezvous import (
    GroupJoinError,
    bind_master_store,
    connect_store,
    gloo_device,
    joined_members,
    node_ip,
    register,
    socket_ifname_env,
)

__all__ = [
    "GroupAborted",
    "GroupJoinError",
    "TensorMeta",
    "WeightGroup",
    "abort_group",
    "bind_master_store",
    "tensor_metas",
]


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one broadcast tensor (the order of a list of these is the
    order of the broadcasts)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def tensor_metas(state_dict: Mapping[str, torch.Tensor]) -> list[TensorMeta]:
    """The broadcast plan of ``state_dict``: one :class:`TensorMeta` per entry, in order."""
    return [
        TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in state_dict.items()
    ]


ABORT_KEY = "stppo/abort"
"""Store key whose presence makes every member's pending collective raise :class:`GroupAborted`."""

ABORT_POLL_S = 0.5
"""How often a waiting member checks for :data:`ABORT_KEY` (one store round trip)."""


_ABANDONED: list = []
"""Process groups left after a failed or aborted collective (see :meth:`WeightGroup.close`)."""


class GroupAborted(RuntimeError):
    """The driver aborted the weight-sync group (a member was lost); it is formed again."""


def abort_group(host: str, port: int, reason: str, timeout_s: float = 5.0) -> None:
    """Make every member of the group whose store is ``host:port`` stop waiting: their
    pending and later collectives raise :class:`GroupAborted` with ``reason``.

    Raises:
        RuntimeError / DistStoreError: the store is not reachable within ``timeout_s``.
    """
    store = dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    store.set(ABORT_KEY, reason)


class WeightGroup:
    """One member of the weight-sync group.

    Joining is bounded by ``join_timeout_s`` and visible (:mod:`actors.rendezvous`): the
    member registers its address in rank 0's store, listens on its node IP (never on what
    the hostname resolves to), and a group that does not form raises
    :class:`actors.rendezvous.GroupJoinError` naming the members that did not join. Once
    formed, each broadcast may take up to ``timeout_s``.

    Args:
        host: address of rank 0's ``TCPStore`` (rank 0: its own node IP).
        port: the store's port.
        rank: 0 for the learner, 1.. for the engines.
        world_size: 1 + number of engines.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout_s: how long a broadcast waits for the other members (seconds).
        store: rank 0 only: its store already bound by :func:`bind_master_store` (``port``
            must be its port); None binds ``port`` here.
        join_timeout_s: how long joining waits for every member (seconds).
        local_ip: the address this member listens on (None: :func:`actors.rendezvous.node_ip`).

    Raises:
        ValueError: a bad rank, world size or backend.
        GroupJoinError: the group did not form within ``join_timeout_s``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        store: dist.TCPStore | None = None,
        join_timeout_s: float = 60.0,
        local_ip: str | None = None,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} of world size {world_size}: need 0 <= rank < size, size >= 2"
            )
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if store is not None and (rank != 0 or store.port != port):
            raise ValueError(f"a bound store is rank 0's on its own port ({store.port})")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self.local_ip = local_ip or node_ip()
        self._broken = False
        what = f"the weight-sync group ({world_size} members, store {host}:{port})"
        try:
            self.store = connect_store(host, port, rank, join_timeout_s, store)
        except Exception as e:  # DistStoreError / RuntimeError: rank 0 never answered
            raise GroupJoinError(
                what, world_size, join_timeout_s, {}, {0: f"rank 0 (store {host}:{port})"},
                cause=f"rank {rank} at {self.local_ip}: {str(e).splitlines()[0]}",
            ) from None  # fmt: skip
        prefixed = dist.PrefixStore("stppo-weights", self.store)
        try:
            if backend == "gloo":
                device, where = gloo_device(self.local_ip)
                register(self.store, rank, {"ip": self.local_ip, "address": where})
                options = dist.ProcessGroupGloo._Options()
                options._devices = [device]
                options._timeout = timedelta(seconds=join_timeout_s)
                self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            else:
                for name, value in socket_ifname_env(self.local_ip, backend).items():
                    os.environ[name] = value
                where = f"{self.local_ip} (NCCL_SOCKET_IFNAME={os.environ.get('NCCL_SOCKET_IFNAME', '')})"
                register(self.store, rank, {"ip": self.local_ip, "address": where})
                self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
            self.barrier()  # every member is connected before anyone broadcasts
        except Exception as e:
            joined = joined_members(self.store, world_size)
            raise GroupJoinError(
                what, world_size, join_timeout_s, joined, cause=str(e).splitlines()[0]
            ) from None
        self.group.set_timeout(timedelta(seconds=timeout_s))

    def barrier(self) -> None:
        """Wait until every member gets here (a 1-element all-reduce)."""
        flag = torch.zeros(1, device=self.device)
        self._wait(self.group.allreduce([flag]))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._wait(self.group.broadcast([tensor], options))

    def _wait(self, work: dist.Work) -> None:
        """Wait for a collective, checking every :data:`ABORT_POLL_S` whether the driver
        aborted the group (a member's node is gone: its peers would otherwise wait for it
        until the per-broadcast timeout; gloo's own ``abort`` does not wake them).

        Raises:
            GroupAborted: :func:`abort_group` was called on this group's store.
            RuntimeError: the collective failed (gloo/nccl's error: timeout, peer lost).
        """
        delay = 1e-4
        next_check = time.monotonic() + ABORT_POLL_S
        try:
            while not work.is_completed():
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + ABORT_POLL_S
                    if self.store.check([ABORT_KEY]):
                        reason = self.store.get(ABORT_KEY).decode()
                        raise GroupAborted(f"weight-sync group aborted: {reason}")
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
            work.wait()
        except Exception:
            self._broken = True  # close() must not wait for the pending operation
            raise

    def send(
        self,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        metas: list[TensorMeta],
        version: int,
    ) -> int:
        """Rank 0: broadcast ``version`` and then every tensor in ``metas``' order.

        Args:
            tensors: name -> tensor, or ``(name, tensor)`` pairs in ``metas``' order (a
                stream such as the learner's bucketed gather: each tensor is broadcast from
                where it is, and copied only when it is not on this group's device).
            metas: the plan every member agreed on.
            version: the policy version sent first.

        Returns:
            bytes broadcast.

        Raises:
            KeyError / ValueError: ``tensors`` does not match ``metas`` (a name, shape or
                dtype, or a stream of another length).
        """
        if isinstance(tensors, Mapping):
            pairs: Iterable[tuple[str, torch.Tensor]] = ((m.name, tensors[m.name]) for m in metas)
        else:
            pairs = tensors
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        sent = 0
        stream = iter(pairs)
        for meta in metas:
            name, tensor = next(stream, (None, None))
            if name != meta.name or tensor is None:
                raise ValueError(f"the tensors sent do not follow the plan: {name!r} for {meta}")
            if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.torch_dtype:
                raise ValueError(
                    f"{meta.name}: {tuple(tensor.shape)} {tensor.dtype} != plan {meta}"
                )
            tensor = tensor.detach().to(self.device).contiguous()
            self._broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
        extra = next(stream, None)
        if extra is not None:
            raise ValueError(f"more tensors sent than the plan has ({len(metas)}): {extra[0]!r}")
        return sent

    def receive(self, metas: list[TensorMeta]) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Ranks >= 1: the version rank 0 is sending, and an iterator that receives the
        tensors one at a time, in ``metas``' order (consume it whole: every member must
        take part in every broadcast)."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for meta in metas:
                buffer = torch.empty(meta.shape, dtype=meta.torch_dtype, device=self.device)
                self._broadcast(buffer)
                yield meta.name, buffer

        return int(version.item()), tensors()

    def close(self) -> None:
        """Leave the group (the other members must not broadcast any more).

        A group whose collective failed or was aborted may still have an operation pending
        on a peer that is gone without closing its connection (a lost node): shutting it
        down, or letting it be garbage-collected, would wait for that peer. Such a group is
        aborted and kept in :data:`_ABANDONED` instead (one per lost member; it holds a few
        threads and sockets until the process ends)."""
        group, self.group = self.group, None
        if group is None:
            return
        if self._broken:
            with contextlib.suppress(Exception):
                group.abort()
            _ABANDONED.append(group)
            return
        with contextlib.suppress(Exception):
            group.shutdown()
