"""The KubeRay topology on one machine: the rendered overlay's pods as network namespaces.

``scripts/local_cluster.sh up|status|submit|exec|kill|add|down`` (this module's CLI) turns
the *rendered* cpu-demo overlay (``kubectl kustomize deploy/k8s/overlays/cpu-demo``) into
"pods" on this machine, each a host of :mod:`local_cluster.netns` (own network namespace and IP
on a private bridge, no default route, the machine's hostname unresolvable) running in its
own mount namespace as uid 1000, as the restricted pods run:

=============  ==========================================================================
pod            runs
=============  ==========================================================================
head           the RayCluster's head container: ``ray start --head`` with its
               ``rayStartParams`` (dashboard, GCS, the driver that the RayJob submits)
rollout-N      the ``rollout`` worker group: ``ray start --address=<head Service>:6379``
learner-N      the ``learner`` worker group, the same way
retrieval      the ``stppo-retrieval`` Deployment's container (command and args)
prepare        the ``stppo-prepare`` Job (runs once, then exits)
monitoring     Prometheus, scraping every pod by its IP over the bridge
client         nothing: where ``ray job submit`` and ``stppo ctl`` run (``exec``)
=============  ==========================================================================

Volumes as declared: one directory stands for the shared PVC (``/shared`` in every pod
that mounts it), the rendered ConfigMap ``stppo-configs`` is ``/configs`` (read-only), and
every pod gets private ``/tmp``, ``/cache`` (the emptyDir) and ``/dev/shm``; nothing else is
shared, so code that assumes one filesystem fails here as on a cluster. Service names
(``stppo-head-svc``, ``stppo-retrieval``, ``stppo-control``, also in their
``<name>.stppo.svc.cluster.local`` form) resolve to the right pod through each pod's hosts
file. Ray token auth is on (``RAY_AUTH_MODE=token`` and a generated token, which KubeRay
injects into every Ray pod and the submitter), and the control plane's bearer token comes
from the rendered Secret.

Where this differs from a real cluster (each is a deliberate, documented choice):

- the "image" is this machine's project checkout and virtual environment, seen at their
  own paths (the interpreter's home under ``/root`` is re-exposed to uid 1000; a checkout
  under ``/tmp``, which each pod's private ``/tmp`` would hide, is bound back into the pod:
  :func:`pod_command`); a path the pods cannot reach stops ``up`` before any pod starts
  (:func:`check_image_visible`);
- pods have no default route, so the head is started with ``--node-ip-address`` = its pod
  IP (KubeRay's pods have a default route and Ray finds that IP itself); the workers find
  theirs the way Ray does on a cluster, from the route to the head;
- the synthetic task (``deploy/configs/k8s_synthetic.toml``) runs instead of SmolLM2, so a
  whole job fits in minutes on 2 cores: the prepare pod builds it with
  ``stppo prepare-synthetic`` and the retrieval pod serves its corpus (the Deployment's
  ``--corpus-path``/``--index-dir`` pointed at it);
- with ``warm_cache`` each Ray pod's ``/cache`` starts with this machine's compiled torch
  extensions (DeepSpeed's ~40 s JIT build would otherwise run in every fresh pod);
- the bridge itself has address ``.1``, so this machine reaches pods the way ``kubectl
  port-forward`` would (tests read Prometheus and the shared volume from here).

Needs root, iproute2 and util-linux (:func:`local_cluster.netns.netns_unavailable`) and
``kubectl``. ``down`` removes every namespace, veth, bridge and process it made, even after
a failed ``up``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from local_cluster.netns import Host, Network, netns_unavailable, remove_all
from services.env import PROJECT_ROOT

PREFIX = "stc"
SUBNET = "10.213.8.0/24"
DEFAULT_STATE_DIR = PROJECT_ROOT / "build" / "local-cluster"
OWNED_MARKER = ".local-cluster"
"""The file ``up`` puts in its state directory first; nothing unmarked is ever deleted."""
NAMESPACE = "stppo"
HEAD_SERVICE = "stppo-head-svc"  # KubeRay's name for the head Service of RayCluster `stppo`
POD_UID = 1000


class ClusterError(RuntimeError):
    """The local cluster could not be brought up or used (the message says what and where)."""


# ------------------------------------------------------------------------------ rendering


def render_overlay(overlay: str = "cpu-demo", token_file: Path | None = None) -> list[dict]:
    """``kubectl kustomize deploy/k8s/overlays/<overlay>`` as a list of objects.

    ``deploy/`` is copied first, with ``token_file`` (or a freshly generated token) as the
    git-ignored ``control-token.env``, so a developer's real token is never read.

    Raises:
        ClusterError: kubectl is missing or the render failed.
    """
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ClusterError("kubectl (with its built-in kustomize) is needed to render deploy/k8s")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "deploy"
        shutil.copytree(
            PROJECT_ROOT / "deploy", root, ignore=shutil.ignore_patterns("control-token.env")
        )
        env_file = root / "k8s" / "base" / "control-token.env"
        if token_file is not None:
            shutil.copy(token_file, env_file)
        else:
            env_file.write_text(f"token={secrets.token_hex(32)}\n")
        out = subprocess.run(
            [kubectl, "kustomize", str(root / "k8s" / "overlays" / overlay)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    if out.returncode != 0:
        raise ClusterError(f"kubectl kustomize {overlay} failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(objects: list[dict], kind: str, name: str) -> dict:
    for obj in objects:
        if obj.get("kind") == kind and obj["metadata"]["name"] == name:
            return obj
    raise ClusterError(f"the rendered overlay has no {kind} {name}")


def ray_start_args(params: dict[str, str]) -> list[str]:
    """``rayStartParams`` as ``ray start`` flags, the way KubeRay writes them into the
    container's shell command (a value is shell-parsed, so ``'"{...}"'`` becomes ``{...}``)."""
    args = []
    for key, value in params.items():
        parsed = shlex.split(str(value))
        args.append(f"--{key}={parsed[0] if parsed else ''}")
    return args


