"""services.metrics: values set -> the scraped text over real HTTP carries them, with the
spec's names and HELP text; bad input is rejected before anything is recorded."""

from __future__ import annotations

import math
import re

import httpx
import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import (
    LEARNER_STEP_METRICS,
    TrainingMetrics,
    UnknownMetricError,
    exported_metric_names,
    make_asgi_app,
    start_metrics_server,
    training_metric_names,
)

SPEC_SECTION_4 = {
    "clip_ratio", "clip_ratio_turn", "approx_kl", "kl_ref", "entropy", "pg_loss",
    "value_loss", "grad_norm", "clip_bias_norm", "clip_bias_scale", "staleness",
    "reward_mean", "success_rate", "num_turns_mean", "response_tokens_mean", "tokens_per_s",
}  # fmt: skip


@pytest.fixture
def served():
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    server = start_metrics_server(registry, host="127.0.0.1", port=0)
    yield metrics, server
    server.close()


def _scrape(url: str) -> dict[str, dict]:
    """name -> {"help": str, "samples": {(sample_name, labels tuple): value}}."""
    resp = httpx.get(url, timeout=5.0)
    resp.raise_for_status()
    out = {}
    for fam in text_string_to_metric_families(resp.text):
        out[fam.name] = {
            "help": fam.documentation,
            "type": fam.type,
            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples},
        }
    return out


def test_every_spec_metric_is_exported_with_prefix_and_units_in_help():
    names = training_metric_names()
    for name in SPEC_SECTION_4 - {"staleness"}:
        assert f"stppo_{name}" in names, name
    assert {"stppo_staleness_bucket", "stppo_staleness_sum", "stppo_staleness_count"} <= names
    # section 4, plus what the section 6 stabilisers and the section 7 corrections report
    section_6 = {
        "token_log_ratio_abs_max",
        "clip_ratio_dual",
        "token_bound_ratio",
        "behavior_weight_mean",
        "behavior_weight_capped",
        "behavior_masked",
        "m2po_masked",
        "proximal_approx_abs_error",
    }
    assert set(LEARNER_STEP_METRICS) == (SPEC_SECTION_4 - {"staleness"}) | section_6
    registry = CollectorRegistry()
    TrainingMetrics(registry)
    for fam in registry.collect():
        assert fam.name.startswith("stppo_"), fam.name
        # every HELP names its unit in parentheses, e.g. "(nats per token)"
        assert re.search(r"\([^()]+\)", fam.documentation), fam.name


def test_observe_step_values_scraped_over_http(served):
    metrics, server = served
    step = {name: 0.01 * (i + 1) for i, name in enumerate(sorted(LEARNER_STEP_METRICS))}
    step["clip_ratio"] = 0.125
    metrics.observe_step(step)
    scraped = _scrape(server.url)
    assert scraped["stppo_clip_ratio"]["samples"][("stppo_clip_ratio", ())] == 0.125
    assert scraped["stppo_clip_ratio"]["help"] == LEARNER_STEP_METRICS["clip_ratio"]
    assert scraped["stppo_clip_ratio"]["type"] == "gauge"
    for name, value in step.items():
        assert scraped[f"stppo_{name}"]["samples"][(f"stppo_{name}", ())] == value, name


def test_missing_step_metric_becomes_nan_so_old_variant_values_do_not_linger(served):
    metrics, server = served
    metrics.observe_step({"value_loss": 2.5, "clip_ratio": 0.2})
    metrics.observe_step({"clip_ratio": 0.3})  # e.g. after a live switch to GRPO
    scraped = _scrape(server.url)
    assert math.isnan(scraped["stppo_value_loss"]["samples"][("stppo_value_loss", ())])
    assert scraped["stppo_clip_ratio"]["samples"][("stppo_clip_ratio", ())] == 0.3


