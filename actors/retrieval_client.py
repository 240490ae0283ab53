"""HTTP client of the retrieval server (Search-R1 ``POST /retrieve`` contract).

Every call either returns one passage list per query or raises :class:`RetrievalFailed`;
it never turns an outage into an empty result (an empty ``<information>`` block would be
silent reward noise). Transient failures -- connection errors, timeouts, HTTP 5xx, 429 --
are retried with exponential backoff plus jitter (tenacity: wait
``min(b * 2**n, backoff_max_s) + uniform(0, b)`` before retry n, ``b = backoff_initial_s``)
for ``retry_deadline_s`` seconds after the first attempt (no retry starts later; at most
``max_retries`` retries), so a search in flight outlasts a restart of the server; other
HTTP errors (4xx: a request the server rejects) and malformed bodies fail at once.
:class:`RetrievalStats` counts requests, retries and failures for metrics.

Only ``httpx`` and ``pydantic`` here: the actors talk to ``retrieval_server`` over HTTP and
import none of its code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    wait_exponential,
    wait_random,
)

from actors.config import RetrievalClientConfig

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP statuses worth retrying (overload / transient server faults)."""


class RetrievalFailed(RuntimeError):
    """A ``/retrieve`` call failed for good (after retries, or on a non-retryable error).

    Attributes:
        attempts: HTTP attempts made (1 + retries used).
        reason: Short machine-readable cause: ``timeout``, ``connect``, ``http_<status>``,
            ``bad_response``.
    """

    def __init__(self, message: str, attempts: int, reason: str) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.reason = reason


