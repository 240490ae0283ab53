"""Shared fakes for rollout tests (importable because pytest puts ``tests/`` on sys.path
for the root conftest)."""

from __future__ import annotations

from actors.retrieval_client import Passage, RetrievalFailed


class TableRetriever:
    """In-process retriever: query -> passages.

    With ``fail=True`` every call raises :class:`RetrievalFailed` like the HTTP client does
    after its retries, as if the server had answered HTTP ``status``.
    """

    def __init__(self, table: dict[str, list[Passage]], fail: bool = False, status: int = 503):
        self.table = table
        self.fail = fail
        self.status = status
        self.requests: list[list[str]] = []

    def retrieve(self, queries: list[str]) -> list[list[Passage]]:
        self.requests.append(list(queries))
        if self.fail:
            raise RetrievalFailed(
                f"/retrieve failed after 4 attempt(s): HTTP {self.status}", 4, f"http_{self.status}"
            )
        return [self.table[q] for q in queries]
