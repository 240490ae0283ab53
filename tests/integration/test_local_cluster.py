"""The whole job across the KubeRay topology emulated on this machine (issue 28).

:class:`local_cluster.cluster.LocalCluster` brings up the rendered cpu-demo overlay as
pods in network namespaces (head, 2 rollout workers, a learner worker, retrieval, prepare,
monitoring, client; uid 1000, private filesystems, Service names, Ray token auth), and the
RayJob's entrypoint is submitted from the client pod with ``ray job submit``. What these
tests check is what a cluster would show: the actors on their pods, the weight-sync group
across them, the records on the shared volume, Prometheus scraping every pod by IP, the
control plane reached through its Service, and a rollout pod lost and replaced mid-run.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from local_cluster.cluster import LocalCluster
from local_cluster.netns import netns_unavailable

CONFIG = "@/configs/k8s_synthetic.toml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    state_dir = Path(tmp_path_factory.mktemp("cluster"))
    c = LocalCluster(state_dir, prefix="stt", subnet="10.213.9.0/24")  # not the CLI's default
    try:
        c.up(timeout_s=420)
    except Exception:
        logs = state_dir / "logs"
        for log in sorted(logs.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-2000:]}")
        raise
    yield c
    c.down(keep_logs=False)


def _submit(cluster: LocalCluster, name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    log = cluster.state_dir / "logs" / f"job-{name}.log"
    argv = cluster.submit_command(["stppo", "train", CONFIG, f"run.name={name}", *overrides])
    return cluster.popen("client", argv, log), log


def _steps(cluster: LocalCluster, name: str) -> list[dict]:
    path = cluster.state_dir / "shared" / "runs" / name / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"job ended ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(1.0)


def test_whole_job_across_pods(cluster):
    pods = cluster._state().pods
    proc, log = _submit(cluster, "whole", "run.num_steps=8")
    _wait(lambda: len(_steps(cluster, "whole")) >= 2, 400, "2 steps", proc, log)
    # the user's control plane, from the client pod through Service stppo-control
    status = cluster.exec("client", ["stppo", "ctl", "status"], timeout=120)
    assert status.returncode == 0, status.stderr
    assert "st_ppo" in status.stdout
    changed = cluster.exec("client", ["stppo", "ctl", "set", "algorithm.variant=ppo"], timeout=120)
    assert changed.returncode == 0, changed.stderr
    set_at = len(_steps(cluster, "whole"))
    assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    text = log.read_text()

    steps = _steps(cluster, "whole")
    assert [s["step"] for s in steps] == list(range(1, 9))
    assert steps[-1]["variant"] == "ppo", [s["variant"] for s in steps]
    assert all(s["variant"] == "st_ppo" for s in steps[:set_at])
    # actors on the two rollout pods, the group formed on the learner pod's IP
    rollout_ips = {pods[n].ip for n in pods if n.startswith("rollout-")}
    placed = text.split("rollout actors on", 1)[1].splitlines()[0]
    assert {part.split(": ")[1].strip() for part in placed.split(",")} == rollout_ips, placed
    assert f"forming the weight-sync group at {pods['learner-0'].ip}:" in text
    shared = cluster.state_dir / "shared" / "runs" / "whole"
    assert (shared / "checkpoints" / "latest").exists() or any((shared / "checkpoints").iterdir())
    # the URLs the driver hands out name the head pod, not the wildcard it binds
    control = json.loads((shared / "control.json").read_text())
    assert control["url"] == f"http://{pods['head'].ip}:8365", control
    assert f"metrics: http://{pods['head'].ip}:9464/metrics" in text
    # Prometheus in the monitoring pod scraped the driver and every Ray pod over the bridge
    prom = f"http://{pods['monitoring'].ip}:9090/api/v1/query"
    up = httpx.get(prom, params={"query": "max_over_time(up[15m])"}, timeout=10).json()
    seen = {
        (r["metric"]["job"], r["metric"].get("pod", "")): r["value"][1]
        for r in up["data"]["result"]
    }
    assert seen[("stppo-driver", "")] == "1", seen
    assert seen[("stppo-retrieval", "")] == "1", seen
    ray_pods = {pod for job, pod in seen if job == "ray" and seen[(job, pod)] == "1"}
    assert {"head", "rollout-0", "rollout-1", "learner-0"} <= ray_pods, seen


def test_rollout_pod_loss_and_replacement(cluster):
    proc, log = _submit(cluster, "loss", "run.num_steps=60", "sft.enabled=false")
    _wait(lambda: len(_steps(cluster, "loss")) >= 3, 400, "3 steps", proc, log)
    cluster.kill("rollout-1")
    lost_at = time.monotonic()
    _wait(lambda: "crashed" in log.read_text(), 120, "the lost actor noticed", proc, log)
    detect_s = time.monotonic() - lost_at
    after = len(_steps(cluster, "loss"))
    _wait(
        lambda: len(_steps(cluster, "loss")) >= after + 3,
        180,
        "training on the other pod",
        proc,
        log,
    )
    replacement = cluster.add_replacement("rollout")
    new_ip = cluster._state().pods[replacement].ip
    _wait(lambda: f"is back on {new_ip}" in log.read_text(), 240, "the actor recreated", proc, log)
    assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    steps = _steps(cluster, "loss")
    assert [s["step"] for s in steps] == list(range(1, 61))
    print(f"lost pod noticed after {detect_s:.0f} s")