def container_env(container: dict, secrets_: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's ``env`` with ``value`` and ``secretKeyRef`` resolved.

    Raises:
        ClusterError: a ``valueFrom`` this emulation does not know, or a missing secret key.
    """
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            raise ClusterError(f"env {item['name']}: only value and secretKeyRef are emulated")
        try:
            env[item["name"]] = secrets_[ref["name"]][ref["key"]]
        except KeyError as e:
            raise ClusterError(f"env {item['name']}: secret {ref} not rendered") from e
    return env


def rendered_secrets(objects: list[dict]) -> dict[str, dict[str, str]]:
    """Secret name -> key -> decoded value, of every rendered Secret."""
    out = {}
    for obj in objects:
        if obj.get("kind") == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()}
            data.update(obj.get("stringData", {}))
            out[obj["metadata"]["name"]] = data
    return out


# ------------------------------------------------------------------------------ pods


@dataclass
class Pod:
    """One emulated pod: its host (namespace, IP) and what runs in it.

    Attributes:
        name: the pod's name (``head``, ``rollout-0``, ...).
        component: ``head``, ``rollout``, ``learner``, ``retrieval``, ``prepare``,
            ``monitoring`` or ``client``.
        ip: its IP on the bridge.
        argv: the container's command (empty: nothing runs until ``exec``).
        env: the container's environment.
        mounts: mount point -> host directory (``/shared``, ``/configs``, ``/tmp``, ...).
        pids: the processes started for it (for ``status``).
    """

    name: str
    component: str
    ip: str
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    veth: str = ""  # the host side of its veth pair


def _python_home_mounts(pod_root: Path) -> list[str]:
    """Re-expose the interpreter's home to uid 1000 when it lives under a directory only
    root may enter (pyenv under ``/root``): ``/root`` is covered by an empty 0755 directory
    holding only a bind of the interpreter's top directory. Returns the shell lines.
    """
    real = Path(os.path.realpath(sys.executable))
    top = Path("/root")
    if top not in real.parents or os.stat(top).st_mode & 0o005 == 0o005:
        return []
    first = real.relative_to(top).parts[0]
    stage = pod_root / "image" / "stage"
    cover = pod_root / "image" / "root"
    (cover / first).mkdir(parents=True, exist_ok=True)
    stage.mkdir(parents=True, exist_ok=True)
    os.chmod(cover, 0o755)
    lines = [
        f"mount --bind {shlex.quote(str(top / first))} {shlex.quote(str(stage))}",
        f"mount --bind {shlex.quote(str(cover))} /root",
        f"mount --bind {shlex.quote(str(stage))} /root/{shlex.quote(first)}",
    ]
    return lines


PRIVATE_DIRS = ("/tmp", "/dev/shm")
"""Where every pod gets a directory of its own, covering the machine's."""

IMAGE_STAGE = "/mnt"
"""Where a pod's private tmpfs holds the image paths its private directories would hide,
while those are mounted (any existing directory outside them would do)."""


def image_paths() -> list[Path]:
    """What every pod runs from, the "image": the checkout and the virtual environment
    (one path when the environment is inside the checkout)."""
    checkout, venv = PROJECT_ROOT.resolve(), Path(sys.prefix).resolve()
    return [checkout] if checkout in venv.parents or venv == checkout else [checkout, venv]


def _under(path: Path, directory: str) -> bool:
    return Path(directory) in path.parents or path == Path(directory)


def check_image_visible(paths: list[Path], uid: int = 1000) -> None:
    """Before any pod starts: the pods run as ``uid`` and must reach ``paths``. A path under
    a pod's private directories is bound back into the pod (:func:`pod_command`); elsewhere
    every directory above it must let others traverse it, and it must be readable.

    Raises:
        ClusterError: naming the path that hides the image and why.
    """
    for path in paths:
        if any(_under(path, d) for d in PRIVATE_DIRS):
            continue  # re-exposed inside the pod at the same path
        for parent in [*reversed(path.parents), path]:
            mode = parent.stat().st_mode
            if parent.is_dir() and not mode & 0o001:
                raise ClusterError(
                    f"the pods run as uid {uid} and cannot enter {parent} (mode "
                    f"{oct(mode & 0o777)}), on the way to {path}: move the checkout under a "
                    f"directory others may traverse, or `chmod o+x {parent}`"
                )


def _image_mounts(paths: list[Path]) -> tuple[list[str], list[str]]:
    """Shell lines that keep the image paths a pod's private ``/tmp`` (or ``/dev/shm``)
    would hide: bound to a private tmpfs before those are mounted, and back to their own
    path after. Returns (before, after)."""
    hidden = [p for p in paths if any(_under(p, d) for d in PRIVATE_DIRS)]
    if not hidden:
        return [], []
    before = [f"mount -t tmpfs stppo-image {IMAGE_STAGE}"]
    after = []
    for i, path in enumerate(hidden):
        stage, q_path = shlex.quote(f"{IMAGE_STAGE}/image{i}"), shlex.quote(str(path))
        before.append(f"mkdir -p {stage} && mount --bind {q_path} {stage}")
        after.append(f"mkdir -p {q_path} && mount --bind {stage} {q_path}")
    return before, after


def pod_command(
    host: Host,
    pod: Pod,
    uid: int | None,
    read_only: tuple[str, ...],
    image: list[Path] | None = None,
) -> list[str]:
    """The argv that starts ``pod.argv`` in ``host``'s namespaces: a private mount namespace
    with ``pod.mounts`` bound (``read_only`` ones remounted read-only), the image
    (:func:`image_paths`, or ``image``) visible at its own path even where it lives under
    ``/tmp``, then the command as ``uid`` with exactly ``pod.env``."""
    before, after = _image_mounts(image_paths() if image is None else image)
    lines = [*_python_home_mounts(host.root), *before]
    # /tmp last: the other mounts' sources may live under the machine's /tmp (a test's
    # temporary directory), which the pod's own /tmp covers
    for target, source in sorted(pod.mounts.items(), key=lambda m: m[0] == "/tmp"):
        q_target, q_source = shlex.quote(target), shlex.quote(source)
        lines.append(f"mkdir -p {q_target} && mount --bind {q_source} {q_target}")
        if target in read_only:
            lines.append(f"mount -o remount,bind,ro {q_target}")
    lines += after
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(pod.env.items()))
    run = shlex.join(pod.argv)
    user = f"setpriv --reuid={uid} --regid={uid} --clear-groups " if uid is not None else ""
    lines.append(f"cd /tmp && exec {user}env -i {env} {run}")
    script = " && ".join(lines)
    return [
        "ip", "netns", "exec", host.netns,
        "unshare", "-m", "--propagation", "private", "sh", "-c", script,
    ]  # fmt: skip


