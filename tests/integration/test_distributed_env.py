"""A process started by one that already holds a single-process group (a Ray actor started
from a test session that built a Learner) inherits MASTER_PORT; it must not try to listen
on its parent's live port (EADDRINUSE broke every later learner actor in one CI run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

CHILD = (
    "from learner.distributed import init_single_process_distributed as i; print(i().master_port)"
)

PARENT = textwrap.dedent(
    f"""
    import os, subprocess, sys
    from learner.distributed import init_single_process_distributed
    info = init_single_process_distributed()
    child = subprocess.run([sys.executable, "-c", {CHILD!r}], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-2000:]
    assert int(child.stdout.strip().splitlines()[-1]) != info.master_port
    print("ok")
    """
)


def test_child_of_an_initialised_process_picks_its_own_port():
    out = subprocess.run(
        [sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


ALONE = textwrap.dedent(
    """
    import deepspeed.comm.comm as comm
    from learner.distributed import find_free_port, init_rank_distributed
    from learner.distributed import init_single_process_distributed
    if {group!r}:  # a learner group of one rank (the main job's learner)
        info = init_rank_distributed(0, 1, "127.0.0.1", find_free_port())
    else:
        info = init_single_process_distributed()
    assert info.world_size == 1
    assert comm.cdb.shm_comm_op is None, comm.cdb.shm_comm_op
    print("ok")
    """
)


@pytest.mark.parametrize("group", [False, True])
def test_a_single_rank_does_not_build_the_shared_memory_allreduce(group):
    """DeepSpeed's CPU backend compiles its shared-memory allreduce op at start (minutes
    on a 2-core machine, once per checkout); a lone rank has nothing to reduce."""
    out = subprocess.run([sys.executable, "-c", ALONE.format(group=group)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    assert "deepspeed_shm_comm" not in out.stdout + out.stderr  # never built, never loaded
