"""The FastAPI retrieval server: Search-R1 ``POST /retrieve``, ``GET /healthz``, ``GET /metrics``.

``create_app(config)`` returns an app that loads the index in a background thread on start
(``/healthz`` answers 503 until it is ready); ``create_app(config, retriever)`` serves an
already-loaded retriever. ``serve(config)`` runs uvicorn in the foreground (one process, or
``config.workers`` processes sharing the port). Searches run in a thread pool of
``config.search_threads`` threads so the event loop keeps answering health and metrics
probes while it scores; concurrent requests with the same ``topk`` are coalesced into one
search call (:mod:`retrieval_server.batching`).

Example::

    serve(RetrievalServerConfig(method="bm25", port=8001))
    # curl -s localhost:8001/retrieve -d '{"queries": ["capital of peru"], "topk": 3}'

Hostile clients: bodies are capped while they are read (413, chunked ones too) and must
arrive within ``body_timeout_s`` (408); a request head must arrive within
``header_timeout_s`` (else the connection is closed; :mod:`retrieval_server.protocol`);
past ``max_connections`` new requests get 503 at once.

Errors: bad input gets 4xx with ``{"error": <reason>, "detail": <text>}`` (see
:mod:`retrieval_server.schemas`); a search that raises gets 500 with reason ``search_failed``
and the server keeps serving.
"""

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from retrieval_server.batching import SearchBatcher
from retrieval_server.config import RetrievalServerConfig
from retrieval_server.metrics import RetrievalMetrics
from retrieval_server.protocol import HeadTimeoutProtocol, configure_head_timeout
from retrieval_server.retrievers import Retriever
from retrieval_server.schemas import (
    ErrorResponse,
    HealthResponse,
    RetrieveResponse,
    request_model,
)

log = logging.getLogger("retrieval_server")

CONFIG_ENV = "STPPO_RETRIEVAL_SERVER_CONFIG"
"""Environment variable carrying the config (JSON) to multi-worker processes."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]
]


@dataclass
class ServerState:
    """What the handlers share: the retriever once loaded, or why loading failed."""

    config: RetrievalServerConfig
    metrics: RetrievalMetrics
    executor: ThreadPoolExecutor
    batcher: SearchBatcher
    retriever: Retriever | None = None
    failure: str = ""
    loaded: threading.Event = field(default_factory=threading.Event)


def _error(status: int, reason: str, detail: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": reason, "detail": detail})


# ------------------------------------------------------------------------ validation reasons

_QUERY_ITEM_REASONS = {
    "string_too_short": "blank_query",
    "string_pattern_mismatch": "blank_query",
    "string_too_long": "query_too_long",
}
_HTTP_REASONS = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}
_QUERIES_REASONS = {"too_short": "empty_queries", "too_long": "too_many_queries"}


def validation_reason(error: dict[str, Any]) -> str:
    """Map one pydantic/FastAPI validation error to a short machine-readable reason.

    Example: ``{"type": "too_long", "loc": ("body", "queries")}`` -> ``"too_many_queries"``.
    """
    kind, loc = error.get("type", ""), tuple(error.get("loc", ()))
    if kind == "json_invalid":
        return "invalid_json"
    if kind == "missing":
        return "missing_field"
    if kind == "extra_forbidden":
        return "unknown_field"
    if loc == ("body",):  # not a JSON object: a list, a string, form data, text/plain...
        return "body_not_object"
    if loc[:2] == ("body", "queries"):
        if len(loc) == 3 and kind in _QUERY_ITEM_REASONS:
            return _QUERY_ITEM_REASONS[kind]
        if len(loc) == 2 and kind in _QUERIES_REASONS:
            return _QUERIES_REASONS[kind]
    if loc[:2] == ("body", "topk") and kind in ("greater_than_equal", "less_than_equal"):
        return "topk_out_of_range"
    return "wrong_type"


def _describe(error: dict[str, Any]) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body") or "body"
    return f"{loc}: {error.get('msg', 'invalid')}"


# ----------------------------------------------------------------------------- ASGI guard


class BodyRejected(Exception):
    """Internal: the request body broke a limit while being read (413 or 408)."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


async def read_body_capped(
    receive: Callable[[], Awaitable[Message]], limit_bytes: int, timeout_s: float
) -> list[Message]:
    """Read every ``http.request`` message of one request, counting body bytes as they come.

    Args:
        receive: the ASGI receive callable.
        limit_bytes: most body bytes accepted (Content-Length declared or streamed alike).
        timeout_s: seconds allowed for the whole body.

    Returns:
        The messages read, in order (the last has ``more_body`` False, or is a disconnect).

    Raises:
        BodyRejected: 413 ``body_too_large`` as soon as the running count passes
            ``limit_bytes`` (nothing more is read), or 408 ``body_timeout`` when the body is
            not complete within ``timeout_s``.
    """
    messages: list[Message] = []
    num_bytes = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    return messages  # http.disconnect: the app sees it and gives up
                num_bytes += len(message.get("body", b""))
                if num_bytes > limit_bytes:
                    raise BodyRejected(413, "body_too_large", f"body is over {limit_bytes} bytes")
                if not message.get("more_body", False):
                    return messages
    except TimeoutError:
        raise BodyRejected(408, "body_timeout", f"body not complete within {timeout_s} s") from None