def test_observe_step_accepts_numpy_and_0d_tensor_values(served):
    import torch

    metrics, server = served
    metrics.observe_step({"approx_kl": np.float32(0.5), "entropy": torch.tensor(1.25)})
    scraped = _scrape(server.url)
    assert scraped["stppo_approx_kl"]["samples"][("stppo_approx_kl", ())] == 0.5
    assert scraped["stppo_entropy"]["samples"][("stppo_entropy", ())] == 1.25


def test_observe_step_unknown_key_raises_and_sets_nothing():
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    metrics.observe_step({"clip_ratio": 0.1})
    with pytest.raises(UnknownMetricError, match="clip_ration"):
        metrics.observe_step({"clip_ratio": 0.9, "clip_ration": 0.9})
    assert registry.get_sample_value("stppo_clip_ratio") == 0.1
    # explicitly ignored keys are fine
    metrics.observe_step({"clip_ratio": 0.4, "step": 3}, ignore={"step"})
    assert registry.get_sample_value("stppo_clip_ratio") == 0.4


def test_observe_step_non_number_raises_naming_key_and_sets_nothing():
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    metrics.observe_step({"clip_ratio": 0.1, "entropy": 2.0})
    with pytest.raises(TypeError, match="'entropy'"):
        metrics.observe_step({"clip_ratio": 0.7, "entropy": "high"})
    assert registry.get_sample_value("stppo_clip_ratio") == 0.1


def test_staleness_histogram_buckets_hand_counted(served):
    metrics, server = served
    metrics.observe_staleness([0, 1, 1, 3, 20])
    s = _scrape(server.url)["stppo_staleness"]["samples"]
    # cumulative: le=0 -> {0}=1; le=1 -> {0,1,1}=3; le=2 -> 3; le=3 -> 4; le=16 -> 4; +Inf -> 5
    expected = {"0.0": 1, "1.0": 3, "2.0": 3, "3.0": 4, "16.0": 4, "+Inf": 5}
    for le, count in expected.items():
        assert s[("stppo_staleness_bucket", (("le", le),))] == count, le
    assert s[("stppo_staleness_count", ())] == 5
    assert s[("stppo_staleness_sum", ())] == 25  # 0+1+1+3+20


def test_staleness_rejects_negative_before_recording():
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    with pytest.raises(ValueError, match="non-negative integer"):
        metrics.observe_staleness([1, -1])
    with pytest.raises(ValueError, match="non-negative integer"):
        metrics.observe_staleness([1.5])
    assert registry.get_sample_value("stppo_staleness_count") == 0


def test_counters_labels_and_service_gauges_over_http(served):
    metrics, server = served
    metrics.trajectories_generated_total.inc(7)
    metrics.dropped_stale_total.inc(2)
    metrics.count_retrieval_error("timeout")
    metrics.count_retrieval_error("timeout", 2)
    metrics.count_retrieval_error("http_5xx")
    metrics.count_malformed_answer("no_answer_tag")
    metrics.set_learner_state(learner_step=5, policy_version=5)
    metrics.set_live_config(
        max_staleness=2, variant="s_ppo", learning_rate=1e-6, clip_eps=0.2, num_rollout_actors=3
    )
    metrics.set_variant("ppo")  # a live change replaces the label
    metrics.buffer_depth.set(4)
    metrics.observe_weight_sync(0.3)
    s = {}
    for fam in _scrape(server.url).values():
        s.update(fam["samples"])
    assert s[("stppo_trajectories_generated_total", ())] == 7
    assert s[("stppo_dropped_stale_total", ())] == 2
    assert s[("stppo_retrieval_client_errors_total", (("reason", "timeout"),))] == 3  # 1 + 2
    assert s[("stppo_retrieval_client_errors_total", (("reason", "http_5xx"),))] == 1
    assert s[("stppo_malformed_answers_total", (("reason", "no_answer_tag"),))] == 1
    assert s[("stppo_learner_step", ())] == 5
    assert s[("stppo_max_staleness", ())] == 2
    assert s[("stppo_learning_rate", ())] == 1e-6
    assert s[("stppo_algorithm_variant_info", (("variant", "ppo"),))] == 1
    assert ("stppo_algorithm_variant_info", (("variant", "s_ppo"),)) not in s
    assert s[("stppo_buffer_depth", ())] == 4
    assert s[("stppo_weight_sync_seconds_bucket", (("le", "0.25"),))] == 0
    assert s[("stppo_weight_sync_seconds_bucket", (("le", "0.5"),))] == 1


