"""The control plane: live status and live config changes of a running job (FastAPI).

Endpoints (all JSON):

- ``GET  /healthz``: 200 once the driver is serving (no auth).
- ``GET  /metrics``: the job's Prometheus registry (no auth, for scrapers).
- ``GET  /status``: step, policy version, live config, buffer, throughput, pending changes.
- ``PATCH /config``: a nested partial config, e.g. ``{"buffer": {"max_staleness": 2}}``.
  Validated with the same pydantic tree as the config files (:func:`services.config.update_config`),
  restricted to :data:`LIVE_FIELDS`, and applied by the driver at the next learner-step
  boundary, all or nothing. Answers 202 with the dotted fields that will change.

``/status`` and ``/config`` need ``Authorization: Bearer <token>`` (a per-run token written
to ``<run_dir>/control.json`` with mode 0600, or ``control.token`` / ``STPPO_CONTROL_TOKEN``;
never printed): a missing or wrong token gets 401 (compared as UTF-8 bytes in constant time,
so a non-ASCII token is a plain 401).

Hostile bodies get a 4xx, never a 500: over :data:`MAX_BODY_BYTES` (by header or while
streaming) 413; not JSON, nested deeper than :data:`MAX_BODY_DEPTH`, not an object, a
section given as a non-object, a wrong type (strict: no ``"2"``/``true``/``"1e-5"``
coercion), an out-of-bound value or a field that cannot change live: 422 naming the field.
More rollout actors than the cluster holds (:attr:`ControlState.max_rollout_actors`): 422
naming the binding resource.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict

from services.config import ConfigError, RunConfig, update_config

LIVE_FIELDS: tuple[str, ...] = (
    "buffer.max_staleness",
    "buffer.stale_policy",
    "algorithm",  # the variant and all of its options
    "learner.actor_lr",
    "learner.critic_lr",
    "rollout.num_actors",
    "rollout.interrupt_every_tokens",
    "sync.every_k_steps",
    "guard",  # the stability guard's mode and rules (guard.mode=off pauses it)
)
"""Dotted config paths (or their prefixes) that may change while a job runs. Sampling
temperature is not among them: the learner divides its logits by the engines' temperature,
so both would have to change at the same step boundary."""


_BEARER = HTTPBearer(auto_error=False)

MAX_BODY_BYTES = 64 * 1024
"""Largest ``PATCH /config`` body read (a whole config tree is under 10 KiB)."""

MAX_BODY_DEPTH = 8
"""Deepest JSON nesting accepted (the config tree is 3 levels deep)."""


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (scalars 0), computed without recursion."""
    depth, stack = 0, [(value, 0)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node)
    return depth


