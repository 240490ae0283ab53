"""The control plane: live status and live config changes of a running job (FastAPI).

Endpoints (all JSON):

- ``GET  /healthz``: 200 once the driver is serving (no auth).
- ``GET  /metrics``: the job's Prometheus registry (no auth, for scrapers).
- ``GET  /status``: step, policy version, live config, buffer, throughput, pending changes.
- ``PATCH /config``: a nested partial config, e.g. ``{"buffer": {"max_staleness": 2}}``.
  Validated with the same pydantic tree as the config files (:func:`services.config.update_config`),
  restricted to :data:`LIVE_FIELDS`, and applied by the driver at the next learner-step
  boundary, all or nothing. Answers 202 with the dotted fields that will change.

``/status`` and ``/config`` need ``Authorization: Bearer <token>`` (a per-run token printed
at start, or ``control.token``): a missing or wrong token gets 401, an invalid change 422
naming the field, a change to a field that cannot change live 422 too.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
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
    "sync.every_k_steps",
)
"""Dotted config paths (or their prefixes) that may change while a job runs. Sampling
temperature is not among them: the learner divides its logits by the engines' temperature,
so both would have to change at the same step boundary."""


_BEARER = HTTPBearer(auto_error=False)


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
    _pending: RunConfig | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request_change(self, changes: dict[str, Any]) -> list[str]:
        """Validate a nested partial change against the current (plus pending) config.

        Returns:
            The dotted fields that will change at the next step boundary.

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
            base = self._pending or self.config
            new = update_config(base, changes)
            fields = changed_fields(self.config, new)
            self._pending = new if fields else None
            return fields

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
        if creds is None or not secrets.compare_digest(creds.credentials, token):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                detail="missing or wrong bearer token (printed at job start)",
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
            config=config.model_dump(mode="json"),
            pending_changes=state.pending_fields(),
        )

    @app.patch("/config", dependencies=[Depends(require_token)], status_code=202)
    async def patch_config(request: Request) -> ChangeResponse:
        try:
            body = await request.json()
        except ValueError as e:
            raise HTTPException(422, detail=f"body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise HTTPException(422, detail="body must be a JSON object of config sections")
        try:
            accepted = state.request_change(body)
        except ConfigError as e:
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
        """Base URL, e.g. ``http://127.0.0.1:8365``."""
        return f"http://{self.host}:{self.port}"

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