def test_bad_labels_and_values_rejected():
    metrics = TrainingMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="reason"):
        metrics.count_retrieval_error("")
    with pytest.raises(ValueError, match="weight sync"):
        metrics.observe_weight_sync(-1.0)
    with pytest.raises(ValueError, match="learner_step"):
        metrics.set_learner_state(-1, 0)


def test_explicit_registry_only_never_global():
    before = {fam.name for fam in REGISTRY.collect()}
    registry = CollectorRegistry()
    TrainingMetrics(registry)
    after = {fam.name for fam in REGISTRY.collect()}
    assert before == after
    assert not any(n.startswith("stppo_") for n in after)
    # a second instance on the same registry is refused (duplicated series)
    with pytest.raises(ValueError, match="Duplicated"):
        TrainingMetrics(registry)
    # but two registries coexist
    TrainingMetrics(CollectorRegistry())


def test_counter_names_end_in_total():
    names = training_metric_names()
    for base in (
        "trajectories_generated", "trajectories_consumed", "dropped_stale", "retrieval_client_errors",
        "retrieval_failed_trajectories", "actor_restarts", "nonfinite_steps",
        "malformed_answers",
    ):  # fmt: skip
        assert f"stppo_{base}_total" in names, base


def test_asgi_app_serves_same_registry():
    """Mounted in FastAPI, driven through a real ASGI transport (the control plane's route)."""
    from fastapi import FastAPI

    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    metrics.observe_step({"clip_ratio": 0.375})
    app = FastAPI()
    app.mount("/metrics", make_asgi_app(registry))

    async def get() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get("/metrics/")
            r.raise_for_status()
            return r.text

    import asyncio

    text = asyncio.run(get())
    assert "stppo_clip_ratio 0.375" in text
    assert "# HELP stppo_clip_ratio Token-weighted fraction" in text


def test_server_port_zero_picks_free_port_and_close_releases_it():
    import socket

    registry = CollectorRegistry()
    server = start_metrics_server(registry, host="127.0.0.1", port=0)
    assert server.port > 0
    server.close()
    with socket.socket() as s:  # the port is free again after close
        s.bind(("127.0.0.1", server.port))


def test_token_staleness_counter_by_label():
    metrics = TrainingMetrics(CollectorRegistry())
    metrics.observe_token_staleness({0: 5, 1: 3, 20: 2})
    metrics.observe_token_staleness({1: 4})
    counter = metrics.consumed_policy_tokens_total
    assert counter.labels(staleness="0")._value.get() == 5
    assert counter.labels(staleness="1")._value.get() == 7
    assert counter.labels(staleness="17+")._value.get() == 2
    with pytest.raises(ValueError, match="non-negative"):
        metrics.observe_token_staleness({-1: 2})


def test_exported_metric_names_match_scraped_sample_names(served):
    """The derived names equal what a scrape shows once every family has a sample."""
    metrics, server = served
    metrics.count_retrieval_error("timeout")
    metrics.count_malformed_answer("no_answer_tag")
    metrics.count_config_change("buffer.max_staleness")
    metrics.set_variant("st_ppo")
    metrics.observe_token_staleness({0: 5, 1: 3})
    metrics.observe_guard("act", "lower_staleness", {"malformed_rate": 0.1})
    text = httpx.get(server.url, timeout=5.0).text
    scraped = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    derived = exported_metric_names(metrics.registry)
    assert scraped <= derived
    # only the histograms' _created series may be absent from a scrape
    assert {n for n in derived - scraped if not n.endswith("_created")} == set()