class _Document(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    contents: str


class _ScoredDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    document: _Document
    score: float


class _RetrieveResponse(BaseModel):
    result: list[list[_ScoredDocument]]


@dataclass(frozen=True)
class Passage:
    """One retrieved passage.

    Attributes:
        id: Corpus passage id.
        title: Title (first line of ``contents`` without its quotes).
        text: Passage body (rest of ``contents``).
        score: Retriever score (higher is better; BM25/cosine/RRF units).
    """

    id: str
    title: str
    text: str
    score: float


@dataclass
class RetrievalStats:
    """Counters since the client was created (monotonic; export as Prometheus counters).

    Attributes:
        num_requests: ``retrieve`` calls.
        num_attempts: HTTP attempts, retries included.
        num_retries: Attempts after a failed one.
        num_failures: Calls that raised :class:`RetrievalFailed`.
        num_queries: Queries sent in successful calls.
        retrieval_s: Wall seconds inside ``retrieve`` (successes and failures).
    """

    num_requests: int = 0
    num_attempts: int = 0
    num_retries: int = 0
    num_failures: int = 0
    num_queries: int = 0
    retrieval_s: float = 0.0


class _Transient(Exception):
    """Internal: a retryable failure (carries the reason for the final error)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def split_contents(contents: str) -> tuple[str, str]:
    """Split Search-R1 ``contents`` (``"\\"Title\\"\\ntext"``) into ``(title, text)``.

    Example: ``split_contents('"Paris"\\nParis is the capital.') == ("Paris", "Paris is the capital.")``.
    A passage without a newline has title "" and the whole string as text.
    """
    head, sep, body = contents.partition("\n")
    if not sep:
        return "", contents.strip()
    return head.strip().strip('"'), body.strip()


class RetrievalClient:
    """Synchronous client for ``POST {base_url}/retrieve``.

    Args:
        base_url: Server root, e.g. ``http://127.0.0.1:8000``.
        config: topk, per-attempt timeout (s), max retries, initial backoff (s).

    Example:
        >>> client = RetrievalClient("http://127.0.0.1:8000", RetrievalClientConfig())
        >>> passages = client.retrieve(["capital of peru"])  # [[Passage, ...]]
    """

    def __init__(self, base_url: str, config: RetrievalClientConfig) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"retrieval base_url must start with http:// or https://, got {base_url!r}"
            )
        self.base_url = base_url.rstrip("/")
        self.config = config
        self.stats = RetrievalStats()
        self._http = httpx.Client(timeout=httpx.Timeout(config.timeout_s))

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def __enter__(self) -> RetrievalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def retrieve(self, queries: list[str]) -> list[list[Passage]]:
        """Top-k passages for each query, best first, in query order.

        Args:
            queries: 1+ non-blank query strings.

        Returns:
            ``len(queries)`` lists of up to ``config.topk`` passages (a list may be shorter,
            even empty, when the retriever matched fewer passages: that is an answer, not
            a failure).

        Raises:
            ValueError: no queries, or a blank query (the caller's bug; nothing is sent).
            RetrievalFailed: the server could not answer within ``retry_deadline_s`` (or
                ``1 + max_retries`` attempts) of transient errors or rejected the request / answered malformed JSON.
        """
        if not queries:
            raise ValueError("retrieve() needs at least one query")
        blank = [i for i, q in enumerate(queries) if not q.strip()]
        if blank:
            raise ValueError(f"retrieve() got blank queries at positions {blank}")
        self.stats.num_requests += 1
        start = time.perf_counter()
        try:
            result = self._retrieve_with_retries(queries)
        except RetrievalFailed:
            self.stats.num_failures += 1
            raise
        finally:
            self.stats.retrieval_s += time.perf_counter() - start
        self.stats.num_queries += len(queries)
        return result

    def _retrieve_with_retries(self, queries: list[str]) -> list[list[Passage]]:
        retrying = Retrying(
            stop=stop_after_attempt(1 + self.config.max_retries)
            | stop_before_delay(self.config.retry_deadline_s),
            # wait before retry n (0-based): min(b * 2**n, max) + uniform(0, b)
            wait=wait_exponential(
                multiplier=self.config.backoff_initial_s, max=self.config.backoff_max_s
            )
            + wait_random(0, self.config.backoff_initial_s),
            retry=retry_if_exception(lambda e: isinstance(e, _Transient)),
            before_sleep=self._count_retry,
            reraise=True,
        )
        attempts = 0
        try:
            for attempt in retrying:
                with attempt:
                    attempts += 1
                    self.stats.num_attempts += 1
                    return self._post(queries)
        except _Transient as err:
            raise RetrievalFailed(
                f"/retrieve failed after {attempts} attempt(s): {err}", attempts, err.reason
            ) from err
        except RetrievalFailed as err:
            err.attempts = attempts
            raise
        raise AssertionError("unreachable: tenacity returned without result or error")

    def _count_retry(self, state: RetryCallState) -> None:
        self.stats.num_retries += 1

    def _post(self, queries: list[str]) -> list[list[Passage]]:
        body = {"queries": queries, "topk": self.config.topk, "return_scores": True}
        try:
            response = self._http.post(self.base_url + "/retrieve", json=body)
        except httpx.TimeoutException as err:
            raise _Transient(
                "timeout", f"timeout after {self.config.timeout_s} s: {err!r}"
            ) from err
        except httpx.TransportError as err:
            raise _Transient("connect", f"transport error: {err!r}") from err
        if response.status_code in RETRYABLE_STATUS:
            raise _Transient(
                f"http_{response.status_code}",
                f"HTTP {response.status_code}: {response.text[:200]}",
            )
        if response.status_code != 200:
            raise RetrievalFailed(
                f"/retrieve rejected the request: HTTP {response.status_code}: {response.text[:300]}",
                attempts=1,
                reason=f"http_{response.status_code}",
            )
        return self._parse(response, len(queries))

    @staticmethod
    def _parse(response: httpx.Response, num_queries: int) -> list[list[Passage]]:
        try:
            parsed = _RetrieveResponse.model_validate_json(response.content)
        except ValidationError as err:
            raise RetrievalFailed(
                f"/retrieve answered a malformed body: {err}", 1, "bad_response"
            ) from err
        if len(parsed.result) != num_queries:
            raise RetrievalFailed(
                f"/retrieve answered {len(parsed.result)} result lists for {num_queries} queries",
                1,
                "bad_response",
            )
        return [
            [Passage(d.document.id, *split_contents(d.document.contents), d.score) for d in docs]
            for docs in parsed.result
        ]
