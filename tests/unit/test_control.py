"""Control plane over real HTTP: auth, validation, all-or-nothing, applied at step boundary."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.config import ConfigError, load_config
from services.control import (
    ControlState,
    changed_fields,
    create_control_app,
    is_live_field,
    start_control_server,
)
from services.metrics import TrainingMetrics, make_asgi_app

TOKEN = "t" * 32


@pytest.fixture
def served():
    state = ControlState(
        config=load_config(None, ["algorithm.variant=ppo", "buffer.max_staleness=1"])
    )
    state.publish(learner_step=3, policy_version=3)
    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    metrics.observe_step({"clip_ratio": 0.25})
    app = create_control_app(state, TOKEN, metrics_app=make_asgi_app(registry))
    server = start_control_server(app, "127.0.0.1", 0)
    client = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
    )
    yield state, client, server
    client.close()
    server.close()


def test_status_requires_the_bearer_token(served):
    _, client, server = served
    assert httpx.get(f"{server.url}/status").status_code == 401
    bad = httpx.get(
        f"{server.url}/status", headers={"Authorization": "Bearer wrong-token-000000000"}
    )
    assert bad.status_code == 401
    ok = client.get("/status")
    assert ok.status_code == 200
    body = ok.json()
    assert body["status"]["learner_step"] == 3
    assert body["config"]["algorithm"]["variant"] == "ppo"
    assert body["pending_changes"] == []


def test_patch_is_validated_then_applied_only_when_taken(served):
    state, client, _ = served
    resp = client.patch(
        "/config", json={"buffer": {"max_staleness": 4}, "algorithm": {"variant": "st_ppo"}}
    )
    assert resp.status_code == 202
    assert "buffer.max_staleness" in resp.json()["accepted"]
    assert "algorithm.variant" in resp.json()["accepted"]
    # accepted but not applied: the applied config still says ppo until the driver takes it
    assert client.get("/status").json()["config"]["algorithm"]["variant"] == "ppo"
    assert "algorithm.variant" in client.get("/status").json()["pending_changes"]
    new = state.take_pending()
    assert new.algorithm.variant == "st_ppo" and new.buffer.max_staleness == 4
    assert state.take_pending() is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"buffer": {"max_staleness": -1}}, "buffer.max_staleness"),
        ({"algorithm": {"variant": "nope"}}, "does not match any of the expected tags"),
        ({"learner": {"zero_stage": 3}}, "learner.zero_stage: cannot change while the job runs"),
        ({"buffer": {"max_staleness": 2}, "model": {"path": "/x"}}, "model.path: cannot change"),
        ([1, 2], "JSON object"),
    ],
)
def test_invalid_changes_get_422_and_nothing_is_applied(served, body, needle):
    state, client, _ = served
    resp = client.patch("/config", json=body)
    assert resp.status_code == 422
    assert needle in resp.json()["detail"]
    assert state.take_pending() is None


def test_non_json_body_is_422(served):
    _, client, _ = served
    resp = client.patch(
        "/config", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 422


def test_metrics_are_served_without_auth(served):
    _, _, server = served
    text = httpx.get(f"{server.url}/metrics/").text
    assert "stppo_clip_ratio 0.25" in text


def test_changes_accumulate_against_pending():
    state = ControlState(config=load_config())
    state.request_change({"buffer": {"max_staleness": 3}})
    state.request_change({"learner": {"actor_lr": 1e-5}})
    new = state.take_pending()
    assert (new.buffer.max_staleness, new.learner.actor_lr) == (3, 1e-5)


def test_live_field_rules_and_diff():
    assert is_live_field("algorithm.tau") and is_live_field("buffer.max_staleness")
    assert not is_live_field("learner.zero_stage") and not is_live_field("buffer.capacity")
    old = load_config()
    new = load_config(None, ["buffer.max_staleness=5"])
    assert changed_fields(old, new) == ["buffer.max_staleness"]
    with pytest.raises(ConfigError, match="empty change"):
        ControlState(config=old).request_change({})
