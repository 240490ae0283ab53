"""deploy/: the manifests users apply, checked as far as a machine without Kubernetes allows.

Each kustomize overlay is rendered by a small renderer of the kustomize subset the repo uses
(resources, namespace, ConfigMap/Secret generators without name hashes, JSON6902 patches; a
kustomization using any other key fails the test). Rendered objects are validated strictly:
core kinds against the Kubernetes OpenAPI schemas (kubernetes-validate, offline), KubeRay
kinds against the openAPIV3Schema of the CRDs in ../shared/schemas/kuberay (unknown fields
rejected, as kubectl's strict field validation does). Then names, ports, paths, images and
resources are checked to agree across objects, the run config and the Dockerfile.
"""

from __future__ import annotations

import base64
import copy
import functools
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.config import load_config
from services.env import PROJECT_ROOT

DEPLOY = PROJECT_ROOT / "deploy"
OVERLAYS = ("cpu-demo", "gpu")
CRD_DIR = PROJECT_ROOT.parent / "shared" / "schemas" / "kuberay"
K8S_VERSION = "1.33.0"
KUSTOMIZE_KEYS = {
    "apiVersion", "kind", "namespace", "resources", "patches", "generatorOptions",
    "configMapGenerator", "secretGenerator",
}  # fmt: skip
CLUSTER_SCOPED = {"Namespace"}
PYPROJECT = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())


# --------------------------------------------------------------------------- kustomize subset


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _apply_json6902(obj: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove (the ops the overlays use); raises on a bad path."""
    for op in ops:
        *parents, last = [_unescape(t) for t in op["path"].lstrip("/").split("/")]
        node = obj
        for token in parents:
            node = node[int(token)] if isinstance(node, list) else node[token]
        if op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if last == "-" else int(last), op["value"])
            else:
                node[last] = op["value"]
        elif op["op"] == "replace":
            if isinstance(node, list):
                node[int(last)] = op["value"]
            else:
                if last not in node:
                    raise KeyError(f"replace of missing path {op['path']}")
                node[last] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise ValueError(f"unsupported patch op {op['op']!r}")


def _generated(kind: str, gen: dict, options: dict, data: dict[str, str]) -> dict:
    assert options.get("disableNameSuffixHash") is True, (
        "generators must disable the name hash: CRDs refer to the plain names"
    )
    obj = {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": gen["name"], "labels": dict(options.get("labels", {}))},
    }
    if kind == "Secret":
        obj["type"] = gen.get("type", "Opaque")
        obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        obj["data"] = data
    return obj


def _read_env_file(path: Path) -> dict[str, str]:
    if not path.exists():  # git-ignored real token: the committed example stands in
        path = path.with_name(path.name + ".example")
    pairs = [line.split("=", 1) for line in path.read_text().splitlines() if line.strip()]
    return {k.strip(): v.strip() for k, v in pairs}


def render(directory: Path) -> list[dict]:
    """Render a kustomization directory (the subset described in the module docstring)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZE_KEYS
    assert not unknown, f"{directory}: kustomize keys the test renderer does not model: {unknown}"
    objects: list[dict] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    options = k.get("generatorOptions", {})
    for gen in k.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in gen["files"]}
        objects.append(_generated("ConfigMap", gen, options, data))
    for gen in k.get("secretGenerator", []):
        data = {}
        for env_file in gen.get("envs", []):
            data.update(_read_env_file(directory / env_file))
        objects.append(_generated("Secret", gen, options, data))
    for patch in k.get("patches", []):
        target = patch["target"]
        matches = [
            o
            for o in objects
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        ]
        assert matches, f"{directory}: patch target {target} matches no object"
        for obj in matches:
            _apply_json6902(obj, yaml.safe_load(patch["patch"]))
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    return objects


@functools.cache
def _rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(render(DEPLOY / "k8s" / "overlays" / overlay))


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
    if not CRD_DIR.is_dir():
        pytest.fail(f"{CRD_DIR} is missing: CI keeps ../shared beside the checkout")
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
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")]
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
         "RayCluster", "RayJob", "ConfigMap", "ConfigMap", "Secret"]
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


