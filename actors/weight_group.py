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
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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


def routable_ip() -> str:
    """This host's address on its default route (no packet is sent), else loopback."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.254.254.254", 1))
        return s.getsockname()[0]
    return "127.0.0.1"


def bind_master_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's ``TCPStore``, listening now on a port the OS picks (port 0; read it back
    with ``.port``), so no other process can take the port between picking and binding it.
    Hand it to :class:`WeightGroup` as ``store``."""
    return dist.TCPStore(
        "0.0.0.0", 0, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


class WeightGroup:
    """One member of the weight-sync group.

    Args:
        host: address of rank 0's ``TCPStore`` (rank 0: its own routable address).
        port: the store's port.
        rank: 0 for the learner, 1.. for the engines.
        world_size: 1 + number of engines.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        timeout_s: how long a member waits for the others (joining, and each broadcast).
        store: rank 0 only: its store already bound by :func:`bind_master_store` (``port``
            must be its port); None binds ``port`` here.

    Raises:
        ValueError: a bad rank, world size or backend.
        RuntimeError / DistStoreError: the others did not join within ``timeout_s``.
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
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} of world size {world_size}: need 0 <= rank < size, size >= 2"
            )
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        if store is not None:
            if rank != 0 or store.port != port:
                raise ValueError(f"a bound store is rank 0's on its own port ({store.port})")
            store.set_timeout(timeout)
            self.store = store
        else:
            self.store = dist.TCPStore(
                host, port, world_size, is_master=rank == 0, timeout=timeout,
                wait_for_workers=False,
            )  # fmt: skip
        prefixed = dist.PrefixStore("stppo-weights", self.store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        self.barrier()  # every member is connected before anyone broadcasts

    def barrier(self) -> None:
        """Wait until every member gets here (a 1-element all-reduce)."""
        flag = torch.zeros(1, device=self.device)
        self.group.allreduce([flag]).wait()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def send(
        self, state_dict: Mapping[str, torch.Tensor], metas: list[TensorMeta], version: int
    ) -> int:
        """Rank 0: broadcast ``version`` and then every tensor in ``metas``' order.

        Returns:
            bytes broadcast.

        Raises:
            KeyError / ValueError: ``state_dict`` does not match ``metas``.
        """
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        sent = 0
        for meta in metas:
            tensor = state_dict[meta.name]
            if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.torch_dtype:
                raise ValueError(
                    f"{meta.name}: {tuple(tensor.shape)} {tensor.dtype} != plan {meta}"
                )
            tensor = tensor.detach().to(self.device).contiguous()
            self._broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
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
        """Leave the group (the other members must not broadcast any more)."""
        with contextlib.suppress(Exception):
            self.group.shutdown()
        self.group = None
