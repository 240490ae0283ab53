"""Generate the Grafana dashboards in deploy/grafana/dashboards/ from the panel lists below.

    .venv/bin/python deploy/grafana/build_dashboards.py          # rewrite the JSON files
    .venv/bin/python deploy/grafana/build_dashboards.py --check  # exit 1 if they are stale

The committed JSON is what Grafana imports (file provisioning, or the kube-prometheus-stack
sidecar through ConfigMap ``stppo-grafana-dashboards``); tests/unit/repository/test_deploy_grafana.py
checks it equals this script's output, that every PromQL expression parses, and that every
metric it names is exported by ``services.metrics`` or ``retrieval_server.metrics``.

Panels use the ``datasource`` template variable (any Prometheus) and Grafana's
``$__rate_interval`` for rate windows. The job's series (``stppo_*``, not the retrieval
server's) are filtered by the ``run`` and ``pod`` variables: target labels Prometheus adds on
Kubernetes (deploy/prometheus: ``run`` from the pod label ``stppo.io/run``). "All" is ``.*``,
which also matches series without those labels (a local Prometheus).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
RETRIEVE = 'endpoint="/retrieve"'
"""The retrieval endpoint the actors call (the error ratio leaves out health checks)."""


@dataclass(frozen=True)
class Query:
    """One PromQL target: ``expr`` and the legend template (``{{label}}``)."""

    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """A panel: ``kind`` is a Grafana panel type (timeseries, stat, heatmap); ``unit`` a
    Grafana unit id (percentunit, s, short, none...)."""

    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    extra_options: dict = field(default_factory=dict)


def q(expr: str, legend: str = "") -> Query:
    """Shorthand for :class:`Query`."""
    return Query(expr, legend)


def quantiles(metric: str, legend_prefix: str = "") -> tuple[Query, ...]:
    """p50 / p90 / p99 of a histogram ``metric`` (base name, without ``_bucket``)."""
    return tuple(
        q(
            f"histogram_quantile({p}, sum by (le) (rate({metric}_bucket[{RATE}])))",
            f"{legend_prefix}p{int(p * 100)}",
        )
        for p in (0.5, 0.9, 0.99)
    )


TRAINING = [
    Panel("Reward (mean of consumed batch)", (q("stppo_reward_mean", "reward"),)),
    Panel(
        "Success rate",
        (q("stppo_success_rate", "success"),),
        unit="percentunit",
    ),
    Panel(
        "Clip ratio (token and turn)",
        (q("stppo_clip_ratio", "token"), q("stppo_clip_ratio_turn", "turn")),
        unit="percentunit",
        description="Fraction of masked tokens / turns whose importance ratio was clipped.",
    ),
    Panel(
        "KL",
        (
            q("stppo_approx_kl", "approx_kl (behaviour||current, k1)"),
            q("stppo_kl_ref", "kl_ref (k3)"),
        ),
        unit="none",
    ),
    Panel("Clipping-bias norm ||C||", (q("stppo_clip_bias_norm", "||C||"),), unit="none"),
    Panel("Clipping-bias scale s", (q("stppo_clip_bias_scale", "s"),), unit="none"),
    Panel("Entropy", (q("stppo_entropy", "entropy"),), unit="none"),
    Panel("Gradient norm (before clipping)", (q("stppo_grad_norm", "grad_norm"),), unit="none"),
    Panel(
        "Losses",
        (q("stppo_pg_loss", "pg_loss"), q("stppo_value_loss", "value_loss")),
        unit="none",
    ),
    Panel(
        "Turns and response tokens per trajectory",
        (q("stppo_num_turns_mean", "turns"), q("stppo_response_tokens_mean", "response tokens")),
    ),
    Panel(
        "Learner step and policy version",
        (q("stppo_learner_step", "learner_step"), q("stppo_policy_version", "policy_version")),
    ),
    Panel(
        "Algorithm variant",
        (q("max by (variant) (stppo_algorithm_variant_info) == 1", "{{variant}}"),),
        kind="stat",
        unit="none",
        extra_options={"textMode": "name"},
    ),
    Panel(
        "Live-tunable settings",
        (
            q("stppo_learning_rate", "learning_rate"),
            q("stppo_clip_eps", "clip_eps"),
            q("stppo_max_staleness", "max_staleness"),
            q("stppo_num_rollout_actors", "rollout actors"),
        ),
    ),
    Panel(
        "Config changes, non-finite steps, malformed answers",
        (
            q(f"sum by (field) (increase(stppo_config_changes_total[{RATE}]))", "change {{field}}"),
            q(f"increase(stppo_nonfinite_steps_total[{RATE}])", "non-finite steps"),
            q(
                f"sum by (reason) (rate(stppo_malformed_answers_total[{RATE}]))",
                "malformed/s {{reason}}",
            ),
        ),
    ),
]

STALENESS = [
    Panel(
        "Staleness distribution (learner steps)",
        (q(f"sum by (le) (increase(stppo_staleness_bucket[{RATE}]))", "{{le}}"),),
        kind="heatmap",
        unit="short",
        width=24,
        extra_options={"calculate": False, "yAxis": {"unit": "short"}},
        description="learner_version - policy_version of consumed trajectories.",
    ),
    Panel(
        "Staleness quantiles and mean",
        (
            *quantiles("stppo_staleness"),
            q(
                f"rate(stppo_staleness_sum[{RATE}]) / rate(stppo_staleness_count[{RATE}])",
                "mean",
            ),
            q("stppo_max_staleness", "bound (max_staleness)"),
        ),
    ),
    Panel(
        "Dropped as stale",
        (
            q(f"rate(stppo_dropped_stale_total[{RATE}])", "dropped/s"),
            q(
                f"rate(stppo_dropped_stale_total[{RATE}]) / (rate(stppo_dropped_stale_total[{RATE}])"
                f" + rate(stppo_trajectories_consumed_total[{RATE}]))",
                "dropped fraction",
            ),
        ),
    ),
    Panel("Buffer depth", (q("stppo_buffer_depth", "trajectories waiting"),)),
    Panel(
        "Generated vs consumed",
        (
            q(f"rate(stppo_trajectories_generated_total[{RATE}])", "generated/s"),
            q(f"rate(stppo_trajectories_consumed_total[{RATE}])", "consumed/s"),
        ),
    ),
]

THROUGHPUT = [
    Panel(
        "Tokens per second",
        (
            q("stppo_tokens_per_s", "learner (trained tokens/s)"),
            q("stppo_rollout_tokens_per_s", "rollout (generated tokens/s)"),
        ),
    ),
    Panel(
        "Trajectories per second",
        (
            q("stppo_trajectories_per_s", "learner consumed"),
            q(f"rate(stppo_trajectories_generated_total[{RATE}])", "generated"),
        ),
    ),
    Panel(
        "Weight sync time",
        (
            *quantiles("stppo_weight_sync_seconds"),
            q(
                f"rate(stppo_weight_sync_seconds_sum[{RATE}]) / "
                f"rate(stppo_weight_sync_seconds_count[{RATE}])",
                "mean",
            ),
        ),
        unit="s",
    ),
    Panel(
        "Rollout actors and restarts",
        (
            q("stppo_num_rollout_actors", "requested"),
            q("increase(stppo_actor_restarts_total[1h])", "restarts (1 h)"),
        ),
    ),
    Panel(
        "Retrieval failures seen by actors",
        (
            q(
                f"sum by (reason) (rate(stppo_retrieval_client_errors_total[{RATE}]))",
                "{{reason}}",
            ),
            q(
                f"rate(stppo_retrieval_failed_trajectories_total[{RATE}])",
                "trajectories with a failed search",
            ),
        ),
        unit="reqps",
    ),
]

RETRIEVAL = [
    Panel(
        "Requests per second by status",
        (
            q(
                "sum by (status) (rate(stppo_retrieval_requests_total"
                f'{{endpoint="/retrieve"}}[{RATE}]))',
                "{{status}}",
            ),
        ),
        unit="reqps",
    ),
    Panel(
        "Queries per second",
        (q(f"rate(stppo_retrieval_queries_total[{RATE}])", "queries/s"),),
        unit="short",
    ),
    Panel("POST /retrieve latency", quantiles("stppo_retrieval_request_latency_seconds"), unit="s"),
    Panel("Queries per request", quantiles("stppo_retrieval_queries_per_request")),
    Panel(
        "Errors by reason",
        (q(f"sum by (reason) (rate(stppo_retrieval_errors_total[{RATE}]))", "{{reason}}"),),
        unit="reqps",
    ),
    Panel(
        "Error ratio of /retrieve (4xx + 5xx)",
        (
            q(
                # what the actors see (a loading server's 503s to /healthz are not errors);
                # no 4xx/5xx series until the first error: 0 then, not "No data"
                f'(sum(rate(stppo_retrieval_requests_total{{{RETRIEVE},status=~"[45].."}}[{RATE}]))'
                f" or vector(0)) / sum(rate(stppo_retrieval_requests_total{{{RETRIEVE}}}[{RATE}]))",
                "errors / requests",
            ),
        ),
        unit="percentunit",
    ),
    Panel(
        "Index",
        (
            q("stppo_retrieval_ready", "ready"),
            q("stppo_retrieval_index_passages", "passages"),
            q("stppo_retrieval_index_load_seconds", "load time (s)"),
        ),
        kind="stat",
    ),
    Panel(
        "Index size on disk",
        (q("stppo_retrieval_index_bytes", "bytes"),),
        unit="bytes",
        kind="stat",
    ),
]

DASHBOARDS = {
    "stppo-training-health": ("st-ppo: training health", TRAINING),
    "stppo-staleness": ("st-ppo: staleness and buffer", STALENESS),
    "stppo-throughput": ("st-ppo: throughput and weight sync", THROUGHPUT),
    "stppo-retrieval": ("st-ppo: retrieval server", RETRIEVAL),
}


JOB_FILTER = 'run=~"$run", pod=~"$pod"'
"""Matchers added to every selector of the job's series."""

