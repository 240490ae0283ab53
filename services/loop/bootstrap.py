"""Everything a run needs before its loop: the run directory, retrieval, Ray, observability.

:func:`start_services` opens the run directory (how a start treats a used one, the run id
and attempt on every record line: :mod:`services.run_records`; incomplete checkpoints moved
aside: :mod:`services.loop.checkpoint`), starts or waits for the retrieval server, starts
Ray, the Prometheus endpoint, the trackers and the control plane, and returns them as
:class:`Services`, whose :meth:`Services.close` stops them in reverse order.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.rendezvous import advertised_host
from services.atomic import write_atomic
from services.config import RunConfig
from services.control import ControlState, public_config
from services.env import ray_temp_dir
from services.loop.checkpoint import CheckpointStore, checkpoint_step
from services.run_records import RecordWriter, StartPlan, move_aside, plan_start, start_attempt

log = logging.getLogger("stppo.driver")


@dataclass
class Services:
    """What :func:`start_services` started (every field set once it returns)."""

    run_dir: Path
    plan: StartPlan
    records: RecordWriter
    progress: Any  # services.progress.Progress
    registry: Any = None
    metrics: Any = None  # services.metrics.TrainingMetrics
    tracker: Any = None  # services.tracking.Tracker or None
    retrieval_url: str = ""
    retrieval: Any = None  # services.retrieval_supervisor.RetrievalSupervisor or None
    metrics_url: str | None = None
    control_url: str | None = None
    control_token: str | None = None
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def retrieval_up(self) -> bool:
        """False while the managed retrieval server restarts; raises once it cannot come
        back (an external one is always up)."""
        if self.retrieval is None:
            return True
        self.retrieval.raise_if_failed()
        return self.retrieval.up

    def close(self) -> None:
        """Stop what was started, last first; a failing step is logged, not raised."""
        for close in reversed(self.closers):
            try:
                close()
            except Exception as e:
                log.warning("shutdown step %s failed: %s", getattr(close, "__qualname__", close), e)
        self.closers.clear()


def describe_start(plan: StartPlan, lineage: Any) -> str:
    what = f"run {lineage.run_id} attempt {lineage.attempt}"
    if plan.checkpoint is not None:
        return f"{what}: resuming from {plan.checkpoint.name}"
    if plan.continue_lineage:
        return f"{what}: no checkpoint, starting over (earlier records moved to superseded/)"
    return f"{what}: new run"


def open_run_dir(cfg: RunConfig, resume_mode: str, overwrite: bool) -> Services:
    """Decide how to use the run directory (:func:`services.run_records.plan_start`), move
    incomplete checkpoints aside, open the attempt, write ``config.json`` and start
    ``driver.log`` and the progress lines."""
    from services.progress import Progress

    run_dir = cfg.run_dir
    moved = CheckpointStore(run_dir / "checkpoints").sweep() if run_dir.exists() else []
    plan = plan_start(run_dir, resume_mode, overwrite)  # type: ignore[arg-type]
    moved_to = move_aside(run_dir) if plan.move_aside else None
    run_dir.mkdir(parents=True, exist_ok=True)
    lineage = start_attempt(run_dir, plan, checkpoint_step(plan.checkpoint))
    write_atomic(run_dir / "config.json", json.dumps(public_config(cfg), indent=2))
    handler = logging.FileHandler(run_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("stppo").addHandler(handler)
    logging.getLogger("stppo").setLevel(logging.INFO)
    progress = Progress(total_steps=cfg.run.num_steps, run_dir=run_dir)
    for name, reason in moved:
        progress.say(f"checkpoint {name} is incomplete ({reason}): moved to checkpoints/incomplete")
    if moved_to is not None:
        progress.say(f"moved the previous run aside to {moved_to}")
    progress.say(describe_start(plan, lineage))
    if plan.checkpoint is None:
        say_expected_time(cfg, progress)
    return Services(run_dir, plan, RecordWriter(run_dir, lineage), progress)


def say_expected_time(cfg: RunConfig, progress: Any) -> None:
    """Print the run's expected wall time on this CPU (:mod:`services.estimate`) when the
    learner runs on the CPU and the run starts fresh; a failure to estimate is logged, never
    raised (the estimate must not stop a run)."""
    if cfg.ray.learner_gpus > 0:
        return
    try:
        from transformers import AutoConfig

        from actors.hardware import resolve_dtype
        from learner.memory_plan import ModelShape
        from services import estimate
        from services.loop.warm_start_cache import WarmStartCache, warm_start_key

        dtype = resolve_dtype(cfg.learner.dtype, "cpu").name
        kept = cfg.sft.cache and WarmStartCache().lookup(warm_start_key(cfg, dtype)) is not None
        params = ModelShape.from_config(AutoConfig.from_pretrained(cfg.model.path)).policy
        tflops = estimate.matmul_tflops(dtype, cfg.ray.learner_threads)
        phases = estimate.expected_phases(cfg, params, tflops, bool(kept), dtype)
        progress.say(estimate.render(phases, dtype, tflops))
    except Exception as e:
        log.warning("no time estimate: %s: %s", type(e).__name__, e)


def preflight(cfg: RunConfig) -> None:
    """What must hold before anything starts, checked on the driver's machine (the job's
    image is the same on every node): the engine the config names is installed.

    Raises:
        actors.engines.build.EngineUnavailableError: ``rollout.engine = "vllm"``, vLLM not
            installed and no ``rollout.engine_fallback``.
    """
    from actors.engines.build import VLLM_MISSING, EngineUnavailableError, vllm_installed

    rollout = cfg.rollout
    if rollout.engine == "vllm" and not rollout.engine_fallback and not vllm_installed():
        raise EngineUnavailableError(VLLM_MISSING)


def start_services(cfg: RunConfig, control: ControlState, services: Services) -> Services:
    """Metrics, retrieval, Ray, the metrics endpoint, trackers and the control plane."""
    from prometheus_client import CollectorRegistry

    from services.metrics import TrainingMetrics

    services.registry = CollectorRegistry()
    services.metrics = TrainingMetrics(services.registry)
    _start_retrieval(cfg, services)
    _start_ray(cfg, services)
    _start_observability(cfg, control, services)
    return services


def _start_retrieval(cfg: RunConfig, s: Services) -> None:
    if cfg.retrieval.url:
        s.retrieval_url = cfg.retrieval.url.rstrip("/")
        wait_external_retrieval(s.retrieval_url, timeout_s=60.0)
        return
    from services.retrieval_supervisor import RetrievalSupervisor

    s.progress.say(f"starting retrieval server ({cfg.retrieval.server.method})")
    supervisor = RetrievalSupervisor(
        cfg.retrieval.server,
        s.run_dir / "retrieval.log",
        cfg.retrieval.supervisor,
        on_restart=s.metrics.retrieval_server_restarts_total.inc,
    )
    s.retrieval_url = supervisor.start()
    s.retrieval = supervisor
    s.closers.append(supervisor.stop)
    s.progress.say(f"retrieval server ready at {s.retrieval_url}")


def _start_ray(cfg: RunConfig, s: Services) -> None:
    import ray

    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, **kwargs)
    else:
        ray.init(
            address="local", num_cpus=cfg.ray.num_cpus, _temp_dir=str(ray_temp_dir()), **kwargs
        )
    s.closers.append(ray.shutdown)


def _start_observability(cfg: RunConfig, control: ControlState, s: Services) -> None:
    from services.metrics import start_metrics_server

    if cfg.metrics.enabled:
        server = start_metrics_server(s.registry, cfg.metrics.host, cfg.metrics.port)
        s.closers.append(server.close)
        s.metrics_url = f"http://{advertised_host(cfg.metrics.host)}:{server.port}/metrics"
        s.progress.say(f"metrics: {s.metrics_url}")
    if cfg.tracking.backends:
        from services.tracking import Tracker

        s.tracker = Tracker(
            cfg.tracking, s.run_dir, cfg.run.name, public_config(cfg),
            live_config=lambda: public_config(control.config),
        )  # fmt: skip
        s.closers.append(s.tracker.close)
        s.progress.say(f"tracking: {', '.join(cfg.tracking.backends)} in {s.tracker.dir}")
    if cfg.control.enabled:
        _start_control(cfg, control, s)


def _start_control(cfg: RunConfig, control: ControlState, s: Services) -> None:
    """Serve the control plane. The token is never printed: one from ``control.token``
    or ``STPPO_CONTROL_TOKEN`` (how the KubeRay Secret reaches the driver) is only named;
    a generated one is written to ``control.json`` with mode 0600."""
    from services.control import create_control_app, new_token, start_control_server, write_private
    from services.metrics import make_asgi_app

    env_token = os.environ.get("STPPO_CONTROL_TOKEN")
    source = "control.token" if cfg.control.token else None
    source = source or ("STPPO_CONTROL_TOKEN" if env_token else None)
    s.control_token = cfg.control.token or env_token or new_token()
    app = create_control_app(control, s.control_token, make_asgi_app(s.registry))
    server = start_control_server(app, cfg.control.host, cfg.control.port)
    s.closers.append(server.close)
    s.control_url = server.url
    path = s.run_dir / "control.json"
    record = {"url": server.url, "token_source": source or "generated"}
    if source is None:
        record["token"] = s.control_token
    write_private(path, json.dumps(record))
    if source is not None:
        s.progress.say(f"control plane: {server.url}  token: from {source} (not printed)")
        return
    s.progress.say(
        f"control plane: {server.url}  token: in {path} (mode 0600, not printed)\n"
        f"  e.g. STPPO_CONTROL_URL={server.url} STPPO_CONTROL_TOKEN=$(python3 -c "
        f"'import json,sys; print(json.load(open(sys.argv[1]))[\"token\"])' {path}) "
        "stppo ctl set buffer.max_staleness=2"
    )


def install_sigterm(stop: threading.Event, say: Callable[[str], None]) -> None:
    """On SIGTERM: finish the current step, checkpoint, exit 75 (main thread only)."""

    def on_sigterm(signum, frame):
        say("SIGTERM: finishing the current step, checkpointing, exiting with status 75")
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def wait_external_retrieval(url: str, timeout_s: float) -> None:
    """Block until an external retrieval server answers ``/healthz`` 200.

    Raises:
        RuntimeError: not healthy within ``timeout_s`` (message has the last error).
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{url}/healthz", timeout=2.0)
            if resp.status_code == 200:
                return
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise RuntimeError(f"retrieval server {url} not healthy after {timeout_s:.0f} s ({last})")
