"""Faults on the local cluster that cost more than the default suite's budget (issue 28).

Marked ``faults`` and left out of ``make test`` (pyproject's ``-m "not faults"``); run them
with ``.venv/bin/pytest -m faults tests/integration/test_cluster_faults.py`` (as root). Each
brings up its own cluster (:class:`local_cluster.cluster.LocalCluster`), runs the synthetic
job from the client pod, and breaks one pod mid-run; the measured outcomes are in
deploy/README.md, "Run the cluster locally".
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from local_cluster.cluster import LocalCluster
from local_cluster.netns import netns_unavailable

pytestmark = pytest.mark.faults


@pytest.fixture
def cluster(tmp_path):
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    c = LocalCluster(tmp_path / "cluster", prefix="stf", subnet="10.213.10.0/24")
    c.up(timeout_s=420)
    yield c
    c.down(keep_logs=True)  # logs stay under the test's tmp_path for a post-mortem


def _submit(cluster: LocalCluster, name: str, *overrides: str):
    log = cluster.state_dir / "logs" / f"job-{name}-{time.monotonic_ns()}.log"
    argv = cluster.submit_command(
        ["stppo", "train", "@/configs/k8s_synthetic.toml", f"run.name={name}", *overrides]
    )
    return cluster.popen("client", argv, log), log


def _records(cluster: LocalCluster, name: str, file: str) -> list[dict]:
    path = cluster.state_dir / "shared" / "runs" / name / file
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_steps(cluster, name, n, proc, log, timeout=400):
    deadline = time.monotonic() + timeout
    while len(_records(cluster, name, "steps.jsonl")) < n:
        assert proc.poll() is None, f"job ended ({proc.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"not {n} steps:\n{log.read_text()[-4000:]}"
        time.sleep(1.0)


def _stall(steps: list[dict]) -> str:
    """The longest step against the median one (seconds): what the fault cost the run."""
    walls = sorted(s["wall_s"] for s in steps)
    return f"longest step {walls[-1]:.1f} s, median {walls[len(walls) // 2]:.1f} s"


def test_retrieval_pod_dies_and_comes_back(cluster):
    proc, log = _submit(cluster, "retr", "run.num_steps=20", "sft.enabled=false")
    _wait_steps(cluster, "retr", 3, proc, log)
    cluster.restart("retrieval", down_s=10.0)
    assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    steps = _records(cluster, "retr", "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 21))
    # searches in flight were retried until the server was back: none became an empty result
    assert sum(s["num_excluded_retrieval_failed"] for s in steps) == 0
    assert (cluster.state_dir / "logs" / "retrieval.log").read_text().count("Uvicorn running") >= 2
    print(f"retrieval pod down 10 s: exit 0, 20 steps, {_stall(steps)}")


def test_learner_pod_dies_then_resume_on_a_new_one(cluster):
    proc, log = _submit(cluster, "lrn", "run.num_steps=30", "sft.enabled=false")
    _wait_steps(cluster, "lrn", 5, proc, log)
    lost_at = time.monotonic()
    cluster.kill("learner-0")
    rc = proc.wait(timeout=300)
    stopped_s = time.monotonic() - lost_at
    text = log.read_text()
    assert rc != 0
    assert "Last checkpoint: /shared/runs/lrn/checkpoints/step_" in text, text[-4000:]
    print(f"learner pod lost: the run stopped after {stopped_s:.0f} s")
    before = [s["step"] for s in _records(cluster, "lrn", "steps.jsonl")]

    checkpoint = int(text.split("Last checkpoint: /shared/runs/lrn/checkpoints/step_")[1][:6])

    replaced_at = time.monotonic()
    cluster.add_replacement("learner")
    proc, log = _submit(cluster, "lrn", "run.num_steps=30", "sft.enabled=false")
    deadline = time.monotonic() + 400
    while f"[step {checkpoint + 1}/" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(1.0)
    recovered_s = time.monotonic() - replaced_at
    assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    steps = [s["step"] for s in _records(cluster, "lrn", "steps.jsonl")]
    assert steps == list(range(1, 31)), (before, steps)
    ids = [i for r in _records(cluster, "lrn", "consumed.jsonl") for i in r["ids"]]
    assert len(ids) == len(set(ids)) == 30 * 8
    print(
        f"learner pod lost after step {before[-1]}: stopped in {stopped_s:.0f} s naming "
        f"checkpoint step {checkpoint}; new pod + resubmit: step {checkpoint + 1} after "
        f"{recovered_s:.0f} s; steps {before[-1] - checkpoint} redone, 0 lost, ids twice 0"
    )


def test_rollout_pod_partition_of_15_s(cluster):
    proc, log = _submit(cluster, "part", "run.num_steps=40", "sft.enabled=false")
    _wait_steps(cluster, "part", 3, proc, log)
    cut = threading.Thread(target=cluster.partition, args=("rollout-1", 15.0))
    cut.start()
    cut.join()
    rc = proc.wait(timeout=600)
    text = log.read_text()
    steps = [s["step"] for s in _records(cluster, "part", "steps.jsonl")]
    # either outcome is acceptable, never a hang: it survives, or it stops with a clear error
    if rc == 0:
        assert steps == list(range(1, 41))
    else:
        assert "Error" in text, text[-4000:]
    lost = len(re.findall(r"rollout actor \d+ (?:lost|did not answer)", text))
    print(
        f"partition outcome: exit {rc}, steps {steps[-1] if steps else 0}, actor marked lost "
        f"{lost} time(s), {_stall(_records(cluster, 'part', 'steps.jsonl'))}"
    )