# ------------------------------------------------------------------------------ the cluster


@dataclass
class ClusterState:
    """What ``up`` made, saved as ``cluster.json`` for ``status``/``exec``/``down``."""

    state_dir: str
    ray_token: str
    control_token: str
    prefix: str = PREFIX
    pods: dict[str, Pod] = field(default_factory=dict)

    def save(self) -> None:
        data = asdict(self)
        Path(self.state_dir, "cluster.json").write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState:
        path = state_dir / "cluster.json"
        if not path.exists():
            raise ClusterError(f"no local cluster in {state_dir} (run `up` first)")
        data = json.loads(path.read_text())
        data["pods"] = {k: Pod(**v) for k, v in data["pods"].items()}
        return cls(**data)


class LocalCluster:
    """The cpu-demo overlay's pods on this machine (see the module docstring).

    Args:
        state_dir: everything the cluster writes (pods' private directories, the shared
            volume, the ConfigMap's files, logs, ``cluster.json``).
        learners: learner worker pods (the overlay's ``replicas`` is 1; 2 for a 2-rank
            learner across pods).
        rollouts: rollout worker pods (the overlay's ``replicas``: 2).
        overlay: which overlay to render.
        warm_cache: seed each Ray pod's ``/cache/torch_extensions`` with this machine's.
        prefix: names of the namespaces and links (two clusters need two prefixes).
        subnet: the bridge's private /24 (two clusters need two subnets).

    Raises:
        ClusterError: not root, no iproute2/kubectl, or a pod did not come up (its log is
            named).
    """

    def __init__(
        self,
        state_dir: Path = DEFAULT_STATE_DIR,
        learners: int | None = None,
        rollouts: int | None = None,
        overlay: str = "cpu-demo",
        warm_cache: bool = True,
        prefix: str = PREFIX,
        subnet: str = SUBNET,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.prefix = prefix
        self.learners, self.rollouts = learners, rollouts
        self.overlay = overlay
        self.warm_cache = warm_cache
        self.network = Network(prefix, subnet, self.state_dir / "pods")
        self.state: ClusterState | None = None

    # ---------------------------------------------------------------- up

    def up(self, timeout_s: float = 300.0) -> ClusterState:
        """Render, create every pod, start their containers, and wait until the Ray
        cluster has all its nodes, the data are prepared and retrieval answers."""
        why = netns_unavailable()
        if why:
            raise ClusterError(why)
        check_image_visible(image_paths(), POD_UID)
        remove_all(self.prefix)
        if self.state_dir.exists():
            self._check_owned()
            shutil.rmtree(self.state_dir)
        (self.state_dir / "logs").mkdir(parents=True)
        (self.state_dir / OWNED_MARKER).touch()
        try:
            return self._up(timeout_s)
        except BaseException:
            self.down(keep_logs=True)
            raise

    def _up(self, timeout_s: float) -> ClusterState:
        objects = render_overlay(self.overlay)
        secrets_ = rendered_secrets(objects)
        cluster = _one(objects, "RayCluster", "stppo")
        retrieval = _one(objects, "Deployment", "stppo-retrieval")
        prepare = _one(objects, "Job", "stppo-prepare")
        configmap = _one(objects, "ConfigMap", "stppo-configs")
        state = ClusterState(
            str(self.state_dir), secrets.token_hex(32),
            secrets_["stppo-control-token"]["token"], self.prefix,
        )  # fmt: skip
        self.state = state
        shared = self.state_dir / "shared"
        configs = self.state_dir / "configs"
        for folder in (shared, configs):
            folder.mkdir(parents=True)
        for name, text in configmap.get("data", {}).items():
            (configs / name).write_text(text)

        self.network.up()
        self._bridge_address()
        groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
        counts = {
            "rollout": self.rollouts if self.rollouts is not None else groups["rollout"]["replicas"],
            "learner": self.learners if self.learners is not None else groups["learner"]["replicas"],
        }  # fmt: skip
        names = ["head", "retrieval", "prepare", "monitoring", "client"]
        names += [f"{g}-{i}" for g in ("rollout", "learner") for i in range(counts[g])]
        for name in names:
            self.network.add_host(name)
        ips = {n: h.ip for n, h in self.network.hosts.items()}
        services = {
            HEAD_SERVICE: ips["head"], "stppo-control": ips["head"],
            "stppo-retrieval": ips["retrieval"],
        }  # fmt: skip
        services.update(
            {f"{k}.{NAMESPACE}.svc.cluster.local": v for k, v in list(services.items())}
        )
        self.network.publish_names(services)

        head_spec = cluster["spec"]["headGroupSpec"]
        self._add_pod(state, "head", "head", head_spec, secrets_, shared, configs, head=True)
        for group in ("rollout", "learner"):
            for i in range(counts[group]):
                self._add_pod(
                    state, f"{group}-{i}", group, groups[group], secrets_, shared, configs
                )
        self._add_job_pod(state, "prepare", prepare, secrets_, shared)
        self._add_retrieval_pod(state, retrieval, secrets_, shared)
        self._add_monitoring_pod(state, ips)
        self._add_client_pod(state)
        for name, pod in state.pods.items():
            pod.veth = self.network.hosts[name].host_veth
        state.save()

        deadline = time.monotonic() + timeout_s
        self.start("prepare")
        self.start("head")
        self._wait_prepared(deadline)
        self.start("retrieval")
        for name in names:
            if name.startswith(("rollout-", "learner-")):
                self.start(name)
        self.start("monitoring")
        self.wait_ray_nodes(1 + counts["rollout"] + counts["learner"], deadline)
        self.wait_http(f"http://{ips['retrieval']}:8001/healthz", deadline, "retrieval")
        state.save()
        return state

    def _bridge_address(self) -> None:
        """The bridge's own address (.1): this machine reaches the pods through it."""
        address = str(self.network.subnet.network_address + 1)
        subprocess.run(
            ["ip", "addr", "replace", f"{address}/24", "dev", self.network.bridge],
            check=True, capture_output=True,
        )  # fmt: skip

    def _base_env(self) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        return {
            "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp/home",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def _pod_dirs(self, name: str, shm: bool = True) -> dict[str, str]:
        root = self.network.hosts[name].root
        mounts = {"/tmp": root / "tmp", "/cache": root / "cache"}
        if shm:
            mounts["/dev/shm"] = root / "shm"
        for folder in mounts.values():
            folder.mkdir(parents=True, exist_ok=True)
        (root / "tmp" / "home").mkdir(exist_ok=True)
        return {k: str(v) for k, v in mounts.items()}

    def _volumes(self, spec: dict, mounts: dict[str, str], shared: Path, configs: Path) -> None:
        """The pod template's PVC and ConfigMap volumes at their mount paths."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"][:1]:
            for mount in container.get("volumeMounts", []):
                volume = volumes[mount["name"]]
                if "persistentVolumeClaim" in volume:
                    mounts[mount["mountPath"]] = str(shared)
                elif "configMap" in volume:
                    mounts[mount["mountPath"]] = str(configs)

    def _add_pod(
        self, state, name, component, group, secrets_, shared, configs, head: bool = False
    ) -> None:
        host = self.network.hosts[name]
        spec = group["template"]["spec"]
        env = self._base_env() | container_env(spec["containers"][0], secrets_)
        env |= {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": state.ray_token,
            "RAY_CLUSTER_NAME": "stppo",
            "MY_POD_IP": host.ip,
        }
        params = dict(group.get("rayStartParams", {}))
        params.setdefault("metrics-export-port", "8080")  # KubeRay's default on every pod
        argv = ["ray", "start", "--block", *ray_start_args(params)]
        if head:
            argv += ["--head", "--port=6379", f"--node-ip-address={host.ip}"]
        else:
            argv += [f"--address={HEAD_SERVICE}:6379"]
            env["RAY_IP"] = HEAD_SERVICE
        mounts = self._pod_dirs(name)
        self._volumes(spec, mounts, shared, configs)
        if self.warm_cache:
            built = Path(
                os.environ.get("TORCH_EXTENSIONS_DIR", PROJECT_ROOT / ".cache" / "torch_extensions")
            )
            if built.is_dir():
                shutil.copytree(
                    built, Path(mounts["/cache"]) / "torch_extensions", dirs_exist_ok=True
                )
        state.pods[name] = Pod(name, component, host.ip, argv, env, mounts)

    def _add_job_pod(self, state, name, job, secrets_, shared) -> None:
        """The prepare Job, building the synthetic task instead of the full assets."""
        host = self.network.hosts[name]
        spec = job["spec"]["template"]["spec"]
        env = self._base_env() | container_env(spec["containers"][0], secrets_)
        script = (
            "stppo prepare-synthetic --data-dir /shared/data/synthetic "
            "&& touch /shared/data/.prepared"
        )
        mounts = self._pod_dirs(name, shm=False)
        mounts["/shared"] = str(shared)
        (shared / "data").mkdir(parents=True, exist_ok=True)
        state.pods[name] = Pod(name, "prepare", host.ip, ["/bin/sh", "-c", script], env, mounts)

    def _add_retrieval_pod(self, state, deployment, secrets_, shared) -> None:
        host = self.network.hosts["retrieval"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        env = self._base_env() | container_env(container, secrets_)
        args = [
            a for a in container.get("args", [])
            if not a.startswith(("--corpus-path=", "--index-dir=", "--workers=", "--search-threads="))
        ]  # fmt: skip
        args += [
            "--corpus-path=/shared/data/synthetic/corpus/passages.jsonl",
            "--index-dir=/shared/data/synthetic/index",
            "--workers=1",
            "--search-threads=1",
        ]
        mounts = self._pod_dirs("retrieval", shm=False)
        mounts["/shared"] = str(shared)
        argv = [*container["command"], *args]
        state.pods["retrieval"] = Pod("retrieval", "retrieval", host.ip, argv, env, mounts)

    def _add_monitoring_pod(self, state, ips: dict[str, str]) -> None:
        host = self.network.hosts["monitoring"]
        ray_pods = [n for n in ips if n == "head" or n.startswith(("rollout-", "learner-"))]
        config = {
            "global": {"scrape_interval": "5s", "scrape_timeout": "4s"},
            "scrape_configs": [
                {"job_name": "stppo-driver", "static_configs": [{"targets": [f"{ips['head']}:9464"]}]},
                {"job_name": "stppo-retrieval", "static_configs": [{"targets": [f"{ips['retrieval']}:8001"]}]},
                {
                    "job_name": "ray",
                    "static_configs": [
                        {"targets": [f"{ips[n]}:8080"], "labels": {"pod": n}} for n in ray_pods
                    ],
                },
            ],
        }  # fmt: skip
        mounts = self._pod_dirs("monitoring", shm=False)
        config_path = Path(mounts["/tmp"]) / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
        argv = [
            prometheus, "--config.file=/tmp/prometheus.yml", "--storage.tsdb.path=/tmp/tsdb",
            "--web.listen-address=0.0.0.0:9090",
        ]  # fmt: skip
        state.pods["monitoring"] = Pod(
            "monitoring", "monitoring", host.ip, argv, self._base_env(), mounts
        )

    def _add_client_pod(self, state) -> None:
        host = self.network.hosts["client"]
        env = self._base_env() | {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": state.ray_token,
            "STPPO_CONTROL_URL": "http://stppo-control:8365",
            "STPPO_CONTROL_TOKEN": state.control_token,
        }
        mounts = self._pod_dirs("client", shm=False)
        state.pods["client"] = Pod("client", "client", host.ip, [], env, mounts)

    # ---------------------------------------------------------------- running things

    def _host(self, name: str) -> Host:
        if name in self.network.hosts:
            return self.network.hosts[name]
        pod = self._state().pods[name]
        netns = f"{self.prefix}-{name}"
        return Host(name, netns, pod.ip, pod.veth, root=self.state_dir / "pods" / name)

    def _state(self) -> ClusterState:
        if self.state is None:
            self.state = ClusterState.load(self.state_dir)
            self.prefix = self.state.prefix
        return self.state

    def start(self, name: str) -> subprocess.Popen | None:
        """Start pod ``name``'s container (its log: ``logs/<name>.log``)."""
        state = self._state()
        pod = state.pods[name]
        if not pod.argv:
            return None
        host = self._host(name)
        for folder in pod.mounts.values():
            if folder.startswith(str(self.state_dir / "pods")):
                _chown_tree(Path(folder), POD_UID)
        _chown_tree(self.state_dir / "shared", POD_UID)
        read_only = ("/configs",)
        argv = pod_command(host, pod, POD_UID, read_only)
        log = open(self.state_dir / "logs" / f"{name}.log", "ab")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        host.processes.append(proc)
        pod.pids.append(proc.pid)
        state.save()
        return proc

    def exec(
        self, name: str, argv: list[str], timeout: float | None = 600.0, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` in pod ``name`` as its container would (its env, mounts, uid),
        capturing output."""
        state = self._state()
        pod = state.pods[name]
        one_off = Pod(pod.name, pod.component, pod.ip, argv, pod.env | (env or {}), pod.mounts)
        cmd = pod_command(self._host(name), one_off, POD_UID, ("/configs",))
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def popen(
        self, name: str, argv: list[str], log: Path, env: dict | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` in pod ``name`` in the background (output to ``log``)."""
        state = self._state()
        pod = state.pods[name]
        one_off = Pod(pod.name, pod.component, pod.ip, argv, pod.env | (env or {}), pod.mounts)
        cmd = pod_command(self._host(name), one_off, POD_UID, ("/configs",))
        with open(log, "ab") as out:
            return subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def submit_command(self, entrypoint: list[str], submission_id: str | None = None) -> list[str]:
        """The ``ray job submit`` the RayJob's submitter runs, against the head Service."""
        argv = ["ray", "job", "submit", f"--address=http://{HEAD_SERVICE}:8265"]
        if submission_id:
            argv.append(f"--submission-id={submission_id}")
        return [*argv, "--", *entrypoint]

    # ---------------------------------------------------------------- readiness

    def _wait_prepared(self, deadline: float) -> None:
        marker = self.state_dir / "shared" / "data" / ".prepared"
        while not marker.exists():
            self._check_alive("prepare", allow_exit_zero=True)
            if time.monotonic() > deadline:
                raise ClusterError(f"prepare did not finish; see {self.state_dir}/logs/prepare.log")
            time.sleep(1.0)

    def _check_alive(self, name: str, allow_exit_zero: bool = False) -> None:
        for proc in self.network.hosts[name].processes:
            rc = proc.poll()
            if rc is not None and not (allow_exit_zero and rc == 0):
                raise ClusterError(
                    f"pod {name} exited with {rc}; see {self.state_dir}/logs/{name}.log"
                )

    def wait_ray_nodes(self, count: int, deadline: float) -> None:
        """Until ``count`` Ray nodes are alive (asked on the head pod: a Ray driver needs a
        raylet beside it, which the client pod does not have)."""
        code = (
            "import ray; ray.init(address='auto', logging_level='ERROR');"
            "print('ALIVE', sum(n['Alive'] for n in ray.nodes()))"
        )
        alive = 0
        while time.monotonic() < deadline:
            self._check_alive("head")
            out = self.exec("head", ["python", "-c", code], timeout=120)
            for line in out.stdout.splitlines():
                if line.startswith("ALIVE"):
                    alive = int(line.split()[1])
            if alive >= count:
                return
            time.sleep(2.0)
        raise ClusterError(f"{alive} of {count} Ray nodes alive; see {self.state_dir}/logs/")

    def wait_http(self, url: str, deadline: float, name: str) -> None:
        """Until ``url`` answers 200 from this machine (over the bridge)."""
        import httpx

        last = ""
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError as e:
                last = str(e)
            time.sleep(1.0)
        raise ClusterError(f"{url} not ready ({last}); see {self.state_dir}/logs/{name}.log")

    # ---------------------------------------------------------------- faults

    def kill(self, name: str) -> None:
        """Lose pod ``name``: every process in its namespace killed, its interface down."""
        host = self._host(name)
        host.kill_all()
        with contextlib.suppress(Exception):
            host.link(up=False)

    def restart(self, name: str, down_s: float = 0.0) -> None:
        """Pod ``name`` dies, stays away ``down_s`` seconds, and comes back at the same
        address (what a Deployment's new pod behind a Service looks like to its clients:
        the Service name resolves as before)."""
        self.kill(name)
        time.sleep(down_s)
        self._host(name).link(up=True)
        self.start(name)

    def partition(self, name: str, seconds: float) -> None:
        """Drop all of pod ``name``'s traffic for ``seconds`` (its processes keep running),
        then restore it."""
        host = self._host(name)
        host.link(up=False)
        try:
            time.sleep(seconds)
        finally:
            host.link(up=True)

    def add_replacement(self, component: str) -> str:
        """A new pod of worker group ``component`` (``rollout``/``learner``), as a
        ReplicaSet replaces a lost one: new name, new IP; returns its name."""
        state = self._state()
        used = [p for p in state.pods if p.startswith(f"{component}-")]
        template = state.pods[used[0]]
        name = f"{component}-{len(used)}"
        host = self.network.add_host(name)
        ips = {n: h.ip for n, h in self.network.hosts.items()}
        services = {
            HEAD_SERVICE: ips["head"],
            "stppo-control": ips["head"],
            "stppo-retrieval": ips["retrieval"],
        }
        self.network.publish_names(services)
        mounts = self._pod_dirs(name)
        mounts.update({k: v for k, v in template.mounts.items() if k in ("/shared", "/configs")})
        if self.warm_cache:
            cache = Path(template.mounts["/cache"]) / "torch_extensions"
            if cache.is_dir():
                shutil.copytree(
                    cache, Path(mounts["/cache"]) / "torch_extensions", dirs_exist_ok=True
                )
        env = dict(template.env) | {"MY_POD_IP": host.ip}
        state.pods[name] = Pod(name, component, host.ip, list(template.argv), env, mounts)
        state.pods[name].veth = host.host_veth
        state.save()
        self.start(name)
        return name

    # ---------------------------------------------------------------- down / status

    def down(self, keep_logs: bool = True) -> list[str]:
        """Remove every namespace, veth, bridge and process this cluster made (works after
        a failed ``up`` and from another process); keeps ``logs/`` unless told not to."""
        with contextlib.suppress(ClusterError, OSError, ValueError):
            self._state()  # the prefix it was made with
        removed = remove_all(self.prefix)
        if self.state_dir.exists():
            self._check_owned()
            for child in self.state_dir.iterdir():
                if child.name == OWNED_MARKER or (
                    keep_logs and child.name in ("logs", "cluster.json")
                ):
                    continue
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
        return removed

    def _check_owned(self) -> None:
        """Refuse to delete a folder a cluster did not make: ``up`` marks its state
        directory (:data:`OWNED_MARKER`) before anything else, and only a marked directory
        (or an empty one) is ever cleared, so a wrong ``state_dir`` (the empty path is the
        current directory) cannot take a checkout with it.

        Raises:
            ClusterError: ``state_dir`` holds files but no mark.
        """
        marked = any((self.state_dir / n).exists() for n in (OWNED_MARKER, "cluster.json"))
        if not marked and any(self.state_dir.iterdir()):
            raise ClusterError(
                f"{self.state_dir} is not a local cluster's state directory (no "
                f"{OWNED_MARKER}): nothing in it was removed"
            )

    def status(self) -> list[dict[str, Any]]:
        """One row per pod: name, component, IP, and whether its processes are alive."""
        state = self._state()
        rows = []
        for name, pod in state.pods.items():
            alive = [pid for pid in pod.pids if _alive(pid)]
            rows.append({"pod": name, "component": pod.component, "ip": pod.ip,
                         "running": bool(alive) if pod.argv else None})  # fmt: skip
        return rows


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _chown_tree(path: Path, uid: int) -> None:
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(root, name), uid, uid)
    with contextlib.suppress(FileNotFoundError):
        os.lchown(path, uid, uid)


# ------------------------------------------------------------------------------ CLI

app = typer.Typer(help="The KubeRay topology on this machine (network namespaces; needs root).")
StateDir = Annotated[Path, typer.Option(help="Where the cluster keeps its files.")]


@app.command()
def up(
    state_dir: StateDir = DEFAULT_STATE_DIR,
    learners: Annotated[int, typer.Option(min=1, help="Learner pods.")] = 1,
    rollouts: Annotated[int, typer.Option(min=1, help="Rollout pods.")] = 2,
) -> None:
    """Bring the pods up and wait for Ray, the data and retrieval."""
    started = time.monotonic()
    try:
        LocalCluster(state_dir, learners, rollouts).up()
    except ClusterError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"up in {time.monotonic() - started:.0f} s")
    status(state_dir)


@app.command()
def status(state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """The pods, their IPs and whether they run."""
    try:
        rows = LocalCluster(state_dir).status()
    except ClusterError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    for row in rows:
        running = {True: "running", False: "STOPPED", None: "(exec only)"}[row["running"]]
        typer.echo(f"{row['pod']:<12} {row['component']:<11} {row['ip']:<14} {running}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def submit(ctx: typer.Context, state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """``ray job submit`` from the client pod: ``submit -- stppo train @/configs/...``."""
    cluster = LocalCluster(state_dir)
    out = subprocess.run(_pod_argv(cluster, "client", cluster.submit_command(ctx.args)))
    raise typer.Exit(out.returncode)


@app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(ctx: typer.Context, pod: str, state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """Run a command in a pod: ``exec client -- stppo ctl status``."""
    cluster = LocalCluster(state_dir)
    raise typer.Exit(subprocess.run(_pod_argv(cluster, pod, ctx.args)).returncode)


@app.command()
def kill(pod: str, state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """Lose a pod (every process killed, interface down)."""
    LocalCluster(state_dir).kill(pod)


@app.command()
def down(state_dir: StateDir = DEFAULT_STATE_DIR) -> None:
    """Remove every namespace, veth, bridge and process (also after a failed ``up``)."""
    removed = LocalCluster(state_dir).down()
    typer.echo(f"removed {len(removed)} namespaces/links")


def _pod_argv(cluster: LocalCluster, name: str, argv: list[str]) -> list[str]:
    state = cluster._state()
    pod = state.pods[name]
    one_off = Pod(pod.name, pod.component, pod.ip, argv, pod.env, pod.mounts)
    return pod_command(cluster._host(name), one_off, POD_UID, ("/configs",))


if __name__ == "__main__":
    app()