_JOB_SERIES = re.compile(r"\b(stppo_(?!retrieval_)[a-z0-9_]+)(\{([^}]*)\})?")


def filter_job_series(expr: str) -> str:
    """Add :data:`JOB_FILTER` to every ``stppo_*`` selector (not ``stppo_retrieval_*``).

    >>> filter_job_series('sum by (le) (rate(stppo_staleness_bucket[1m]))')
    'sum by (le) (rate(stppo_staleness_bucket{run=~"$run", pod=~"$pod"}[1m]))'
    """

    def add(m: re.Match) -> str:
        inner = m.group(3)
        return f"{m.group(1)}{{{inner + ', ' if inner else ''}{JOB_FILTER}}}"

    return _JOB_SERIES.sub(add, expr)


def _label_variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,  # on time-range change: new runs and pods show up
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {},
        "hide": 0,
        "sort": 1,
    }


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    """One Grafana panel (schema of Grafana 10/11 dashboards)."""
    targets = [
        {
            "datasource": DATASOURCE,
            "expr": filter_job_series(query.expr),
            "legendFormat": query.legend,
            "refId": chr(ord("A") + i),
        }
        for i, query in enumerate(panel.queries)
    ]
    options: dict = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if panel.kind == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    options.update(panel.extra_options)
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": options,
        "targets": targets,
    }


def dashboard_json(uid: str, title: str, panels: list[Panel]) -> dict:
    """A whole dashboard with a ``datasource`` variable; panels flow two per row."""
    out, x, y = [], 0, 0
    for i, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y = 0, y + 8
        out.append(panel_json(panel, i, x, y))
        x += panel.width
    return {
        "uid": uid,
        "title": title,
        "tags": ["stppo"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                _label_variable("run", "label_values(stppo_learner_step, run)"),
                _label_variable("pod", 'label_values(stppo_learner_step{run=~"$run"}, pod)'),
            ]
        },
        "annotations": {"list": []},
        "panels": out,
    }


def render_all() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"{uid}.json": json.dumps(dashboard_json(uid, title, panels), indent=2) + "\n"
        for uid, (title, panels) in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with ``--check`` report stale files and return 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="Fail if the files are stale.")
    args = parser.parse_args(argv)
    stale = []
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        path = OUT_DIR / name
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale dashboards (run {Path(__file__).name}): {stale}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
