"""Prometheus metrics of the retrieval server, on an explicit ``CollectorRegistry``.

Exported (prefix ``stppo_retrieval_``):

- ``requests_total{endpoint, status}``: answered HTTP requests by status code;
- ``errors_total{reason}``: rejected or failed requests by reason (``topk_out_of_range``...);
- ``request_latency_seconds``: histogram of ``/retrieve`` wall time, receive to send;
- ``queries_per_request``: histogram of batch sizes of accepted ``/retrieve`` requests;
- ``queries_total``: queries answered;
- ``index_passages`` / ``index_bytes`` / ``index_load_seconds`` / ``ready``: the loaded index.

With several uvicorn workers, set ``PROMETHEUS_MULTIPROC_DIR`` before the workers start
(:func:`retrieval_server.server.serve` does): each worker writes its samples there and
``/metrics`` on any worker reports the sum over workers.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "stppo_retrieval_"
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RetrievalMetrics:
    """The server's metrics, registered on ``registry`` (never the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests answered.", ["endpoint", "status"], registry=r
        )
        self.errors = Counter(
            PREFIX + "errors",
            "Requests rejected (4xx) or failed (5xx), by reason.",
            ["reason"],
            registry=r,
        )
        self.latency = Histogram(
            PREFIX + "request_latency_seconds",
            "Wall time of POST /retrieve (seconds).",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queries_per_request = Histogram(
            PREFIX + "queries_per_request",
            "Queries in each accepted POST /retrieve.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queries = Counter(PREFIX + "queries", "Queries answered.", registry=r)
        self.index_passages = Gauge(
            PREFIX + "index_passages",
            "Passages in the loaded index.",
            registry=r,
            multiprocess_mode="max",
        )
        self.index_bytes = Gauge(
            PREFIX + "index_bytes",
            "Bytes of the loaded index files on disk.",
            registry=r,
            multiprocess_mode="max",
        )
        self.index_load_seconds = Gauge(
            PREFIX + "index_load_seconds",
            "Wall time of loading corpus and index (seconds).",
            registry=r,
            multiprocess_mode="max",
        )
        self.ready = Gauge(
            PREFIX + "ready",
            "1 once the index is loaded and /retrieve answers.",
            registry=r,
            multiprocess_mode="min",
        )

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type (summed over workers)."""
        multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not multiproc_dir:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=multiproc_dir)
        return generate_latest(merged), CONTENT_TYPE_LATEST
