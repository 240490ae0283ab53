"""Issue 33 end to end: a run stopped by SIGTERM checkpoints and exits 75, the Ray job is
FAILED (not SUCCEEDED), and submitting it again with ``run.resume = "auto"`` (what the
RayJob's ``spec.backoffLimit`` retry does, on the same cluster) continues the run: every
step is in the records once, every trajectory id once.

The cluster is a local ``ray start --head --block`` (what the KubeRay head runs), jobs go
through Ray's job API as KubeRay's submitter sends them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_driver import read_jsonl, tiny_run_config

from services.config import RunConfig
from services.env import CACHE_ROOT, PROJECT_ROOT

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def cli_overrides(cfg: RunConfig, drop: tuple[str, ...] = ()) -> list[str]:
    """``dotted.key=value`` arguments that make the default config into ``cfg``."""
    want = _leaves(cfg.model_dump(mode="json"))
    default = _leaves(RunConfig().model_dump(mode="json"))
    return [
        f"{k}={json.dumps(v)}"
        for k, v in want.items()
        if v != default.get(k) and v is not None and k not in drop
    ]


def _start_head(tmp_path: Path, attempt: int) -> tuple[subprocess.Popen, str, Path]:
    """``ray start --head --block`` on free ports: ``(process, dashboard url, its log)``."""
    temp_dir = CACHE_ROOT / f"rc{os.getpid()}"  # Ray's socket paths must stay short
    dashboard = _free_port()
    ports = {
        "--port": _free_port(),
        "--dashboard-port": dashboard,
        "--dashboard-agent-listen-port": _free_port(),
        "--dashboard-agent-grpc-port": _free_port(),
        "--metrics-export-port": _free_port(),
        "--runtime-env-agent-port": _free_port(),
        "--ray-client-server-port": _free_port(),
        "--node-manager-port": _free_port(),
        "--object-manager-port": _free_port(),
    }
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
           "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--temp-dir={temp_dir}", *(f"{k}={v}" for k, v in ports.items())]  # fmt: skip
    log_path = tmp_path / f"ray_head_{attempt}.log"
    with log_path.open("w") as log:
        head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    return head, f"http://127.0.0.1:{dashboard}", log_path


def _stop_head(head: subprocess.Popen) -> None:
    head.send_signal(signal.SIGTERM)  # --block: stops the processes it started
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()


@pytest.fixture
def local_ray_cluster(tmp_path: Path):
    """The dashboard url of a 2-CPU head started for this test and stopped (by its pid,
    with the processes it started) at the end. A head that exits while it starts is
    started once more: Ray gives its raylet a fixed 30 s to register with the GCS, and a
    loaded 2-core machine once missed that in CI ("The current node timed out during
    startup"; ``ray/_private/node.py``)."""
    from ray.job_submission import JobSubmissionClient

    head = None
    try:
        for attempt in (1, 2):
            head, url, log_path = _start_head(tmp_path, attempt)
            # Ready = a job can be submitted: the dashboard answers list_jobs before its job
            # agent has registered, and a submission then gets HTTP 500 "No available agent
            # to submit job" (seen under load in a CI run).
            deadline = time.monotonic() + 180
            while head.poll() is None and time.monotonic() < deadline:
                try:
                    client = JobSubmissionClient(url)
                    probe = client.submit_job(entrypoint="true")
                    break
                except Exception:
                    time.sleep(1)
            else:
                if head.poll() is not None and attempt == 1:
                    continue  # it exited while starting: once more
                raise RuntimeError(f"ray head did not come up: {log_path.read_text()}")
            break
        _wait_job(client, probe, 120)
        yield url
    finally:
        if head is not None:
            _stop_head(head)


def _wait_job(client, job_id: str, timeout_s: float):
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not done after {timeout_s} s: {client.get_job_logs(job_id)}")


def test_sigterm_exits_75_and_the_retried_job_resumes_the_run(
    tmp_path: Path, tiny_llama_dir: Path, local_ray_cluster: str
):
    from ray.job_submission import JobStatus, JobSubmissionClient

    num_steps, batch = 4, 4
    extra = {"run.num_steps": num_steps, "run.eval_questions": 0,
             "checkpoint.every_k_steps": 1, "run.resume": "auto",
             "learner.train_batch_size": batch}  # fmt: skip
    cfg = tiny_run_config(tmp_path, tiny_llama_dir, **extra)
    run_dir = cfg.run_dir
    # joining the cluster, as on KubeRay (which refuses ray.num_cpus)
    overrides = [*cli_overrides(cfg, drop=("ray.num_cpus",)), 'ray.address="auto"']
    args = " ".join(f"'{a}'" for a in overrides)
    pid_file = tmp_path / "pid"
    # the shell's pid is the driver's after exec: SIGTERM reaches stppo train itself
    entrypoint = f"echo $$ > {pid_file}; exec {sys.executable} -m services.cli train {args}"
    client = JobSubmissionClient(local_ray_cluster)

    first = client.submit_job(entrypoint=entrypoint)
    deadline = time.monotonic() + 600
    while len(read_jsonl(run_dir / "steps.jsonl")) < 2:
        status = client.get_job_status(first)
        assert status == JobStatus.RUNNING or status == JobStatus.PENDING, client.get_job_logs(
            first
        )
        assert time.monotonic() < deadline, "no step 2 in 600 s"
        time.sleep(0.2)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)  # an eviction, a kubectl delete
    assert _wait_job(client, first, 300) == JobStatus.FAILED  # not SUCCEEDED: retried
    info, logs = client.get_job_info(first), client.get_job_logs(first)
    assert "exit code 75" in info.message, info.message
    assert "interrupted at step" in logs and "resume with: stppo train" in logs, logs[-2000:]
    stopped_at = len(read_jsonl(run_dir / "steps.jsonl"))
    assert 2 <= stopped_at < num_steps, "the run was not stopped before its end"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:06d}"  # the step in progress finished, then saved
    assert not [e for e in read_jsonl(run_dir / "eval.jsonl") if e["tag"] == "end"]

    second = client.submit_job(entrypoint=entrypoint)  # the RayJob's retry: same command
    assert _wait_job(client, second, 600) == JobStatus.SUCCEEDED, client.get_job_logs(second)

    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, num_steps + 1))
    assert len({s["run_id"] for s in steps}) == 1
    assert [s["attempt"] for s in steps] == [1] * stopped_at + [2] * (num_steps - stopped_at)
    consumed = read_jsonl(run_dir / "consumed.jsonl")
    assert [c["step"] for c in consumed] == list(range(1, num_steps + 1))
    ids = [i for c in consumed for i in c["ids"]]
    assert len(ids) == num_steps * batch and len(set(ids)) == len(ids)
    assert all(i.startswith(f"a{c['attempt']}-") for c in consumed for i in c["ids"])
    lineage = json.loads((run_dir / "run.json").read_text())
    assert [a["resumed_at_step"] for a in lineage["attempts"]] == [0, stopped_at]
    state = json.loads((run_dir / "checkpoints" / "latest").parent.joinpath(
        f"step_{num_steps:06d}", "driver_state.json").read_text())  # fmt: skip
    assert state["trajectories_consumed"] == num_steps * batch
