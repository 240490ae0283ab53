"""``torch.distributed`` setup for DeepSpeed (one process, or one rank of a learner group),
and the split of a batch across ranks.

DeepSpeed needs a process group even with one process. Without the rendezvous variables it
falls back to MPI discovery (``mpi4py`` is not installed) and fails, so
:func:`init_single_process_distributed` sets ``RANK=0 LOCAL_RANK=0 WORLD_SIZE=1
MASTER_ADDR=127.0.0.1 MASTER_PORT=<free port>`` unless a launcher (``torchrun``,
``deepspeed``) already did, then calls ``deepspeed.init_distributed(backend)``: without
those variables DeepSpeed 0.19 falls back to MPI, which needs mpi4py.

Callers point ``TORCH_EXTENSIONS_DIR`` at the project cache first
(:func:`services.env.configure_local_caches`; Ray actors get it in their runtime env), so the
~40 s JIT build of ``deepspeed_shm_comm`` happens once. This module imports nothing from
``services``.

A learner group (``learner.num_ranks > 1``, ``services/learner_group.py``) calls
:func:`init_rank_distributed` in each rank's process first, with the rendezvous address
rank 0 published; the learner's own call to :func:`init_single_process_distributed` then
finds the group initialised and only reports it. Across nodes each rank listens on its node
IP (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to the interface holding it, unless
the user set them) and joining is bounded by its own timeout, with an error naming the rank
that did not join (:mod:`actors.rendezvous`). :func:`balanced_shards` splits trajectories
across ranks by token count.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from actors.rendezvous import (
    GroupJoinError,
    connect_store,
    joined_members,
    node_ip,
    register,
    socket_ifname_env,
)


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


def name_cpu_accelerator() -> None:
    """Set ``DS_ACCELERATOR=cpu`` where torch sees no CUDA device (and the user set none).

    DeepSpeed picks the CPU accelerator itself then, but logs a WARNING ("Setting
    accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it") wherever it is imported, also by ``accelerate`` under ``transformers``'
    ``from_pretrained``. The variable reaches the processes started after it (Ray workers,
    spawned runs).
    """
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def import_deepspeed() -> Any:
    """``import deepspeed`` after :func:`name_cpu_accelerator`."""
    name_cpu_accelerator()
    import deepspeed

    return deepspeed


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def init_rank_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    join_timeout_s: float = 60.0,
    local_ip: str | None = None,
    store: Any = None,
) -> DistributedInfo:
    """Join rank ``rank`` of a ``world_size``-process group at ``master_addr:master_port``.

    Sets ``RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`` (overriding inherited values) and
    ``LOCAL_RANK=0`` (each rank is its own Ray actor, which sees only its own GPU as
    ``cuda:0``), and ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME`` for nccl) to the
    interface holding ``local_ip`` unless already set; connects to rank 0's TCP store (rank
    0 hosts it on ``master_port``), registers its address there, forms the group with
    ``torch.distributed.init_process_group`` on that store, then hands it to
    ``deepspeed.init_distributed``. Every rank must call it with the same address; it
    returns once all ``world_size`` ranks joined, or raises after ``join_timeout_s``.

    Args:
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of ranks.
        master_addr, master_port: rank 0's rendezvous address.
        backend: ``gloo`` (CPU) or ``nccl`` (GPU).
        timeout_s: collective timeout (seconds); a rank that stops answering fails the
            others' collectives after this long instead of hanging them forever.
        join_timeout_s: how long forming the group may take (seconds).
        local_ip: the address this rank listens on (None:
            :func:`actors.rendezvous.node_ip`, Ray's node IP in a Ray actor).
        store: rank 0 only: its ``TCPStore``, already listening on ``master_port``
            (:func:`actors.rendezvous.bind_master_store`), so that no other process can take
            the port between picking and binding it; None: bound (rank 0) or reached here.

    Raises:
        ValueError: bad rank / world size / backend, or a group already initialised with
            another size.
        actors.rendezvous.GroupJoinError: the group did not form within ``join_timeout_s``
            (names the ranks that did not join and the variable to set).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a group of {world_size}")
    deepspeed = import_deepspeed()
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"this process already joined rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, asked for rank {rank} of {world_size}"
            )
    else:
        local_ip = local_ip or node_ip()
        os.environ.update(socket_ifname_env(local_ip, backend))
        os.environ.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
        )
        os.environ.pop(_SELF_INIT_ENV, None)
        _form_group(
            rank, world_size, master_addr, master_port, backend, local_ip, join_timeout_s, store
        )
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
        if backend == "gloo" and world_size == 1:
            skip_shared_memory_allreduce()
        deepspeed.init_distributed(
            dist_backend=backend, verbose=False, timeout=timedelta(seconds=timeout_s)
        )
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        master_port=int(os.environ["MASTER_PORT"]),
    )


