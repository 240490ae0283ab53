"""Single-process ``torch.distributed`` setup for DeepSpeed on CPU.

DeepSpeed needs a process group even with one process. Without the rendezvous variables it
falls back to MPI discovery (``mpi4py`` is not installed) and fails, so
:func:`init_single_process_distributed` sets ``RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
MASTER_ADDR=127.0.0.1 MASTER_PORT=<free port>`` unless a launcher (``torchrun``,
``deepspeed``) already did, then calls ``deepspeed.init_distributed(backend)``
(see ``../shared/spec/platform-notes.md``, "DeepSpeed 0.19.8 on CPU").

It also calls :func:`services.env.configure_local_caches` first, so ``TORCH_EXTENSIONS_DIR``
points at the project cache and the ~40 s JIT build of ``deepspeed_shm_comm`` happens once.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from services.env import configure_local_caches


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits in the process group.

    Attributes:
        rank: Global rank (0 in single-process runs).
        world_size: Number of processes (1 in single-process runs).
        backend: ``torch.distributed`` backend name (``gloo`` on CPU).
        master_port: The rendezvous TCP port.
    """

    rank: int
    world_size: int
    backend: str
    master_port: int


_SELF_INIT_ENV = "STPPO_SELF_INIT_DISTRIBUTED"
"""Set to ``1`` when :func:`init_single_process_distributed` chose ``MASTER_PORT`` itself."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_single_process_distributed(backend: str = "gloo") -> DistributedInfo:
    """Initialise ``torch.distributed`` for DeepSpeed, once per process (idempotent).

    Args:
        backend: ``gloo`` (CPU) or ``nccl`` (GPU).

    Returns:
        :class:`DistributedInfo` of the (possibly pre-existing) process group.

    Raises:
        ValueError: if ``backend`` is not ``gloo`` or ``nccl``.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    configure_local_caches()
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        defaults = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
        }
        for name, value in defaults.items():
            os.environ.setdefault(name, value)
        # A child process (a Ray actor started from a process that already initialised its
        # own group here) inherits our variables: its MASTER_PORT is the parent's live
        # store, so pick a fresh one. A launcher's (torchrun) port carries no marker.
        if "MASTER_PORT" not in os.environ or os.environ.get(_SELF_INIT_ENV) == "1":
            os.environ["MASTER_PORT"] = str(find_free_port())
            os.environ[_SELF_INIT_ENV] = "1"
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        master_port=int(os.environ["MASTER_PORT"]),
    )
