"""Actor placement on a multi-node Ray cluster shaped like the KubeRay RayCluster.

The nodes are real raylets on loopback (``ray.cluster_utils.Cluster``), started with exactly
the ``rayStartParams`` the cpu-demo overlay gives each group (``num-cpus`` and the custom
``resources``), rendered with the real ``kubectl kustomize``: a head with 0 CPUs, one node
per rollout replica, one learner node. The actors are created with the options the driver
uses (``services.ray_actors.*_actor_options`` from ``deploy/configs/k8s_cpu_demo.toml``); a
tiny probe class stands in for the model-loading classes, so only placement is tested.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from services.config import load_config
from services.env import PROJECT_ROOT, configure_local_caches

pytestmark = pytest.mark.integration

OVERLAY = PROJECT_ROOT / "deploy" / "k8s" / "overlays" / "cpu-demo"
RUN_CONFIG = PROJECT_ROOT / "deploy" / "configs" / "k8s_cpu_demo.toml"


def _raycluster() -> dict:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize) is not installed")
    with tempfile.TemporaryDirectory() as tmp:  # the example token stands in for the real one
        deploy = Path(tmp) / "deploy"
        shutil.copytree(OVERLAY.parents[2], deploy, ignore=shutil.ignore_patterns("*.env"))
        base = deploy / "k8s" / "base"
        shutil.copy(base / "control-token.env.example", base / "control-token.env")
        out = subprocess.run(
            [kubectl, "kustomize", str(deploy / "k8s" / "overlays" / OVERLAY.name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    (cluster,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "RayCluster"]
    return cluster


def _node_args(start_params: dict[str, str]) -> dict:
    """``ray start`` arguments of a group's rayStartParams (KubeRay quotes the JSON once more)."""
    args: dict = {"num_cpus": int(start_params["num-cpus"])}
    if "resources" in start_params:
        args["resources"] = json.loads(json.loads(start_params["resources"]))
    return args


@pytest.fixture(scope="module")
def kuberay_shaped_cluster() -> Iterator[dict[str, str]]:
    """Start the cluster; yield {node_id: group name} ("head", "rollout", "learner")."""
    configure_local_caches()
    import ray
    from ray.cluster_utils import Cluster

    spec = _raycluster()["spec"]
    temp_dir = tempfile.mkdtemp(prefix="rp")  # Ray's socket paths must stay short
    # Ray records the cluster address under $TMPDIR/ray: keep it in this test's folder
    saved_tmpdir = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    head_args = _node_args(spec["headGroupSpec"]["rayStartParams"])
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **head_args,
            "include_dashboard": False,
            "temp_dir": temp_dir,
            "object_store_memory": 80 * 2**20,
        },
    )
    roles = {cluster.head_node.node_id: "head"}
    for group in spec["workerGroupSpecs"]:
        for _ in range(group["replicas"]):
            node = cluster.add_node(
                **_node_args(group["rayStartParams"]), object_store_memory=80 * 2**20
            )
            roles[node.node_id] = group["groupName"]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield roles
    finally:
        ray.shutdown()
        cluster.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_tmpdir
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_head_advertises_no_cpu_and_groups_advertise_their_resource(kuberay_shaped_cluster):
    import ray

    totals = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    for node_id, role in kuberay_shaped_cluster.items():
        resources = totals[node_id]
        if role == "head":
            assert resources.get("CPU", 0) == 0
        else:
            assert resources.get(f"stppo_{role}", 0) >= 1, (role, resources)


def test_learner_on_learner_node_and_rollouts_on_rollout_nodes(kuberay_shaped_cluster):
    import ray

    from services.ray_actors import learner_actor_options, rollout_actor_options

    class Probe:  # defined here so Ray ships it by value (workers cannot import tests/)
        """Stands in for RolloutWorker / Learner: reports the node it was placed on."""

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

    cfg = load_config(RUN_CONFIG, ["ray.address=local"])
    probe = ray.remote(Probe)
    # the learner first, while every node still has free CPUs: only its custom resource
    # keeps it off the rollout nodes
    learner = probe.options(**learner_actor_options(cfg)).remote()
    rollouts = [
        probe.options(**rollout_actor_options(cfg, i)).remote()
        for i in range(cfg.rollout.num_actors)
    ]
    learner_node = ray.get(learner.node_id.remote(), timeout=120)
    rollout_nodes = ray.get([r.node_id.remote() for r in rollouts], timeout=120)
    assert kuberay_shaped_cluster[learner_node] == "learner"
    assert [kuberay_shaped_cluster[n] for n in rollout_nodes] == ["rollout"] * len(rollouts)
    assert len(set(rollout_nodes)) == len(rollouts)  # one per rollout pod (2 CPUs each)
    for handle in [learner, *rollouts]:
        ray.kill(handle)


def test_rollout_capacity_agrees_with_what_ray_can_place(kuberay_shaped_cluster):
    """``rollout_actor_capacity`` on the live cluster (the cap of a live
    ``rollout.num_actors``) is exactly what Ray places: one more actor stays pending."""
    import ray
    from ray.exceptions import GetTimeoutError

    from services.ray_actors import (
        learner_actor_options,
        rollout_actor_capacity,
        rollout_actor_options,
    )

    class Probe:
        def ready(self) -> bool:
            return True

    cfg = load_config(RUN_CONFIG, ["ray.address=local"])
    cap, why = rollout_actor_capacity(cfg, ray.cluster_resources())
    rollout_replicas = sum(1 for role in kuberay_shaped_cluster.values() if role == "rollout")
    assert cap == rollout_replicas, why
    probe = ray.remote(Probe)
    learner = probe.options(**learner_actor_options(cfg)).remote()
    placed = [probe.options(**rollout_actor_options(cfg, i)).remote() for i in range(cap)]
    ray.get([learner.ready.remote(), *[a.ready.remote() for a in placed]], timeout=120)
    extra = probe.options(**rollout_actor_options(cfg, cap)).remote()
    with pytest.raises(GetTimeoutError):
        ray.get(extra.ready.remote(), timeout=5)
    for handle in [learner, *placed, extra]:
        ray.kill(handle)


def test_actor_options_carry_the_configured_custom_resources():
    from services.ray_actors import learner_actor_options, rollout_actor_options

    cfg = load_config(RUN_CONFIG)
    assert rollout_actor_options(cfg, 0)["resources"] == {"stppo_rollout": 1.0}
    assert learner_actor_options(cfg)["resources"] == {"stppo_learner": 1.0}
    assert learner_actor_options(cfg)["num_cpus"] == cfg.ray.learner_cpus
