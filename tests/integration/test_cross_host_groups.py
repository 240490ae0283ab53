"""Process groups across hosts whose hostname does not resolve (issue 36).

Each host is a network namespace on a private bridge (:mod:`local_cluster.netns`): its own IP,
no default route, and an ``/etc/hosts`` without the machine's hostname, as in a container
whose hostname is not in DNS. gloo's default device resolves the hostname, falls back to
loopback and advertises 127.0.0.1, so a group formed that way never connects; every member
must listen on its node IP instead (:mod:`actors.rendezvous`). The node IP is what Ray
reports inside a Ray worker; these processes are not Ray workers, so it is given as
``STPPO_NODE_IP`` (the whole job on a Ray cluster across namespaces is
``test_local_cluster.py``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_cluster.netns import Network, netns_unavailable, remove_all

from services.env import PROJECT_ROOT

MEMBER = Path(__file__).with_name("cross_host_member.py")
PREFIX = "stx"


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    remove_all(PREFIX)
    net = Network(PREFIX, "10.213.7.0/24", tmp_path_factory.mktemp("hosts")).up()
    for name in ("a", "b", "c"):
        net.add_host(name)
    net.publish_names()
    yield net
    net.down()


def _member(host, group: str, rank: int, world: int, master: str, port: int, join_timeout=90.0):
    env = dict(os.environ)
    env["STPPO_NODE_IP"] = host.ip
    env.pop("GLOO_SOCKET_IFNAME", None)
    argv = [sys.executable, str(MEMBER), group, str(rank), str(world), master, str(port)]
    argv += ["--join-timeout", str(join_timeout)]
    return subprocess.Popen(
        host.command(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=PROJECT_ROOT,
    )  # fmt: skip


def _read_port(proc) -> int:
    for line in proc.stdout:
        if line.startswith("PORT "):
            return int(line.split()[1])
    raise AssertionError(f"rank 0 printed no port (exit {proc.wait()})")


def _finish(procs, timeout=90) -> list[str]:
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += "\n<killed: still running>"
        outs.append(out)
    return outs


def test_hostname_does_not_resolve_inside_the_hosts(network):
    a = network.hosts["a"]
    probe = a.run(
        [sys.executable, "-c", f"import socket; socket.gethostbyname({socket.gethostname()!r})"]
    )
    assert probe.returncode != 0, "the machine's hostname resolves inside the namespace"
    route = a.run(["ip", "route", "show", "default"])
    assert route.stdout.strip() == "", route.stdout


def test_weight_group_across_hosts(network):
    a, b, c = (network.hosts[n] for n in "abc")
    rank0 = _member(a, "weight", 0, 3, a.ip, 0)
    port = _read_port(rank0)
    others = [_member(h, "weight", r, 3, a.ip, port) for r, h in ((1, b), (2, c))]
    outs = _finish([rank0, *others])
    for proc, out in zip([rank0, *others], outs, strict=True):
        assert proc.returncode == 0 and "OK" in out, out
    assert "received version 7" in outs[1]


def test_learner_group_across_hosts(network):
    a, b = network.hosts["a"], network.hosts["b"]
    port = 29571
    procs = [_member(a, "learner", 0, 2, a.ip, port), _member(b, "learner", 1, 2, a.ip, port)]
    outs = _finish(procs)
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and "all-reduce 3" in out, out


def test_member_that_never_joins_is_named_within_the_join_timeout(network):
    a = network.hosts["a"]
    started = time.monotonic()
    rank0 = _member(a, "weight", 0, 3, a.ip, 0, join_timeout=6.0)
    port = _read_port(rank0)
    rank1 = _member(network.hosts["b"], "weight", 1, 3, a.ip, port, join_timeout=6.0)
    outs = _finish([rank0, rank1], timeout=60)
    elapsed = time.monotonic() - started
    assert rank0.returncode == 3, outs[0]
    assert "JOIN-ERROR" in outs[0] and "Did not join: rank 2" in outs[0], outs[0]
    assert f"rank 1 at {network.hosts['b'].ip}" in outs[0], outs[0]  # who did join, and where
    assert "GLOO_SOCKET_IFNAME" in outs[0]
    assert elapsed < 6.0 + 25, f"the error took {elapsed:.0f} s"


def test_learner_rank_that_never_joins_is_named(network):
    a = network.hosts["a"]
    rank0 = _member(a, "learner", 0, 2, a.ip, 29572, join_timeout=6.0)
    (out,) = _finish([rank0], timeout=60)
    assert rank0.returncode == 3, out
    assert "learner group" in out and "Did not join: rank 1" in out, out
