"""HTTP contract of the retrieval server: the Search-R1 ``/retrieve`` API, typed.

Search-R1 (``search_r1/search/retrieval_server.py``) defines::

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    -> {"result": [[{"document": {"id": ..., "contents": ...}, "score": 12.3}, ...],  # q1
                   [...]]}                                                            # q2
    with "return_scores": false -> {"result": [[{"id": ..., "contents": ...}, ...], ...]}

``topk`` may be left out or null (the server's ``default_topk`` is used); ``return_scores``
defaults to false. One inner list per query, in request order, best passage first; a query
whose words match no passage (BM25) gets an empty list. ``contents`` is ``"\\"Title\\"\\ntext"``.

Stricter than Search-R1 (so bad input fails loudly with 422 and a reason instead of a 500):
unknown keys, non-string queries, blank queries, non-integer or out-of-range ``topk``, and
more than ``max_queries_per_request`` queries or queries over ``max_query_chars`` characters.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
)

TOPK_MAX = 100
"""Largest accepted ``topk``."""


def _integral_float_to_int(value: object) -> object:
    """JSON Schema counts ``3.0`` as an integer; accept it as 3 (``2.5`` and ``"3"`` still fail)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class RetrieveRequestBase(BaseModel):
    """Search-R1 retrieval request: a batch of queries.

    ``queries``: non-blank strings (at least one non-whitespace character), 1 to
    ``max_queries_per_request`` of them, each at most ``max_query_chars`` characters.
    ``topk``: passages per query, 1..100, or null / absent for the server default.
    ``return_scores``: wrap each passage as ``{"document": ..., "score": ...}``.
    Types are strict: ``"3"`` and ``2.5`` are not integers (``3.0`` is, as in JSON Schema) and
    ``1`` is not a boolean.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    topk: (
        Annotated[int, Field(ge=1, le=TOPK_MAX), BeforeValidator(_integral_float_to_int)] | None
    ) = None
    """Passages per query (1..100); null or absent = the server's ``default_topk``."""

    return_scores: bool = False
    """Return ``{"document", "score"}`` pairs instead of bare documents."""


def request_model(max_queries: int, max_query_chars: int) -> type[RetrieveRequestBase]:
    """The request model with the server's limits in its JSON schema (so OpenAPI states them).

    Example: ``request_model(256, 1024).model_validate({"queries": ["x"]})``.
    """
    query = Annotated[
        str, StringConstraints(min_length=1, max_length=max_query_chars, pattern=r"\S")
    ]
    return create_model(
        "RetrieveRequest",
        __base__=RetrieveRequestBase,
        __doc__=RetrieveRequestBase.__doc__,
        queries=(
            list[query],
            Field(
                min_length=1,
                max_length=max_queries,
                description=f"1..{max_queries} non-blank queries of at most "
                f"{max_query_chars} characters, answered in order.",
            ),
        ),
    )


class Document(BaseModel):
    """A corpus passage in Search-R1 form."""

    id: str
    """Passage id from the corpus file."""

    contents: str
    """``"\\"Title\\"\\ntext"``, as stored in the corpus."""


class ScoredDocument(BaseModel):
    """A passage and its retrieval score (higher is better; BM25, cosine, or RRF units)."""

    document: Document
    score: float


class RetrieveResponse(BaseModel):
    """``result[i]`` answers ``queries[i]``: up to ``topk`` passages, best first.

    Each item is a :class:`ScoredDocument` when ``return_scores`` was true, else a bare
    :class:`Document`. Lists may be shorter than ``topk`` (BM25 returns only matching passages).
    """

    result: list[list[ScoredDocument]] | list[list[Document]]


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx answer."""

    error: str
    """Machine-readable reason, e.g. ``empty_queries``, ``topk_out_of_range``,
    ``too_many_queries``, ``query_too_long``, ``blank_query``, ``wrong_type``,
    ``invalid_json``, ``body_not_object``, ``missing_field``, ``unknown_field``,
    ``body_too_large``, ``not_ready``, ``search_failed``."""

    detail: str
    """Human-readable explanation naming the offending field."""


class HealthResponse(BaseModel):
    """``GET /healthz``: 200 with status ``ok`` once the index is loaded, else 503."""

    status: str
    """``ok``, ``loading`` or ``failed``."""

    method: str
    """Retriever: bm25, dense or hybrid."""

    num_passages: int
    """Passages in the loaded index (0 while loading)."""

    detail: str = ""
    """Why loading failed (empty otherwise)."""