def tokens_match(given: str, expected: str) -> bool:
    """Constant-time comparison of the UTF-8 bytes (``compare_digest`` rejects non-ASCII str)."""
    return secrets.compare_digest(
        given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


def flatten(changes: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in changes.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def is_live_field(dotted: str) -> bool:
    """True if ``dotted`` is one of :data:`LIVE_FIELDS` or inside one of them."""
    return any(dotted == f or dotted.startswith(f"{f}.") for f in LIVE_FIELDS)


def changed_fields(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted paths whose values differ between two configs (a variant change lists
    ``algorithm.variant`` and every option whose value changed with it)."""
    a, b = flatten(old.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    return sorted(k for k in a.keys() | b.keys() if a.get(k, None) != b.get(k, None))


@dataclass
class ControlState:
    """What the driver and the HTTP thread share, behind one lock.

    The driver publishes ``status`` and reads validated changes with :meth:`take_pending`
    at step boundaries; HTTP handlers call :meth:`request_change`.
    """

    config: RunConfig
    status: dict[str, Any] = field(default_factory=dict)
    max_rollout_actors: int | None = None
    """Set by the driver from the cluster (``ray.max_rollout_actors`` or its resources);
    a change asking for more rollout actors is refused (422) rather than left pending."""
    capacity_reason: str = ""
    person_fields: set[str] = field(default_factory=set)
    """Dotted fields a person changed live during the run (``source = "person"``): the
    stability guard (:mod:`services.loop.guard`) never changes them."""
    _pending: RunConfig | None = None
    _accepted: RunConfig | None = (
        None  # newest accepted config (pending, being applied, or applied)
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self, config: RunConfig) -> None:
        """Driver side, before serving (e.g. on resume): this config is applied and accepted."""
        with self._lock:
            self.config, self._accepted, self._pending = config, config, None

    def request_change(self, changes: dict[str, Any], source: str = "person") -> list[str]:
        """Validate a nested partial change against the newest accepted config: pending, or
        taken by the driver and not yet published (so a change that lands while the driver
        applies the previous one builds on it instead of reverting it). ``source``:
        ``person`` (``PATCH /config``; its fields join :attr:`person_fields`) or ``guard``
        (the stability guard; applied the same way).

        Returns:
            The dotted fields this change changes.

        Raises:
            ConfigError: a field is not live-tunable, or the result fails validation.
        """
        if not changes:
            raise ConfigError("empty change")
        frozen = sorted(k for k in flatten(changes) if not is_live_field(k))
        if frozen:
            raise ConfigError(
                f"{', '.join(frozen)}: cannot change while the job runs "
                f"(live fields: {', '.join(LIVE_FIELDS)})"
            )
        with self._lock:
            base = self._accepted or self.config
            new = update_config(base, changes, strict=True)
            self.check_rollout_actors(new.rollout.num_actors)
            fields = changed_fields(base, new)
            if fields:
                self._pending = self._accepted = new
                if source == "person":
                    self.person_fields.update(fields)
            return fields

    def check_rollout_actors(self, n: int) -> None:
        """Raise :class:`ConfigError` if ``n`` rollout actors exceed :attr:`max_rollout_actors`."""
        cap = self.max_rollout_actors
        if cap is not None and n > cap:
            raise ConfigError(
                f"rollout.num_actors={n}: the cluster holds at most {cap} rollout actor(s) "
                f"({self.capacity_reason}); add rollout nodes, or set ray.max_rollout_actors "
                "where the cluster autoscales"
            )

    def take_pending(self) -> RunConfig | None:
        """The validated config to apply now (None if nothing changed); clears it."""
        with self._lock:
            pending, self._pending = self._pending, None
            return pending

    def pending_fields(self) -> list[str]:
        """Dotted fields waiting for the next step boundary."""
        with self._lock:
            return changed_fields(self.config, self._pending) if self._pending else []

    def publish(self, config: RunConfig | None = None, **status_fields: Any) -> None:
        """Driver side: set the applied config and/or update status fields."""
        with self._lock:
            if config is not None:
                self.config = config
            self.status.update(status_fields, updated_unix_s=time.time())

    def snapshot(self) -> tuple[RunConfig, dict[str, Any]]:
        """A consistent copy of (applied config, status)."""
        with self._lock:
            return self.config, dict(self.status)


class StatusResponse(BaseModel):
    """``GET /status``: the live state of the job."""

    model_config = ConfigDict(extra="forbid")

    status: dict[str, Any]
    """Driver-published fields: learner_step, policy_version, buffer stats, throughput..."""
    config: dict[str, Any]
    """The applied config (the whole tree)."""
    pending_changes: list[str]
    """Dotted fields accepted but not yet applied (next step boundary)."""


class ChangeResponse(BaseModel):
    """``PATCH /config``: the accepted change."""

    model_config = ConfigDict(extra="forbid")

    accepted: list[str]
    """Dotted fields that will change."""
    applies_at: str = "next learner step boundary"
    """When the driver applies it."""


async def read_limited(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes (by the
    Content-Length header or while streaming a chunked body)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HTTPException(413, detail=f"body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, detail=f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object of config sections, or an :class:`HTTPException` 422."""
    import json

    try:
        body = json.loads(raw)
    except RecursionError:
        raise HTTPException(422, detail="body is nested too deeply") from None
    except ValueError as e:  # includes UnicodeDecodeError
        raise HTTPException(422, detail=f"body is not JSON: {e}") from None
    if json_depth(body) > MAX_BODY_DEPTH:
        raise HTTPException(422, detail=f"body is nested deeper than {MAX_BODY_DEPTH} levels")
    if not isinstance(body, dict):
        raise HTTPException(422, detail="body must be a JSON object of config sections")
    return body


def public_config(config: RunConfig) -> dict[str, Any]:
    """The config as JSON for ``/status``, ``config.json`` and checkpoints: ``control.token``
    redacted (``"<redacted>"`` when one is set)."""
    data = config.model_dump(mode="json")
    if data.get("control", {}).get("token"):
        data["control"]["token"] = "<redacted>"
    return data


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (mode 0600, also when it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def new_token() -> str:
    """A fresh random bearer token (32 url-safe characters)."""
    return secrets.token_urlsafe(24)


def create_control_app(state: ControlState, token: str, metrics_app=None) -> FastAPI:
    """Build the control-plane app.

    Args:
        state: shared with the driver.
        token: the bearer token required on ``/status`` and ``/config``.
        metrics_app: optional ASGI app mounted at ``/metrics`` (``services.metrics.make_asgi_app``).
    """
    if len(token) < 16:
        raise ValueError("control-plane token must have at least 16 characters")
    app = FastAPI(title="st-ppo control plane", version="1")

    def require_token(
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
    ) -> None:
        if creds is None or not tokens_match(creds.credentials, token):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="missing or wrong bearer token (a generated one is in <run_dir>/control.json)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/status", dependencies=[Depends(require_token)])
    def get_status() -> StatusResponse:
        config, status_fields = state.snapshot()
        return StatusResponse(
            status=status_fields,
            config=public_config(config),
            pending_changes=state.pending_fields(),
        )

    @app.patch("/config", dependencies=[Depends(require_token)], status_code=202)
    async def patch_config(request: Request) -> ChangeResponse:
        body = parse_body(await read_limited(request, MAX_BODY_BYTES))
        try:
            accepted = state.request_change(body)
        except (ConfigError, TypeError, ValueError, RecursionError) as e:
            raise HTTPException(422, detail=str(e)) from None
        return ChangeResponse(accepted=accepted)

    if metrics_app is not None:
        app.mount("/metrics", metrics_app)
    return app


@dataclass
class ControlServer:
    """A uvicorn server running the control app in a daemon thread."""

    host: str
    port: int
    server: Any
    thread: threading.Thread

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8365``; bound to every interface, the node's
        address (what another pod reaches, :func:`actors.rendezvous.advertised_host`)."""
        from actors.rendezvous import advertised_host

        return f"http://{advertised_host(self.host)}:{self.port}"

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving and join the thread."""
        self.server.should_exit = True
        self.thread.join(timeout_s)


def start_control_server(
    app: FastAPI, host: str, port: int, timeout_s: float = 10.0
) -> ControlServer:
    """Serve ``app`` with uvicorn in a daemon thread; port 0 picks a free port.

    Raises:
        RuntimeError: the server did not start within ``timeout_s`` (e.g. port taken).
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    actual_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"control plane failed to start on {host}:{actual_port}")
        time.sleep(0.02)
    return ControlServer(host=host, port=actual_port, server=server, thread=thread)
