"""Hosts on one machine: Linux network namespaces joined by a bridge, each with its own IP.

The building block of the local cluster (:mod:`local_cluster.cluster`) and of the tests
that cross a network. Each :class:`Host` is a network namespace with one veth interface
(``eth0``) on a private bridge, an address in a subnet that exists only inside these
namespaces, its own loopback, **no default route**, and its own ``/etc/hosts`` and
``/etc/resolv.conf`` (``ip netns exec`` bind-mounts ``/etc/netns/<name>/*`` over ``/etc``):
the names it resolves are the ones given (Service names, like cluster DNS), and the
machine's hostname is not among them, so code that picks an address from the hostname or
the default route fails here as it would in a pod whose hostname is not in DNS. Nothing
is routed off the bridge: traffic never leaves the machine.

:meth:`Host.popen` runs a command inside the namespace, optionally in a private mount
namespace (``unshare -m``) whose ``/tmp`` and ``$HOME`` are the host's own directories,
and as another user (``setpriv``), as a restricted pod runs its container.

Needs root and iproute2 (``ip``); :func:`netns_unavailable` says why not, for skips.
Everything made is named with the :class:`Network`'s prefix, so :meth:`Network.down` (and
:func:`remove_all`) remove it even after a failed start.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ETC_NETNS = Path("/etc/netns")


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can): the reason starts
    with ``netns:`` (the skip category of ``tests/conftest.py``)."""
    if os.geteuid() != 0:
        return "netns: network namespaces need root"
    for tool in ("ip", "unshare", "setpriv"):
        if shutil.which(tool) is None:
            return f"netns: `{tool}` is not installed (iproute2 / util-linux)"
    probe = f"stppo-probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"netns: `ip netns add` failed: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