def test_patch_renderer_applies_json6902():
    obj = {"a": {"b": [1, 2]}, "c": 1}
    _apply_json6902(
        obj,
        [
            {"op": "replace", "path": "/a/b/1", "value": 5},
            {"op": "add", "path": "/a/b/-", "value": 7},
            {"op": "add", "path": "/a/x~1y", "value": "s"},
            {"op": "remove", "path": "/c"},
        ],
    )
    assert obj == {"a": {"b": [1, 5, 7], "x/y": "s"}}
    with pytest.raises(KeyError):
        _apply_json6902(obj, [{"op": "replace", "path": "/a/missing", "value": 0}])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayjob_entrypoint_config_exists_is_mounted_and_loads(overlay):
    objects = rendered(overlay)
    file_name, _, cfg = run_config_of(objects)
    expected = {"cpu-demo": "k8s_cpu_demo.toml", "gpu": "k8s_gpu.toml"}[overlay]
    assert file_name == expected
    head = head_container(objects)
    (mount,) = [m for m in head["volumeMounts"] if m["mountPath"] == "/configs"]
    head_pod = one(objects, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head_pod["volumes"] if v["name"] == mount["name"]]
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert configmap["data"][file_name] == (DEPLOY / "configs" / file_name).read_text()
    assert cfg.ray.address == "auto"
    assert cfg.ray.num_cpus is None  # joining a cluster: Ray refuses num_cpus


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
    assert cfg.metrics.port == container_port(head, "metrics") == 9464
    assert head_meta["annotations"]["prometheus.io/port"] == str(cfg.metrics.port)
    svc = one(objects, "Service", "stppo-control")
    # KubeRay labels the head pod ray.io/cluster=<name>, ray.io/node-type=head
    assert svc["spec"]["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["control"]["port"] == cfg.control.port
    assert ports["metrics"]["port"] == cfg.metrics.port
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


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_resources_fit_the_run_config(overlay):
    """Ray logical resources per worker group can host the actors the config asks for."""
    objects = rendered(overlay)
    _, _, cfg = run_config_of(objects)
    groups = {g["groupName"]: g for g in one(objects, "RayCluster")["spec"]["workerGroupSpecs"]}

    def capacity(group: dict) -> tuple[float, float, int]:
        container = group["template"]["spec"]["containers"][0]
        gpus = float(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        return float(group["rayStartParams"]["num-cpus"]), gpus, group["replicas"]

    cpus, gpus, replicas = capacity(groups["rollout"])
    per_pod = int(cpus // cfg.ray.rollout_actor_cpus)
    if cfg.ray.rollout_actor_gpus > 0:
        per_pod = min(per_pod, int(gpus // cfg.ray.rollout_actor_gpus))
    assert per_pod * replicas >= cfg.rollout.num_actors
    cpus, gpus, _ = capacity(groups["learner"])
    assert cpus >= cfg.ray.learner_cpus and gpus >= cfg.ray.learner_gpus
    tolerations = groups["learner"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    if overlay == "gpu":
        assert cfg.ray.learner_gpus == 1 and gpus == 1
        assert cfg.rollout.engine == "vllm"


def test_cpu_demo_and_gpu_overlays_differ_where_intended():
    cpu, gpu = rendered("cpu-demo"), rendered("gpu")
    assert one(cpu, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert one(gpu, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    for group in one(cpu, "RayCluster")["spec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert "nvidia.com/gpu" not in limits
    for group in one(gpu, "RayCluster")["spec"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
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
    assert (
        'extras="[vllm]"' in dockerfile and "vllm" in PYPROJECT["project"]["optional-dependencies"]
    )
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for pattern in packages:
        assert f"!{pattern.rstrip('*')}/" in ignore


def test_prometheus_annotations_and_podmonitor_name_real_ports():
    podmonitor = yaml.safe_load((DEPLOY / "prometheus" / "podmonitor.yaml").read_text())
    selector = podmonitor["spec"]["selector"]["matchLabels"]
    wanted = {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]}
    found = set()
    for where, meta, spec in pod_specs(rendered("cpu-demo")):
        ann = meta.get("annotations", {})
        ports = {
            p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])
        }
        if ann.get("prometheus.io/scrape") == "true":
            assert int(ann["prometheus.io/port"]) in ports.values(), where
            assert ann["prometheus.io/path"] == "/metrics"
        if all(meta["labels"].get(k) == v for k, v in selector.items()):
            found |= wanted & set(ports)
    assert found == wanted  # every PodMonitor endpoint matches a real named port


def test_prometheus_k8s_config_uses_the_manifest_annotations():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    (job,) = config["scrape_configs"]
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