def _form_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    local_ip: str,
    join_timeout_s: float,
    store: Any = None,
) -> None:
    """``init_process_group`` on rank 0's store, bounded by ``join_timeout_s``, with every
    rank's address registered so a failure names who did not join."""
    import torch.distributed as dist

    what = f"the learner group ({world_size} ranks, rendezvous {master_addr}:{master_port})"
    try:
        store = connect_store(master_addr, master_port, rank, join_timeout_s, store)
    except Exception as e:  # rank 0's store never answered
        raise GroupJoinError(
            what, world_size, join_timeout_s, {}, {0: f"rank 0 ({master_addr}:{master_port})"},
            cause=f"rank {rank} at {local_ip}: {str(e).splitlines()[0]}",
        ) from None  # fmt: skip
    ifvar = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    where = f"{local_ip} ({ifvar}={os.environ.get(ifvar, 'unset')})"
    register(store, rank, {"ip": local_ip, "address": where})
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("stppo-learner", store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=join_timeout_s),
        )
        if backend == "gloo":
            dist.barrier()  # gloo connects here: a peer that cannot be reached shows now
    except Exception as e:
        joined = joined_members(store, world_size)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        raise GroupJoinError(
            what, world_size, join_timeout_s, joined, cause=str(e).splitlines()[0]
        ) from None


def balanced_shards(rows: Sequence[int], tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``rows`` (whole trajectories) across ``world_size`` ranks, balanced by tokens.

    Greedy longest-first: rows in decreasing token count (ties: earlier row first) each go
    to the rank with the fewest tokens so far (ties: lower rank); each shard keeps the
    order of ``rows``. Deterministic, so every rank computes the same split locally. With
    one rank the single shard is ``rows`` itself.

    Args:
        rows: row indices, in the order they are to be trained.
        tokens: token count of each row, aligned with ``rows``.
        world_size: number of ranks (>= 1).

    Returns:
        ``world_size`` lists of row indices (some empty when there are fewer rows).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(rows) != len(tokens):
        raise ValueError(f"{len(rows)} rows but {len(tokens)} token counts")
    loads = [0] * world_size
    owner: dict[int, int] = {}
    for position in sorted(range(len(rows)), key=lambda i: (-int(tokens[i]), i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += int(tokens[position])
        owner[position] = rank
    return [[rows[i] for i in range(len(rows)) if owner[i] == r] for r in range(world_size)]


def skip_shared_memory_allreduce() -> None:
    """Keep DeepSpeed from building its shared-memory allreduce for CPU ranks.

    DeepSpeed 0.19's ``TorchBackend`` JIT-compiles the ``deepspeed_shm_comm`` C++ op
    whenever it initialises on a CPU accelerator (``deepspeed.comm.torch.build_shm_op``),
    with no option to decline: about 2 minutes on a 2-core machine, the first time in a
    checkout, before the learner starts. One rank has nothing to reduce, so a group of one
    (:func:`init_single_process_distributed`, or a learner group of one rank through
    :func:`init_rank_distributed`) goes without it; with several ranks the op stays (it
    speeds their allreduce)."""
    import importlib

    # by module name: ``deepspeed.comm.torch`` as an attribute is torch itself
    torch_backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(torch_backend, "build_shm_op"):
        torch_backend.build_shm_op = lambda: None


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
    deepspeed = import_deepspeed()
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
        if backend == "gloo" and os.environ["WORLD_SIZE"] == "1":
            skip_shared_memory_allreduce()
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        master_port=int(os.environ["MASTER_PORT"]),
    )


def all_reduce_floats(values: Sequence[float], world_size: int, op: str) -> list[float]:
    """Element-wise sum or max of ``values`` over all ranks (float64; identity on one rank).
    On NCCL the tensor travels on the current CUDA device."""
    if world_size == 1:
        return [float(v) for v in values]
    import torch.distributed as dist

    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return [float(v) for v in tensor.cpu()]


def all_gather_objects(obj: Any, world_size: int) -> list[Any]:
    """``obj`` of every rank, by rank (``[obj]`` on one rank)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
