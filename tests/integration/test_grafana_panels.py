"""Every query of every Grafana panel (deploy/grafana/dashboards/*.json, as Grafana imports
them) finds series in a real Prometheus that scraped a short real run, so a dashboard cannot
silently show nothing.

A 2-step run on the tiny Llama (real Ray, retrieval server, DeepSpeed; tests/integration/
test_driver.py) serves the driver's ``/metrics`` and the retrieval server's; a real
Prometheus (Debian's package) scrapes both every second with the shipped local config,
targets rewritten, and the driver's target labelled ``run`` and ``pod`` as the Kubernetes
scrape configs label it. During the run the test applies a live config change through the
control plane and sends the retrieval server one good and one rejected request, so the
panels of config changes and retrieval errors have something to show. After the run every
panel query is evaluated, Grafana's variables substituted, at the last moment both targets
were up: the run's final values, fixed, so nothing depends on catching the run live.

Each query is asked three ways: ``$run``/``$pod`` set to the run's labels (one run picked in
Grafana), set to ``.*`` ("All", also what a local Prometheus without those labels needs), and
set to another run's name (then a query filtered by ``$run`` must find nothing: the filter
really selects). The dashboards' ``run`` and ``pod`` variables must list the run's labels.
Queries whose series cannot exist in a healthy CPU run are listed in :data:`NO_SERIES` with
the reason; each must really find nothing, so the list cannot hide a broken query.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from test_driver import RunInThread, read_jsonl, tiny_run_config
from test_prometheus_scrape import LOCAL_CONFIG, _prometheus_binary, _start_prometheus

from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration

DASHBOARDS = PROJECT_ROOT / "deploy" / "grafana" / "dashboards"
SCRAPE_INTERVAL_S = 1
WAIT_S = 600.0  # generous: a loaded 2-core machine; the test is not about speed
POD = "stppo-driver-test"  # the driver target's `pod` label (a pod name on Kubernetes)
OTHER_RUN = "some-other-run"
# Grafana's interval macros at a 1 h range (what its $__rate_interval gives at the default
# 15 s scrape interval of a Prometheus data source)
MACROS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}

NO_SERIES: dict[tuple[str, str, str], str] = {
    ("stppo-throughput", "Retrieval failures seen by actors", "A"): (
        "stppo_retrieval_client_errors_total has a series per failure reason, created by an "
        "actor's first failed retrieval request; a healthy run has none"
    ),
}
"""(dashboard uid, panel title, query refId) -> why the query finds no series in this run."""


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.dashboard, self.panel, self.ref_id)


def _panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # panels inside collapsed rows


def dashboard_queries() -> list[PanelQuery]:
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in _panels(dashboard["panels"]):
            for target in panel.get("targets", []):
                out.append(
                    PanelQuery(dashboard["uid"], panel["title"], target["refId"], target["expr"])
                )
    return out


def dashboard_variables() -> set[tuple[str, str]]:
    """``(selector, label)`` of every ``label_values(selector, label)`` query variable."""
    out = set()
    for path in sorted(DASHBOARDS.glob("*.json")):
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] == "query":
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
                assert m, f"{path.name}: variable {variable['name']}: {variable['definition']}"
                out.add((m.group(1), m.group(2)))
    return out


def substitute(expr: str, run: str, pod: str) -> str:
    """``expr`` with Grafana's macros and the dashboards' variables replaced; a variable this
    test does not know fails (substituting it would be guessing)."""
    for macro, value in MACROS.items():
        expr = expr.replace(macro, value)
    for name, value in (("run", run), ("pod", pod)):
        expr = re.sub(rf"\$\{{{name}\}}|\${name}\b", lambda _, v=value: v, expr)
    assert "$" not in expr and "[[" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def _scrape_config(driver: str, retrieval: str, run_name: str) -> dict:
    """The shipped local config, both jobs pointed at the run's ports; the driver's target
    carries ``run`` and ``pod`` as on Kubernetes (deploy/prometheus/prometheus-k8s.yml)."""
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"stppo-driver", "stppo-retrieval"}, "a new scrape job: scrape it here"
    jobs["stppo-driver"]["static_configs"][0]["targets"] = [driver]
    jobs["stppo-driver"]["static_configs"][0]["labels"].update(run=run_name, pod=POD)
    jobs["stppo-retrieval"]["static_configs"][0]["targets"] = [retrieval]
    config["global"]["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
    config["global"]["scrape_timeout"] = f"{SCRAPE_INTERVAL_S}s"
    return config


def _api(api: str, path: str, params: dict, deadline: float) -> object:
    """``data`` of a successful answer; retried while Prometheus is not ready (503) or the
    connection fails, raised on a query error (a broken expression: HTTP 400/422)."""
    last: object = None
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{api}{path}", params=params, timeout=30.0)
        except httpx.HTTPError as e:
            last = e
        else:
            if resp.status_code in (400, 422):
                raise AssertionError(f"{path} {params}: {resp.text.strip()}")
            if resp.status_code == 200 and resp.json().get("status") == "success":
                return resp.json()["data"]
            last = f"HTTP {resp.status_code}: {resp.text.strip()[:500]}"
        time.sleep(0.5)
    raise AssertionError(f"{path} {params}: no answer within {WAIT_S} s; last: {last}")


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def _find(api: str, at: float, deadline: float):
    def evaluate(expr: str) -> list[dict]:
        return _api(api, "/api/v1/query", {"query": expr, "time": at}, deadline)["result"]

    return evaluate


def check_panels(api: str, at: float, run_name: str, deadline: float) -> None:
    """Every dashboard query at time ``at``: series with the run picked and with "All",
    none for another run, none for an allowlisted query; the variables list the run."""
    evaluate = _find(api, at, deadline)
    picked, everything, other = [], [], []
    for query in dashboard_queries():
        found = evaluate(substitute(query.expr, run_name, POD))
        found_all = evaluate(substitute(query.expr, ".*", ".*"))
        if query.key in NO_SERIES:
            if found or found_all:
                other.append(f"{query.key} is allowlisted but finds {found or found_all}")
            continue
        if not found:
            picked.append(f"{query.key}: {query.expr}")
        if not found_all:
            everything.append(f"{query.key}: {query.expr}")
        if "$run" in query.expr and evaluate(substitute(query.expr, OTHER_RUN, ".*")):
            other.append(f"{query.key} finds series of run {OTHER_RUN!r}: {query.expr}")
    assert not picked, f"no series with run={run_name!r}, pod={POD!r}:\n" + "\n".join(picked)
    assert not everything, "no series with run and pod 'All':\n" + "\n".join(everything)
    assert not other, "\n".join(other)

    # the dashboards' query variables (Grafana's label_values(selector, label)) list this
    # run and pod, with the run picked
    window = {"start": at - 60, "end": at}
    expected = {"run": [run_name], "pod": [POD]}
    for selector, label in dashboard_variables():
        match = substitute(selector, run_name, POD)
        values = _api(api, f"/api/v1/label/{label}/values", {"match[]": match, **window}, deadline)
        assert values == expected[label], (selector, label, values)


def first_found(api: str, expr: str, deadline: float) -> float:
    """The time of the first evaluation of ``expr`` (polled every scrape) that finds series."""
    while time.monotonic() < deadline:
        now = time.time()
        if _api(api, "/api/v1/query", {"query": expr, "time": now}, deadline)["result"]:
            return now
        time.sleep(SCRAPE_INTERVAL_S)
    raise AssertionError(f"{expr}: no series within {WAIT_S} s")


def last_moment_up(api: str, since: float, deadline: float) -> float:
    """The last evaluation time at which both targets were up, once the driver's endpoint
    (closed with the run) has been found gone by a scrape."""
    while time.monotonic() < deadline:
        up = _api(api, "/api/v1/query", {"query": 'up{job="stppo-driver"}'}, deadline)
        if up["result"] and up["result"][0]["value"][1] == "0":
            break
        time.sleep(SCRAPE_INTERVAL_S)
    now = time.time()
    both_up = _api(
        api,
        "/api/v1/query_range",
        {"query": "count(up == 1) == 2", "start": since, "end": now, "step": "1s"},
        deadline,
    )
    assert both_up["result"], "Prometheus never saw both targets up"
    return max(float(t) for t, _ in both_up["result"][0]["values"])


def test_every_panel_query_finds_series_of_a_real_run(tmp_path: Path, tiny_llama_dir: Path):
    binary = _prometheus_binary()
    queries = dashboard_queries()
    assert len({q.dashboard for q in queries}) == 4 and len(queries) > 40, queries
    assert set(NO_SERIES) <= {q.key for q in queries}, "an allowlisted query no longer exists"
    assert {label for _, label in dashboard_variables()} == {"run", "pod"}

    cfg = tiny_run_config(tmp_path, tiny_llama_dir, **{"run.num_steps": 2, "rollout.num_actors": 1})
    run = RunInThread(cfg)
    services = run.wait_for(
        lambda: (s := run.driver.services) is not None and s.metrics_url and s.control_url and s,
        WAIT_S,
        "the metrics endpoint and the control plane",
    )
    # a live change: the config-changes panel counts it by field
    resp = httpx.patch(
        f"{services.control_url}/config",
        json={"buffer": {"max_staleness": 2}},
        headers={"Authorization": f"Bearer {services.control_token}"},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text

    config_path = tmp_path / "prometheus.yml"
    config = _scrape_config(
        _host_port(services.metrics_url), _host_port(services.retrieval_url), cfg.run.name
    )
    config_path.write_text(yaml.safe_dump(config))
    started = time.time()
    proc, port, log = _start_prometheus(binary, config_path, tmp_path)
    api = f"http://127.0.0.1:{port}"
    try:
        # the retrieval server answers one request and rejects one (topk 0): the panels of
        # requests by status, errors by reason and the error ratio have both kinds (the
        # tiny model's answers are all malformed, single-turn: the run itself never searches)
        good = httpx.post(
            f"{services.retrieval_url}/retrieve",
            json={"queries": ["who wrote hamlet"], "topk": 1},
            timeout=60,
        )
        assert good.status_code == 200, good.text
        # a healthy server (requests answered, no error yet) shows an error ratio of 0, not
        # "No data": the 4xx/5xx series of /retrieve do not exist before its first error
        # (first_found: the counters exist once scraped; a second request raises their rate)
        deadline = time.monotonic() + WAIT_S
        retrieve = 'stppo_retrieval_requests_total{endpoint="/retrieve"}'
        first_found(api, retrieve, deadline)
        again = httpx.post(
            f"{services.retrieval_url}/retrieve",
            json={"queries": ["who wrote hamlet"], "topk": 1},
            timeout=60,
        )
        assert again.status_code == 200, again.text
        rate = f"sum(rate({retrieve}[{MACROS['$__rate_interval']}])) > 0"
        healthy = first_found(api, rate, deadline)
        (ratio,) = [q for q in dashboard_queries() if q.panel.startswith("Error ratio")]
        found = _find(api, healthy, deadline)(substitute(ratio.expr, ".*", ".*"))
        assert [float(r["value"][1]) for r in found] == [0.0], (ratio.expr, found)
        bad = httpx.post(
            f"{services.retrieval_url}/retrieve", json={"queries": ["x"], "topk": 0}, timeout=60
        )
        assert bad.status_code == 422, bad.text

        run.thread.join(WAIT_S)
        assert not run.thread.is_alive(), "run did not finish"
        if run.error is not None:
            raise run.error
        assert [s["step"] for s in read_jsonl(cfg.run_dir / "steps.jsonl")] == [1, 2]
        assert read_jsonl(cfg.run_dir / "config_changes.jsonl"), "the live change never applied"

        # the moment to look at: the last one with both targets up (the run's final values)
        deadline = time.monotonic() + WAIT_S
        at = last_moment_up(api, started, deadline)
        check_panels(api, at, cfg.run.name, deadline)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
