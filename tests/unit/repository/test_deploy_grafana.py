"""deploy/grafana: the committed dashboards are the generator's output, every panel's PromQL
parses (promql-parser), and every series and label it names is one the code exports
(services.metrics for the job, retrieval_server.metrics for the retrieval server)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from script_modules import load_script

from services.env import PROJECT_ROOT
from services.metrics import TrainingMetrics, exported_metric_names

GRAFANA = PROJECT_ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
# Grafana's interval macros, replaced by a plausible value before parsing
GRAFANA_MACROS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}
# the dashboards' own query variables (regex matchers), replaced the same way
GRAFANA_VARIABLES = {"$run": ".*", "$pod": ".*"}
# labels Prometheus adds at scrape time (target labels of deploy/prometheus configs)
TARGET_LABELS = {"job", "instance", "component", "namespace", "pod", "run"}

SPEC_SECTION_4 = [
    "clip_ratio", "clip_ratio_turn", "approx_kl", "kl_ref", "entropy", "pg_loss",
    "value_loss", "grad_norm", "clip_bias_norm", "clip_bias_scale", "staleness",
    "reward_mean", "success_rate", "num_turns_mean", "response_tokens_mean", "tokens_per_s",
]  # fmt: skip


def _load_generator():
    return load_script(GRAFANA / "build_dashboards.py", "build_dashboards")


def _metric_objects(*holders) -> list[MetricWrapperBase]:
    return [v for h in holders for v in vars(h).values() if isinstance(v, MetricWrapperBase)] + [
        g for h in holders for g in getattr(h, "step_gauges", {}).values()
    ]


def exported_series() -> dict[str, set[str]]:
    """Series name -> label names, over the job's and the retrieval server's metrics."""
    from retrieval_server.metrics import RetrievalMetrics

    training_registry = CollectorRegistry()
    training = TrainingMetrics(training_registry)
    retrieval = RetrievalMetrics(CollectorRegistry())
    labels_by_base = {m._name: set(m._labelnames) for m in _metric_objects(training, retrieval)}
    out: dict[str, set[str]] = {}
    for registry in (training_registry, retrieval.registry):
        for name in exported_metric_names(registry):
            base = next(
                b for b in sorted(labels_by_base, key=len, reverse=True) if name.startswith(b)
            )
            extra = {"le"} if name.endswith("_bucket") else set()
            out[name] = labels_by_base[base] | extra
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, matcher label names) of every vector selector in ``expr``.

    Raises:
        ValueError: the expression does not parse, or uses an unknown Grafana variable.
    """
    for macro, value in {**GRAFANA_MACROS, **GRAFANA_VARIABLES}.items():
        expr = expr.replace(macro, value)
    if "$" in expr:
        raise ValueError(f"unknown Grafana variable in {expr!r}")
    tree = promql_parser.parse(expr)
    found: list[tuple[str, set[str]]] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, {m.name for m in node.matchers.matchers}))

    promql_parser.walk(tree, visit)
    return found


def grouping_labels(expr: str) -> set[str]:
    """Label names of every ``by (...)`` clause."""
    return {
        label.strip()
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }


def all_targets() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def test_committed_dashboards_equal_generator_output():
    rendered = _load_generator().render_all()
    assert sorted(rendered) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert path.read_text() == rendered[path.name], (
            f"{path.name} is stale: run .venv/bin/python deploy/grafana/build_dashboards.py"
        )


def test_every_panel_query_parses_and_names_exported_series():
    series = exported_series()
    targets = all_targets()
    assert len(targets) >= 40
    for dashboard, title, expr in targets:
        found = selectors(expr)
        assert found, f"{dashboard} / {title}: no metric in {expr!r}"
        for name, matcher_labels in found:
            assert name in series, f"{dashboard} / {title}: {name} is not exported by the code"
            unknown = matcher_labels - series[name] - TARGET_LABELS
            assert not unknown, f"{dashboard} / {title}: {name} has no labels {unknown}"
        names = {n for n, _ in found}
        allowed = set().union(*(series[n] for n in names)) | TARGET_LABELS
        assert grouping_labels(expr) <= allowed, f"{dashboard} / {title}: {expr}"


def test_checker_rejects_bad_queries():
    series = exported_series()
    with pytest.raises(ValueError):
        selectors("sum(rate(stppo_clip_ratio[1m])")  # unbalanced
    with pytest.raises(ValueError, match="Grafana variable"):
        selectors("rate(stppo_dropped_stale_total[$window])")
    ((name, _),) = selectors("rate(stppo_clip_ration[1m])")
    assert name not in series
    ((name, labels),) = selectors('stppo_retrieval_requests_total{endpoint="/retrieve"}')
    assert labels <= series[name]
    assert "reason" not in series["stppo_retrieval_requests_total"]


def test_dashboards_cover_the_spec_and_the_issue():
    text = {p.stem: p.read_text() for p in DASHBOARDS}
    for metric in SPEC_SECTION_4:
        assert (
            f"stppo_{metric}"
            in text["stppo-training-health"] + text["stppo-staleness"] + text["stppo-throughput"]
        ), metric
    for metric in ("stppo_staleness_bucket", "stppo_dropped_stale_total", "stppo_buffer_depth"):
        assert metric in text["stppo-staleness"]
    for metric in ("stppo_tokens_per_s", "stppo_weight_sync_seconds_bucket"):
        assert metric in text["stppo-throughput"]
    for metric in (
        "stppo_retrieval_requests_total",  # QPS
        "stppo_retrieval_request_latency_seconds_bucket",  # latency
        "stppo_retrieval_errors_total",  # errors
    ):
        assert metric in text["stppo-retrieval"]


def test_dashboard_structure():
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        assert dash["uid"] == path.stem
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in dash["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}"
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids))
        var = dash["templating"]["list"][0]
        assert var["type"] == "datasource" and var["query"] == "prometheus"
        assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "run", "pod"]


def test_grafana_configmap_lists_every_dashboard():
    k = yaml.safe_load((GRAFANA / "kustomization.yaml").read_text())
    (gen,) = k["configMapGenerator"]
    assert sorted(Path(f).name for f in gen["files"]) == [p.name for p in DASHBOARDS]
    assert k["generatorOptions"]["labels"]["grafana_dashboard"] == "1"


def test_metric_names_do_not_clash_between_job_and_retrieval_server():
    from retrieval_server.metrics import RetrievalMetrics

    registry = CollectorRegistry()
    TrainingMetrics(registry)
    job = exported_metric_names(registry)
    server = exported_metric_names(RetrievalMetrics(CollectorRegistry()).registry)
    assert job.isdisjoint(server), job & server


def test_job_series_are_filtered_by_run_and_pod_variables():
    """Every stppo_* selector of the job (not the retrieval server's) is filtered by the
    dashboard's `run` and `pod` variables, which list the values of those target labels."""
    checked = 0
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert {"datasource", "run", "pod"} <= set(variables), path.name
        assert variables["run"]["definition"] == "label_values(stppo_learner_step, run)"
        assert variables["pod"]["allValue"] == variables["run"]["allValue"] == ".*"
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                for name, labels in selectors(target["expr"]):
                    if name.startswith("stppo_") and not name.startswith("stppo_retrieval_"):
                        assert {"run", "pod"} <= labels, f"{path.name}: {target['expr']}"
                        checked += 1
    assert checked > 30
