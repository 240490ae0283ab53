"""Where a process-group member listens, and joining a group that says who is missing.

Two process groups cross nodes: the weight-sync group (:mod:`actors.weight_group`) and the
learner group (:func:`learner.distributed.init_rank_distributed`). Both are gloo on CPU and
nccl on CUDA, and both would otherwise pick their listening address from the machine's
*hostname*: gloo's default device resolves ``gethostname()``, and where that name is not
in DNS or maps to 127.0.1.1 (stock Debian/Ubuntu ``/etc/hosts``, many containers) it falls
back to loopback, advertises 127.0.0.1 to its peers, and every peer then waits for a
connection that never comes, silently, until the collective timeout.

So every member binds to the address Ray already knows for its node (:func:`node_ip`):
the weight-sync group builds its gloo device for that address
(:func:`gloo_device`), and the learner group sets ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` to the interface that holds it (:func:`socket_ifname_env`). A
variable the user set wins.

Joining is bounded and visible: each member writes ``stppo/joined/<rank>`` (its address
and device) into the group's store before it connects to its peers, with a short join
timeout separate from the per-collective one; :func:`joined_members` reads who has, and
:class:`GroupJoinError` names the members that did not join, their addresses, and the
variable to set. Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import sys
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

NODE_IP_ENV = "STPPO_NODE_IP"
"""Overrides the node address outside Ray (tests, hand-started processes)."""

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915


def node_ip() -> str:
    """The address other nodes reach this process at.

    In order: ``STPPO_NODE_IP``; inside a Ray worker, Ray's node IP (what ``ray start
    --node-ip-address`` set or Ray detected: the address the cluster already uses for this
    node); else the address of the default route; else ``127.0.0.1`` (one host).
    """
    if os.environ.get(NODE_IP_ENV):
        return os.environ[NODE_IP_ENV]
    ray = sys.modules.get("ray")  # never import Ray here: only ask it if this is a worker
    if ray is not None:
        with contextlib.suppress(Exception):
            if ray.is_initialized():
                return str(ray.util.get_node_ip_address())
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.254.254.254", 1))  # no packet is sent: only picks the route
        return s.getsockname()[0]
    return "127.0.0.1"


def advertised_host(bind_host: str) -> str:
    """The host to put in a URL for a server bound to ``bind_host``: the node's address
    (:func:`node_ip`) for a wildcard bind (``0.0.0.0``, ``::``, empty), which another pod
    could not use; else ``bind_host`` itself."""
    return node_ip() if bind_host in ("0.0.0.0", "::", "") else bind_host


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding IPv4 address ``ip`` (None if none does).

    Linux: asks each interface for its address (``SIOCGIFADDR``)."""
    if ip.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(reply[20:24]) == ip:
                return name
    return None


def socket_ifname_env(ip: str, backend: str) -> dict[str, str]:
    """The ``GLOO_SOCKET_IFNAME`` (and for nccl ``NCCL_SOCKET_IFNAME``) that make the
    default process group listen on the interface holding ``ip``; variables already in the
    environment are left out (the user's choice wins), and so is everything when no
    interface holds ``ip``.

    Returns:
        name -> value of the variables to set.
    """
    wanted = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if backend == "nccl" else [])
    ifname = interface_of(ip)
    if ifname is None:
        return {}
    return {name: ifname for name in wanted if not os.environ.get(name)}


def gloo_device(ip: str) -> tuple[dist.ProcessGroupGloo.Device, str]:
    """A gloo device listening on ``ip`` (or on ``GLOO_SOCKET_IFNAME`` where the user set
    it), and a description of the choice for logs and errors."""
    user = os.environ.get("GLOO_SOCKET_IFNAME")
    if user:
        first = user.split(",")[0]
        return dist.ProcessGroupGloo.create_device(
            interface=first
        ), f"interface {first} (GLOO_SOCKET_IFNAME)"
    return dist.ProcessGroupGloo.create_device(hostname=ip), f"{ip} (node IP)"


def _key(rank: int) -> str:
    return f"stppo/joined/{rank}"


def register(store: dist.Store, rank: int, info: Mapping[str, object]) -> None:
    """Record in the group's store that ``rank`` reached it, with ``info`` (its address)."""
    store.set(_key(rank), json.dumps(dict(info)))


def joined_members(store: dist.Store, world_size: int) -> dict[int, dict]:
    """Rank -> the info of every member that has registered so far (never blocks)."""
    members = {}
    for rank in range(world_size):
        key = _key(rank)
        if store.check([key]):
            members[rank] = json.loads(store.get(key))
    return members


class GroupJoinError(RuntimeError):
    """A process group did not form within its join timeout.

    Attributes:
        missing: ranks that never reached the store.
        joined: rank -> registered info of the ranks that did.
        cause: the underlying error's first line.
    """

    def __init__(
        self,
        what: str,
        world_size: int,
        timeout_s: float,
        joined: Mapping[int, Mapping],
        names: Mapping[int, str] | None = None,
        cause: str = "",
    ) -> None:
        names = dict(names or {})
        self.what, self.world_size, self.timeout_s = what, world_size, timeout_s
        self.names = names
        self.cause = cause
        self.joined = dict(joined)
        self.missing = [r for r in range(world_size) if r not in self.joined]
        label = {r: names.get(r, f"rank {r}") for r in range(world_size)}
        parts = [f"{what} did not form within the join timeout ({timeout_s:g} s):"]
        if self.missing:
            parts.append(
                "Did not join: " + ", ".join(label[r] for r in self.missing)
                + " (never reached the group's store: is its process alive, and can it "
                "reach rank 0's address and port?)."
            )  # fmt: skip
        listening = ", ".join(
            f"{label[r]} at {info.get('address', '?')}" for r, info in sorted(self.joined.items())
        )
        if listening:
            parts.append(f"Joined the store: {listening}.")
        loopback = [
            label[r] for r, i in self.joined.items() if str(i.get("ip", "")).startswith("127.")
        ]
        if loopback and len(self.joined) > 1:
            parts.append(
                f"{', '.join(loopback)} listen(s) on loopback, which other nodes cannot reach"
            )
        parts.append(
            "Each member listens on its node IP; where that is not the right interface, set "
            "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME for nccl) to it on every node, or "
            f"{NODE_IP_ENV} to the address to use."
        )
        if cause:
            parts.append(f"(last error: {cause})")
        super().__init__(" ".join(parts))

    def __reduce__(self):  # picklable with its fields (it crosses Ray's process boundary)
        args = (self.what, self.world_size, self.timeout_s, self.joined, self.names, self.cause)
        return (type(self), args)


def connect_store(
    host: str, port: int, rank: int, timeout_s: float, store: dist.TCPStore | None = None
) -> dist.TCPStore:
    """Rank 0: its bound ``store`` (timeout set to ``timeout_s``); other ranks: a client of
    ``host:port``, connecting for at most ``timeout_s``.

    Raises:
        GroupJoinError-worthy ``DistStoreError`` / ``RuntimeError``: rank 0's store was not
        reachable within ``timeout_s`` (the caller names the group).
    """
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        store.set_timeout(timeout)
        return store
    return dist.TCPStore(host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False)


def bind_master_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """Rank 0's ``TCPStore``, listening now on every interface on a port the OS picks
    (port 0; read it back with ``.port``), so no other process can take the port between
    picking and binding it."""
    return dist.TCPStore(
        "0.0.0.0", 0, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