@dataclass
class Host:
    """One network namespace on the bridge (a "pod" or a "node").

    Attributes:
        name: short name (``head``, ``rollout-0``); the namespace is ``<prefix>-<name>``.
        netns: the namespace's name.
        ip: its address on the bridge (its only non-loopback address).
        interface: the name of that interface inside the namespace (``eth0``).
        root: a private directory for this host (its ``/tmp``, ``$HOME``; see :meth:`popen`).
        processes: everything :meth:`popen` started, killed by :meth:`kill_all`.
    """

    name: str
    netns: str
    ip: str
    host_veth: str
    interface: str = "eth0"
    root: Path = Path("/nonexistent")
    processes: list[subprocess.Popen] = field(default_factory=list)

    def write_hosts(self, names: dict[str, str]) -> None:
        """This host's ``/etc/hosts``: localhost, its own name, and ``names`` (name -> IP).
        The machine's hostname is deliberately absent."""
        lines = ["127.0.0.1 localhost", f"{self.ip} {self.name}"]
        lines += [f"{ip} {name}" for name, ip in sorted(names.items())]
        folder = ETC_NETNS / self.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("\n".join(lines) + "\n")
        # no nameserver reachable: lookups of unknown names fail at once instead of timing out
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def command(
        self,
        argv: list[str],
        uid: int | None = None,
        private_mounts: dict[str, Path] | None = None,
    ) -> list[str]:
        """The argv that runs ``argv`` inside this host (see :meth:`popen`)."""
        inner = shlex.join(argv)
        if uid is not None:
            inner = f"exec setpriv --reuid={uid} --regid={uid} --clear-groups {inner}"
        else:
            inner = f"exec {inner}"
        if private_mounts:
            binds = " && ".join(
                f"mkdir -p {shlex.quote(str(target))} && "
                f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}"
                for target, source in private_mounts.items()
            )
            return [
                "ip", "netns", "exec", self.netns,
                "unshare", "-m", "--propagation", "private",
                "sh", "-c", f"{binds} && {inner}",
            ]  # fmt: skip
        return ["ip", "netns", "exec", self.netns, "sh", "-c", inner]

    def popen(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        uid: int | None = None,
        private_mounts: dict[str, Path] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` in this host's network namespace.

        Args:
            argv: the command.
            env: its whole environment (None: this process's).
            uid: run as this user and group id (``setpriv``), like ``runAsUser``.
            private_mounts: mount-namespace binds, target path -> source directory (e.g.
                ``{"/tmp": host.root / "tmp"}``): only this command sees them.
            log: file for stdout and stderr (None: inherited).
            cwd: working directory.

        Returns:
            The process (its own process group, so :meth:`kill_all` reaches its children).
        """
        out = open(log, "ab") if log is not None else None  # noqa: SIM115 (the child owns it)
        try:
            proc = subprocess.Popen(
                self.command(argv, uid, private_mounts),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if out is not None:
                out.close()
        self.processes.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside the namespace to completion (stdout/stderr captured)."""
        return subprocess.run(
            self.command(argv, kwargs.pop("uid", None), kwargs.pop("private_mounts", None)),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def pids(self) -> list[int]:
        """Every process whose network namespace is this host's (``ip netns pids``)."""
        out = _run(["ip", "netns", "pids", self.netns], check=False)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Kill every process in this namespace (what losing the node does to them)."""
        for proc in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.processes = []

    def link(self, up: bool) -> None:
        """Bring this host's interface up or down (a node falling off the network)."""
        state = "up" if up else "down"
        _run(["ip", "-n", self.netns, "link", "set", self.interface, state])
        _run(["ip", "link", "set", self.host_veth, state])


class Network:
    """A bridge and the hosts on it.

    Args:
        prefix: names of everything made (namespaces ``<prefix>-<host>``, the bridge
            ``<prefix>-br``; at most 8 characters, interface names are short).
        subnet: a private /24 that exists only on this bridge (hosts get .2, .3, ...).
        state_dir: the hosts' private directories live under here.

    Raises:
        RuntimeError: an ``ip`` command failed (the message is its stderr).
    """

    def __init__(self, prefix: str, subnet: str, state_dir: Path) -> None:
        if len(prefix) > 8 or not prefix.replace("-", "").isalnum():
            raise ValueError(f"prefix {prefix!r}: at most 8 letters/digits")
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
        if not self.subnet.is_private or self.subnet.prefixlen != 24:
            raise ValueError(f"subnet {subnet}: need a private /24")
        self.bridge = f"{prefix}-br"
        self.state_dir = state_dir
        self.hosts: dict[str, Host] = {}
        self._next = 2

    def up(self) -> Network:
        """Create the bridge (idempotent)."""
        if _run(["ip", "link", "show", self.bridge], check=False).returncode != 0:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        return self

    def add_host(self, name: str, ip: str | None = None) -> Host:
        """A new namespace on the bridge, up, with its own address and hosts file.

        Args:
            name: short host name (unique in this network).
            ip: its address (None: the next free one in the subnet).
        """
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        if ip is None:
            ip = str(self.subnet.network_address + self._next)
            self._next += 1
        index = len(self.hosts)
        netns = f"{self.prefix}-{name}"
        host_veth = f"{self.prefix}v{index}"
        peer = f"{self.prefix}p{index}"
        host = Host(name, netns, ip, host_veth, root=self.state_dir / name)
        host.root.mkdir(parents=True, exist_ok=True)
        _run(["ip", "netns", "add", netns])
        self.hosts[name] = host
        _run(["ip", "link", "add", host_veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "netns", netns])
        _run(["ip", "-n", netns, "link", "set", peer, "name", host.interface])
        _run(["ip", "link", "set", host_veth, "master", self.bridge])
        _run(["ip", "link", "set", host_veth, "up"])
        _run(["ip", "-n", netns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0"])
        _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        host.write_hosts({})
        return host

    def publish_names(self, extra: dict[str, str] | None = None) -> None:
        """Every host's ``/etc/hosts`` lists every host by name, plus ``extra`` names
        (Service name -> IP)."""
        names = {h.name: h.ip for h in self.hosts.values()}
        names.update(extra or {})
        for host in self.hosts.values():
            host.write_hosts({k: v for k, v in names.items() if k != host.name})

    def remove_host(self, name: str) -> None:
        """Kill the host's processes and delete its namespace and veth."""
        host = self.hosts.pop(name)
        host.kill_all()
        _run(["ip", "netns", "del", host.netns], check=False)
        _run(["ip", "link", "del", host.host_veth], check=False)
        shutil.rmtree(ETC_NETNS / host.netns, ignore_errors=True)

    def down(self) -> None:
        """Remove every host, then the bridge (and anything else with this prefix)."""
        for name in list(self.hosts):
            self.remove_host(name)
        remove_all(self.prefix)


def remove_all(prefix: str) -> list[str]:
    """Delete every namespace, veth and bridge named ``<prefix>-*`` / ``<prefix>v*``,
    killing the processes inside first; works without the :class:`Network` object (after a
    crash). Returns what was removed."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        netns = line.split()[0] if line.strip() else ""
        if not netns.startswith(f"{prefix}-"):
            continue
        for pid in _run(["ip", "netns", "pids", netns], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _run(["ip", "netns", "pids", netns], check=False).stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        _run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)
        removed.append(netns)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith((f"{prefix}v", f"{prefix}-br")):
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed
