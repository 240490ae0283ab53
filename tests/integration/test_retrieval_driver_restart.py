"""The whole service with its managed retrieval server killed (SIGKILL) mid-run: real Ray
local cluster, DeepSpeed learner, rollout actors on the tiny Llama. The supervisor restarts
the server, the run finishes every step, the restart is counted, and no trajectory failed
its search (so none was dropped and replaced by one that never searched)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from test_driver import RunInThread, read_jsonl, tiny_run_config

pytestmark = pytest.mark.integration


def test_run_recovers_when_the_retrieval_server_is_killed(tmp_path: Path, tiny_llama_dir: Path):
    cfg = tiny_run_config(
        tmp_path,
        tiny_llama_dir,
        **{
            "run.num_steps": 3,
            "rollout.num_actors": 1,
            "retrieval.supervisor.poll_interval_s": 0.2,
        },
    )
    run = RunInThread(cfg)
    run_dir = cfg.run_dir
    run.wait_for(lambda: len(read_jsonl(run_dir / "steps.jsonl")) >= 1, 600, "step 1")
    supervisor = run.driver.services.retrieval
    first_pid = supervisor.pid
    os.kill(first_pid, signal.SIGKILL)
    run.wait_for(lambda: supervisor.restarts == 1 and supervisor.up, 120, "restart")

    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error
    assert [s["step"] for s in read_jsonl(run_dir / "steps.jsonl")] == [1, 2, 3]
    assert supervisor.pid != first_pid
    metrics = run.driver.services.metrics
    assert metrics.retrieval_server_restarts_total._value.get() == 1
    assert metrics.retrieval_failed_trajectories_total._value.get() == 0
    assert "restarting (1 of 3)" in (run_dir / "driver.log").read_text()
