"""A checkout anywhere: the local cluster's pods see the project's checkout and virtual
environment at their own paths, also under ``/tmp``, which every pod's private ``/tmp``
covers (a clone under /tmp once failed every cluster test with ``stppo: not found``).

A real network namespace and mount namespace, as the cluster's pods run (uid 1000, private
``/tmp``): a script in a "checkout" under this test's temporary directory (under /tmp) runs
in the pod when the image mounts are made, and is hidden without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from local_cluster.cluster import (
    ClusterError,
    Pod,
    check_image_visible,
    image_paths,
    pod_command,
)
from local_cluster.netns import Network, netns_unavailable, remove_all

PREFIX = "stimg"


@pytest.fixture
def host(tmp_path: Path):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    remove_all(PREFIX)
    network = Network(PREFIX, "10.213.77.0/24", tmp_path / "pods").up()
    try:
        yield network.add_host("pod")
    finally:
        network.down()


def run_in_pod(host, script: Path, image: list[Path]) -> subprocess.CompletedProcess:
    private_tmp = host.root / "tmp"
    private_tmp.mkdir(parents=True, exist_ok=True)
    pod = Pod("pod", "client", host.ip, [sys.executable, str(script)], {"HOME": "/tmp"},
              {"/tmp": str(private_tmp)})  # fmt: skip
    argv = pod_command(host, pod, 1000, (), image=image)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_a_checkout_under_tmp_is_visible_in_the_pod(host, tmp_path: Path):
    assert str(tmp_path).startswith("/tmp/")
    checkout = tmp_path / "clone" / "st-ppo"
    checkout.mkdir(parents=True)
    script = checkout / "hello.py"
    script.write_text("import os; print('hello from', os.getuid())\n")
    os.chmod(checkout, 0o755)
    # the project's own image (checkout and venv) runs the interpreter: this test's clone
    # may live under /tmp too (a CI checkout there once failed here, "python: not found")
    project = image_paths()
    seen = run_in_pod(host, script, image=[checkout, *project])
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip() == "hello from 1000"
    # without the checkout's mount the pod's private /tmp hides it (what pods used to do)
    hidden = run_in_pod(host, script, image=project)
    assert hidden.returncode != 0 and f"{script}': [Errno 2] No such file" in hidden.stderr


def test_a_checkout_the_pods_cannot_enter_is_refused_before_any_pod_starts(tmp_path: Path):
    home = Path("/var/tmp") / f"stppo-image-test-{os.getpid()}"
    try:
        (home / "closed" / "st-ppo").mkdir(parents=True)
        os.chmod(home / "closed", 0o700)
        with pytest.raises(ClusterError, match=r"cannot enter .*/closed \(mode 0o700\)"):
            check_image_visible([home / "closed" / "st-ppo"])
        os.chmod(home / "closed", 0o755)
        check_image_visible([home / "closed" / "st-ppo"])
        # under a private directory a path is bound back into the pod: no traversal needed
        check_image_visible([tmp_path / "anything"])
    finally:
        subprocess.run(["rm", "-rf", str(home)], check=False)
