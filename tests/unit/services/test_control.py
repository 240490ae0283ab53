"""Control plane over real HTTP: auth, validation, all-or-nothing, applied at step boundary."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.config import ConfigError, load_config
from services.control import (
    ControlState,
    changed_fields,
    create_control_app,
    is_live_field,
    public_config,
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
        base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
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


def test_interrupt_every_tokens_is_live_and_refused_under_fixed_lag():
    assert is_live_field("rollout.interrupt_every_tokens")
    state = ControlState(config=load_config())
    state.request_change({"rollout": {"interrupt_every_tokens": 16}})
    new = state.take_pending()
    assert new.rollout.interrupt_every_tokens == 16
    assert changed_fields(load_config(), new) == ["rollout.interrupt_every_tokens"]
    lagged = ControlState(config=load_config(None, ["sync.fixed_lag=true"]))
    with pytest.raises(ConfigError, match=r"must be 0 with sync\.fixed_lag"):
        lagged.request_change({"rollout": {"interrupt_every_tokens": 16}})


# ---------------------------------------------------------------- issue 21: token on PATCH, race


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token-000000000"}, {"Authorization": f"Basic {TOKEN}"}],
)
def test_patch_needs_the_token_and_applies_nothing_without_it(served, headers):
    state, client, server = served
    resp = httpx.patch(
        f"{server.url}/config", json={"buffer": {"max_staleness": 3}}, headers=headers, timeout=30
    )
    assert resp.status_code == 401
    assert state.pending_fields() == [] and state.take_pending() is None
    assert client.get("/status").json()["config"]["buffer"]["max_staleness"] == 1


def test_a_change_during_the_drivers_apply_builds_on_the_one_being_applied(served):
    """Driver takes change 1 and publishes it only after its Ray calls; change 2 lands in
    between. Both must survive, in order (issue 21: change 2 used to revert change 1)."""
    state, client, _ = served
    assert client.patch("/config", json={"algorithm": {"variant": "st_ppo"}}).status_code == 202
    first = state.take_pending()  # step boundary 1: the driver starts applying
    resp = client.patch("/config", json={"learner": {"actor_lr": 2e-5}})
    assert resp.status_code == 202 and resp.json()["accepted"] == ["learner.actor_lr"]
    state.publish(config=first)  # the driver's Ray calls returned
    assert client.get("/status").json()["config"]["algorithm"]["variant"] == "st_ppo"
    second = state.take_pending()  # step boundary 2
    assert second.algorithm.variant == "st_ppo" and second.learner.actor_lr == 2e-5
    state.publish(config=second)
    # and a third change on the same field wins over the second
    state.request_change({"learner": {"actor_lr": 3e-5}})
    assert state.take_pending().learner.actor_lr == 3e-5


def test_reset_discards_pending_and_rebases():
    state = ControlState(config=load_config())
    state.request_change({"buffer": {"max_staleness": 3}})
    restored = load_config(None, ["algorithm.variant=ppo"])
    state.reset(restored)
    assert state.take_pending() is None
    new = (state.request_change({"learner": {"actor_lr": 1e-5}}), state.take_pending())[1]
    assert new.algorithm.variant == "ppo" and new.buffer.max_staleness == 1


# ---------------------------------------------------------------- issue 16: hostile input


def test_non_ascii_token_is_401_not_500(served):
    _, _, server = served
    raw = "Bearer tökén-ünïcode-0000000000".encode()
    for method in ("GET", "PATCH"):
        path = "/status" if method == "GET" else "/config"
        resp = httpx.request(
            method, f"{server.url}{path}", headers=[(b"Authorization", raw)], json={}, timeout=30
        )
        assert resp.status_code == 401, resp.text


def test_a_non_ascii_configured_token_still_works():
    from services.control import tokens_match

    assert tokens_match("ünïcode-token-0000000", "ünïcode-token-0000000")
    assert not tokens_match("unicode-token-0000000", "ünïcode-token-0000000")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"buffer": {"max_staleness": "2"}}, "buffer.max_staleness"),
        ({"buffer": {"max_staleness": True}}, "buffer.max_staleness"),
        ({"buffer": {"max_staleness": 2.0}}, "buffer.max_staleness"),
        ({"learner": {"actor_lr": "1e-5"}}, "learner.actor_lr"),
        ({"algorithm": 5}, "algorithm"),
        ({"algorithm": {"variant": ["ppo"]}}, "algorithm"),
        ({"algorithm": {"variant": None}}, "algorithm"),
        ({"buffer": [1]}, "buffer"),
        ({"sync": {"every_k_steps": 10**9}}, "sync.every_k_steps"),
        ({"sync": {"every_k_steps": 5}}, "sync.every_k_steps"),  # > max_staleness + 1
        ({"rollout": {"num_actors": 10**6}}, "rollout.num_actors"),
        ({"buffer": {"max_staleness": 10**9}}, "buffer.max_staleness"),
    ],
)
def test_loose_or_out_of_bound_values_are_422(served, body, needle):
    state, client, _ = served
    resp = client.patch("/config", json=body)
    assert resp.status_code == 422, resp.text
    assert needle in resp.json()["detail"]
    assert state.take_pending() is None


@pytest.mark.parametrize("depth", [9, 50, 100_000])
def test_deeply_nested_bodies_are_4xx(served, depth):
    state, client, _ = served
    body = ("[" * depth + "]" * depth).encode() if depth > 60_000 else None
    if body is None:
        inner: object = 1
        for _ in range(depth):
            inner = {"a": inner}
        body = json.dumps({"buffer": inner}).encode()
    resp = client.patch("/config", content=body, headers={"Content-Type": "application/json"})
    assert 400 <= resp.status_code < 500, resp.text
    assert state.take_pending() is None


def test_deep_json_within_the_size_limit_is_422_not_500(served):
    state, client, _ = served
    body = b'{"buffer":' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # 60 KB < 64 KiB
    resp = client.patch("/config", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422 and state.take_pending() is None


def test_body_limit_by_header_and_while_streaming(served):
    from services.control import MAX_BODY_BYTES

    state, client, _ = served
    big = b'{"buffer": {"max_staleness": 2}, "pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
    assert client.patch("/config", content=big).status_code == 413

    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"buffer": {"max_staleness": 2}, "pad": "'
        for _ in range(64):
            yield b"x" * 4096
        yield b'"}'

    resp = client.patch("/config", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert state.take_pending() is None


def test_status_never_shows_the_token():
    from services.control import public_config

    cfg = load_config(None, [f'control.token="{TOKEN}"'])
    assert public_config(cfg)["control"]["token"] == "<redacted>"
    assert TOKEN not in json.dumps(public_config(cfg))


def test_write_private_is_owner_only(tmp_path):
    import stat

    from services.control import write_private

    path = tmp_path / "control.json"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, '{"token": "x"}')
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == '{"token": "x"}'


@pytest.mark.parametrize(
    "raw",
    [
        b'{"learner": {"actor_lr": NaN}}',
        b'{"buffer": {"max_staleness": 1e400}}',
        b'{"buffer": {"max_staleness": ' + b"9" * 5000 + b"}}",
        b'{"buffer": {"stale_policy": "\xff\xfe"}}',
        b"",
    ],
)
def test_odd_json_is_422(served, raw):
    state, client, _ = served
    resp = client.patch("/config", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert state.take_pending() is None


def test_more_rollout_actors_than_the_cluster_holds_is_422_and_nothing_applied(served):
    """A live ``rollout.num_actors`` above the cluster's capacity would leave actors pending
    with no message: refused with the binding resource named; at the cap it is accepted."""
    state, client, _ = served
    state.max_rollout_actors, state.capacity_reason = 2, "stppo_rollout: 2 in the cluster"
    resp = client.patch("/config", json={"rollout": {"num_actors": 3}})
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert "rollout.num_actors=3" in detail and "at most 2" in detail
    assert "stppo_rollout: 2 in the cluster" in detail
    assert state.take_pending() is None
    assert client.patch("/config", json={"rollout": {"num_actors": 2}}).status_code == 202
    assert state.take_pending().rollout.num_actors == 2


def test_rollout_actor_capacity_counts_the_learner_and_names_the_binding_resource():
    from services.ray_actors import rollout_actor_capacity

    local = load_config(None, ["ray.rollout_actor_cpus=1.0", "ray.learner_cpus=1.0"])
    assert rollout_actor_capacity(local, {"CPU": 2.0})[0] == 1
    assert rollout_actor_capacity(local, {"CPU": 1.0})[0] == 0
    ranks = load_config(
        None,
        [
            "learner.num_ranks=2", "ray.learner_cpus=1.0", "ray.rollout_actor_cpus=0.5",
            "ray.rollout_actor_gpus=1.0", "ray.learner_gpus=1.0",
        ],
    )  # fmt: skip
    cap, why = rollout_actor_capacity(ranks, {"CPU": 16.0, "GPU": 5.0})
    assert cap == 3 and why.startswith("GPU: 5 in the cluster, 2 for the learner")
    pinned = load_config(None, ['ray.rollout_actor_resources={"stppo_rollout" = 1}'])
    cap, why = rollout_actor_capacity(pinned, {"CPU": 64.0, "stppo_rollout": 4.0})
    assert cap == 4 and why.startswith("stppo_rollout")
    assert rollout_actor_capacity(pinned, {"CPU": 64.0})[0] == 0  # no rollout node yet


@pytest.mark.parametrize(
    ("value", "depth"),
    [(3, 0), ({}, 0), ([], 0), ({"a": 1}, 1), ([[1]], 2), ({"a": [{"b": 1}], "c": 2}, 3)],
)
def test_json_depth_counts_nesting(value, depth):
    from services.control import json_depth

    assert json_depth(value) == depth


def test_refusals_name_the_fields_exactly():
    from services.control import LIVE_FIELDS

    state = ControlState(config=load_config(None))
    with pytest.raises(ConfigError, match=r"^empty change$"):
        state.request_change({})
    with pytest.raises(ConfigError) as frozen:
        state.request_change({"model": {"path": "/x"}, "learner": {"zero_stage": 3}})
    assert str(frozen.value) == (
        "learner.zero_stage, model.path: cannot change while the job runs "
        f"(live fields: {', '.join(LIVE_FIELDS)})"
    )
    state.max_rollout_actors, state.capacity_reason = 1, "CPU: 2 in the cluster"
    with pytest.raises(ConfigError) as over:
        state.request_change({"rollout": {"num_actors": 2}})
    assert str(over.value) == (
        "rollout.num_actors=2: the cluster holds at most 1 rollout actor(s) (CPU: 2 in the "
        "cluster); add rollout nodes, or set ray.max_rollout_actors where the cluster autoscales"
    )


def test_identical_configs_have_no_changed_fields_and_the_public_config_is_json():
    """Both sides are dumped in JSON mode (a Path on one side and a str on the other would
    report every path field as changed), and /status can serialise what it shows."""
    cfg = load_config(None, ["run.output_dir=/tmp/somewhere"])
    assert changed_fields(cfg, cfg) == []
    assert changed_fields(cfg, load_config(None, ["buffer.max_staleness=3"])) != []
    # a field present on one side only (a dict that gained its first key) is a change too
    pinned = load_config(None, ['ray.rollout_actor_resources={"stppo_rollout" = 1}'])
    assert "ray.rollout_actor_resources.stppo_rollout" in changed_fields(cfg, pinned)
    assert "ray.rollout_actor_resources" in changed_fields(cfg, pinned)
    json.dumps(public_config(cfg))  # no Path objects left
    assert public_config(cfg)["run"]["output_dir"] == "/tmp/somewhere"


def test_write_private_creates_the_file_owner_only_from_the_start(tmp_path, monkeypatch):
    """No window in which a new control.json is readable by others: its mode is 0600 when
    it is created, before the explicit chmod (which covers an existing file)."""
    import os
    import stat

    from services import control

    seen: list[int] = []
    real_fchmod = os.fchmod

    def recording_fchmod(fd, mode):
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_fchmod(fd, mode)

    monkeypatch.setattr(control.os, "fchmod", recording_fchmod)
    old_umask = os.umask(0o022)
    try:
        control.write_private(tmp_path / "new.json", "{}")
    finally:
        os.umask(old_umask)
    assert seen == [0o600]


def _padded_body(size: int) -> bytes:
    """A valid change, padded with JSON whitespace to exactly ``size`` bytes."""
    core = b'{"buffer": {"max_staleness": 2}}'
    return core[:-1] + b" " * (size - len(core)) + b"}"


@pytest.mark.parametrize("chunked", [False, True])
def test_body_limit_is_exact_with_and_without_content_length(served, chunked):
    """A body of exactly MAX_BODY_BYTES is read; one byte more is 413 with the limit named,
    whether the size is declared (Content-Length) or found while streaming (chunked)."""
    from services.control import MAX_BODY_BYTES

    state, client, _ = served

    def send(body: bytes):
        content = iter([body[: len(body) // 2], body[len(body) // 2 :]]) if chunked else body
        return client.patch("/config", content=content)

    assert send(_padded_body(MAX_BODY_BYTES)).status_code == 202
    assert state.take_pending().buffer.max_staleness == 2
    over = send(_padded_body(MAX_BODY_BYTES + 1))
    assert over.status_code == 413
    assert over.json()["detail"] == f"body over {MAX_BODY_BYTES} bytes"
    assert state.take_pending() is None


@pytest.mark.parametrize(
    ("body", "status", "detail"),
    [
        (b'{"buffer": ', 422, "body is not JSON: "),
        (b"[1, 2]", 422, "body must be a JSON object of config sections"),
        (b'{"a":' * 9 + b"1" + b"}" * 9, 422, "body is nested deeper than 8 levels"),
        (b'{"a":' * 10_000 + b"1" + b"}" * 10_000, 422, "body is nested too deeply"),
    ],
)
def test_bad_bodies_get_their_own_reason(served, body, status, detail):
    state, client, _ = served
    resp = client.patch("/config", content=body)
    assert resp.status_code == status
    assert resp.json()["detail"].startswith(detail)
    assert state.take_pending() is None


def test_a_body_at_the_depth_limit_is_parsed_and_judged_as_config(served):
    """Depth MAX_BODY_DEPTH exactly passes the depth check; the config then refuses it."""
    _, client, _ = served
    body = b'{"a":' * 8 + b"1" + b"}" * 8
    resp = client.patch("/config", content=body)
    assert resp.status_code == 422
    assert "nested" not in resp.json()["detail"]


def test_token_length_and_the_401_challenge(served):
    from services.control import create_control_app

    state, _, server = served
    create_control_app(state, "k" * 16)  # 16 characters is enough
    with pytest.raises(ValueError, match=r"^control-plane token must have at least 16 characters$"):
        create_control_app(state, "k" * 15)
    resp = httpx.get(f"{server.url}/status", headers={"Authorization": "Bearer nope"})
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["detail"].startswith("missing or wrong bearer token")
    assert server.thread.daemon  # a stuck request never keeps the job's process alive


def test_tokens_match_survives_unpaired_surrogates():
    """A str that cannot be UTF-8 encoded strictly (a lone surrogate, e.g. from a decoded
    header) compares as unequal instead of raising."""
    from services.control import tokens_match

    assert not tokens_match("\udc80" * 16, "k" * 16)
    assert not tokens_match("k" * 16, "\udc80" * 16)
    assert tokens_match("\udc80" * 16, "\udc80" * 16)


def test_publish_stamps_the_status_time():
    import time as _time

    state = ControlState(config=load_config(None))
    before = _time.time()
    state.publish(learner_step=1)
    _, status = state.snapshot()
    assert status["learner_step"] == 1 and before <= status["updated_unix_s"] <= _time.time()


def test_an_oversized_declared_body_is_refused_before_it_is_sent(served):
    """Content-Length over the limit: 413 at once, without waiting for (or reading) a byte of
    the body; only the streaming check would otherwise wait for it to arrive."""
    import socket

    from services.control import MAX_BODY_BYTES

    state, _, server = served
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"PATCH /config HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(MAX_BODY_BYTES + 1).encode() + b"\r\n\r\n"
        )  # fmt: skip
        head = sock.recv(4096)  # no body sent: only an early answer arrives
    assert head.startswith(b"HTTP/1.1 413"), head[:80]
    assert state.take_pending() is None


def test_openapi_describes_the_control_plane(served):
    _, client, _ = served
    info = client.get("/openapi.json").json()["info"]
    assert info == {"title": "st-ppo control plane", "version": "1"}