class RequestGuard:
    """Pure ASGI middleware: caps and times request bodies, counts/times every request.

    The body is read here, before the app runs: at most ``max_body_bytes`` (a Content-Length
    over it is refused without reading; a chunked body is refused with 413 the moment its
    running count passes it) within ``body_timeout_s`` (else 408). Both answers carry
    ``Connection: close`` so uvicorn drops the connection and the unread rest of the body.
    Pure ASGI (not ``BaseHTTPMiddleware``) to keep per-request overhead in microseconds.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ("/retrieve", "/healthz", "/metrics") else "other"
        config = self.state.config
        try:
            if _declared_length(scope) > config.max_body_bytes:
                raise BodyRejected(
                    413, "body_too_large", f"body is over {config.max_body_bytes} bytes"
                )
            messages = await read_body_capped(receive, config.max_body_bytes, config.body_timeout_s)
        except BodyRejected as rejected:
            await self._reject(rejected, endpoint, scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self._run_app(scope, replay, send, endpoint)

    async def _reject(
        self, rejected: BodyRejected, endpoint: str, scope: Scope, receive: Any, send: Any
    ) -> None:
        metrics = self.state.metrics
        metrics.errors.labels(rejected.reason).inc()
        metrics.requests.labels(endpoint, str(rejected.status)).inc()
        response = _error(rejected.status, rejected.reason, rejected.detail)
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def _run_app(self, scope: Scope, receive: Any, send: Any, endpoint: str) -> None:
        metrics = self.state.metrics
        status = {"code": 500}

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        start = time.perf_counter()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            if endpoint == "/retrieve":
                metrics.latency.observe(time.perf_counter() - start)
            metrics.requests.labels(endpoint, str(status["code"])).inc()


def _declared_length(scope: Scope) -> int:
    """The Content-Length header as an int (0 when absent or not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return 0


# ---------------------------------------------------------------------------------- app


def _load_in_background(state: ServerState) -> None:
    from retrieval_server.index import load_retriever

    try:
        loaded = load_retriever(state.config)
    except Exception as exc:  # reported on /healthz and in the log; the process stays up
        state.failure = f"{type(exc).__name__}: {exc}"
        log.error("index load failed: %s", state.failure)
        return
    state.metrics.index_bytes.set(loaded.index_bytes)
    state.metrics.index_load_seconds.set(loaded.load_time_s)
    _mark_ready(state, loaded.retriever)
    log.info(
        "loaded %s index: %d passages, load %.2f s, RSS %.3f GiB, index %.1f MiB",
        state.config.method,
        len(loaded.retriever.passages),
        loaded.load_time_s,
        loaded.rss_gib,
        loaded.index_bytes / 2**20,
    )


def _mark_ready(state: ServerState, retriever: Retriever) -> None:
    state.batcher.retriever = retriever
    state.retriever = retriever
    state.metrics.index_passages.set(len(retriever.passages))
    state.metrics.ready.set(1)
    state.loaded.set()


def _render_result(retriever: Retriever, hits: list, return_scores: bool) -> dict[str, Any]:
    passages = retriever.passages
    if return_scores:
        result = [
            [
                {"document": passages.document(int(i)), "score": float(s)}
                for i, s in zip(h.passage_indices, h.scores, strict=True)
            ]
            for h in hits
        ]
    else:
        result = [[passages.document(int(i)) for i in h.passage_indices] for h in hits]
    return {"result": result}


def create_app(
    config: RetrievalServerConfig,
    retriever: Retriever | None = None,
    load_before_serving: bool = False,
) -> FastAPI:
    """The retrieval FastAPI app.

    Args:
        config: limits, method and paths. ``config.corpus_path`` / ``index_dir`` are only read
            when ``retriever`` is None.
        retriever: an already-loaded retriever (ready at once); None loads
            ``config.method``'s index in a background thread when the app starts.
        load_before_serving: load during startup instead, so the process accepts no
            connection before its index is ready. Used for multi-worker serving, where
            workers share one socket and a loading worker must not take requests.

    Returns:
        The app; OpenAPI at ``/openapi.json``, docs at ``/docs``.
    """
    executor = ThreadPoolExecutor(config.search_threads, thread_name_prefix="search")
    state = ServerState(
        config=config,
        metrics=RetrievalMetrics(),
        executor=executor,
        batcher=SearchBatcher(
            None, executor, config.max_queries_per_request, num_consumers=config.search_threads
        ),
    )
    if retriever is not None:
        _mark_ready(state, retriever)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.batcher.start()
        if retriever is None and load_before_serving:
            await asyncio.to_thread(_load_in_background, state)
        elif retriever is None:
            threading.Thread(target=_load_in_background, args=(state,), daemon=True).start()
        yield
        await state.batcher.stop()
        state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="st-ppo retrieval server",
        version="1",
        summary="Search-R1 compatible passage retrieval (BM25, dense, hybrid).",
        lifespan=lifespan,
    )
    app.state.retrieval = state
    request_type = request_model(config.max_queries_per_request, config.max_query_chars)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        reason = validation_reason(errors[0]) if errors else "invalid_request"
        state.metrics.errors.labels(reason).inc()
        return _error(422, reason, "; ".join(_describe(e) for e in errors[:5]))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI raises 400 for bodies it cannot decode at all (e.g. invalid UTF-8).
        reason = _HTTP_REASONS.get(exc.status_code, "http_error")
        state.metrics.errors.labels(reason).inc()
        return _error(exc.status_code, reason, str(exc.detail))

    error_responses: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse, "description": "Body could not be decoded."},
        408: {"model": ErrorResponse, "description": "Body not complete within body_timeout_s."},
        413: {"model": ErrorResponse, "description": "Body over max_body_bytes."},
        422: {"model": ErrorResponse, "description": "Invalid request; `error` names why."},
        500: {"model": ErrorResponse, "description": "The search itself failed."},
        503: {"model": ErrorResponse, "description": "Index not loaded yet."},
    }

    async def retrieve(body: request_type) -> Response:  # type: ignore[valid-type]
        """Search-R1 retrieval: top-k passages for each query, in request order."""
        current = state.retriever
        if current is None:
            state.metrics.errors.labels("not_ready").inc()
            return _error(503, "not_ready", state.failure or "index is still loading")
        topk = body.topk if body.topk is not None else config.default_topk
        try:
            hits = await state.batcher.search(body.queries, topk)
        except Exception as exc:
            log.exception("search failed")
            state.metrics.errors.labels("search_failed").inc()
            return _error(500, "search_failed", f"{type(exc).__name__}: {exc}")
        state.metrics.queries_per_request.observe(len(body.queries))
        state.metrics.queries.inc(len(body.queries))
        payload = _render_result(current, hits, body.return_scores)
        return Response(json.dumps(payload, ensure_ascii=False), media_type="application/json")

    app.add_api_route(
        "/retrieve",
        retrieve,
        methods=["POST"],
        response_model=RetrieveResponse,
        responses=error_responses,
        summary="Retrieve top-k passages per query (Search-R1 contract)",
    )

    @app.get(
        "/healthz",
        response_model=HealthResponse,
        responses={503: {"model": HealthResponse, "description": "Loading or failed."}},
    )
    async def healthz() -> JSONResponse:
        """200 once the index is loaded; 503 with status ``loading`` or ``failed`` before."""
        current = state.retriever
        if current is not None:
            body = HealthResponse(
                status="ok", method=config.method, num_passages=len(current.passages)
            )
            return JSONResponse(body.model_dump())
        status = "failed" if state.failure else "loading"
        body = HealthResponse(
            status=status, method=config.method, num_passages=0, detail=state.failure
        )
        return JSONResponse(body.model_dump(), status_code=503)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition (``stppo_retrieval_*``)."""
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    app.add_middleware(RequestGuard, state=state)
    return app


def create_app_from_env() -> FastAPI:
    """uvicorn factory for worker processes: reads the config JSON from ``$STPPO_RETRIEVAL_SERVER_CONFIG``."""
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        raise RuntimeError(f"${CONFIG_ENV} is not set (serve() sets it for workers)")
    config = RetrievalServerConfig.model_validate_json(raw)
    configure_head_timeout(config.header_timeout_s)
    return create_app(config, load_before_serving=True)


def serve(config: RetrievalServerConfig) -> None:
    """Run the server in the foreground until SIGINT/SIGTERM.

    With ``config.workers > 1`` uvicorn starts that many processes on one socket; each loads
    its index before accepting connections (so no request reaches a loading worker, and
    ``/healthz`` is not answered at all until one is ready); metrics are aggregated through a
    fresh ``PROMETHEUS_MULTIPROC_DIR``.
    """
    import uvicorn

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    configure_head_timeout(config.header_timeout_s)
    common = dict(
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        http=HeadTimeoutProtocol,
        limit_concurrency=config.max_connections,
    )
    if config.workers == 1:
        uvicorn.run(create_app(config), **common)
        return
    os.environ[CONFIG_ENV] = config.model_dump_json()
    with tempfile.TemporaryDirectory(prefix="retrieval-metrics-") as multiproc_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
        uvicorn.run(
            "retrieval_server.server:create_app_from_env",
            factory=True,
            workers=config.workers,
            **common,
        )
