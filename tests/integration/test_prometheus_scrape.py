"""A real Prometheus (Debian's package, installed by scripts/install_system_deps.sh) scrapes a
metrics endpoint served by services.metrics, using the shipped local scrape config with only
the target rewritten; stppo_clip_ratio is read back through the HTTP query API, then changed
and read back again (so the value really comes from live scrapes)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from services.env import PROJECT_ROOT
from services.metrics import TrainingMetrics, start_metrics_server

pytestmark = pytest.mark.integration

LOCAL_CONFIG = PROJECT_ROOT / "deploy" / "prometheus" / "prometheus-local.yml"
WAIT_S = 180.0  # generous: a loaded 2-core machine; the test is not about speed


def _prometheus_binary() -> str:
    path = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )
    if path is None:
        pytest.skip(
            "Debian package `prometheus` is not installed; scripts/install_system_deps.sh "
            "(run by `make test`) installs it where apt-get is available"
        )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_prometheus(binary: str, config_path: Path, tmp_path: Path, attempts: int = 5):
    """Start Prometheus on a free loopback port; returns ``(proc, port, log)``.

    Prometheus cannot report a port-0 bind back, so the port is picked, released and handed
    over; if another process takes it in between (Prometheus exits with "address already in
    use") another port is tried, instead of the test failing on a race.
    """
    for attempt in range(attempts):
        port = _free_port()
        log_path = tmp_path / f"prometheus-{attempt}.log"
        log = log_path.open("w")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 5.0
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            return proc, port, log
        log.close()
        if "address already in use" not in log_path.read_text():
            raise AssertionError(f"prometheus exited: {log_path.read_text()[-2000:]}")
    raise AssertionError(f"no free port for prometheus after {attempts} attempts")


def _scrape_config(target: str, scrape_interval_s: int) -> dict:
    """The shipped local config, driver job only, pointed at ``target``."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    (driver_job,) = [j for j in config["scrape_configs"] if j["job_name"] == "stppo-driver"]
    driver_job["static_configs"][0]["targets"] = [target]
    config["scrape_configs"] = [driver_job]
    config["global"]["scrape_interval"] = f"{scrape_interval_s}s"
    config["global"]["scrape_timeout"] = f"{scrape_interval_s}s"
    return config


def _query_until(api: str, query: str, predicate, deadline: float) -> list[dict]:
    last: object = None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{api}/api/v1/query", params={"query": query}, timeout=30.0)
            if resp.status_code != 200:
                # While Prometheus opens its TSDB it answers 503 "Service Unavailable" in plain
                # text on every endpoint (CI once parsed that as JSON): not ready yet, ask again
                last = f"HTTP {resp.status_code}: {resp.text.strip()}"
            else:
                body = resp.json()
                last = body
                if body.get("status") == "success" and predicate(body["data"]["result"]):
                    return body["data"]["result"]
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.5)
    raise AssertionError(f"query {query!r} not satisfied within {WAIT_S} s; last answer: {last}")


@pytest.fixture
def metrics_endpoint():
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    server = start_metrics_server(registry, host="127.0.0.1", port=0)
    yield metrics, server
    server.close()


def test_prometheus_scrapes_clip_ratio(tmp_path: Path, metrics_endpoint):
    binary = _prometheus_binary()
    metrics, server = metrics_endpoint
    metrics.observe_step({"clip_ratio": 0.3125, "approx_kl": 0.002})
    metrics.dropped_stale_total.inc(3)

    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(_scrape_config(f"127.0.0.1:{server.port}", 1)))
    proc, port, log = _start_prometheus(binary, config_path, tmp_path)
    api = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        first = _query_until(api, "stppo_clip_ratio", lambda r: len(r) == 1, deadline)
        (series,) = first
        assert series["metric"]["__name__"] == "stppo_clip_ratio"
        assert series["metric"]["job"] == "stppo-driver"
        assert series["metric"]["component"] == "driver"
        assert series["metric"]["instance"] == f"127.0.0.1:{server.port}"
        assert float(series["value"][1]) == 0.3125

        (dropped,) = _query_until(api, "stppo_dropped_stale_total", lambda r: len(r) == 1, deadline)
        assert float(dropped["value"][1]) == 3.0

        # a new step's value shows up on a later scrape
        metrics.observe_step({"clip_ratio": 0.0625})
        _query_until(
            api,
            "stppo_clip_ratio",
            lambda r: len(r) == 1 and float(r[0]["value"][1]) == 0.0625,
            time.monotonic() + WAIT_S,
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
    assert proc.returncode is not None
