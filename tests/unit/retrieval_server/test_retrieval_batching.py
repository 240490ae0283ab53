"""SearchBatcher: concurrent requests are coalesced into fewer search calls and every request
gets exactly what a lone search would return."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from fixture_paths import FIXTURE_CORPUS

from retrieval_server.batching import SearchBatcher
from retrieval_server.passages import load_passages
from retrieval_server.retrievers import BM25Retriever, SearchHits

QUERIES = ["capital of Peru", "who discovered polonium", "Narita airport", "asthma", "Lima"]


class GatedBM25:
    """The real BM25 retriever, but each search waits for ``gate`` (so requests pile up) and
    the calls are recorded."""

    def __init__(self, inner: BM25Retriever) -> None:
        self.inner = inner
        self.passages = inner.passages
        self.method = "bm25"
        self.gate = threading.Event()
        self.calls: list[tuple[int, int]] = []  # (num_queries, topk)

    def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
        self.gate.wait(10)
        self.calls.append((len(queries), topk))
        return self.inner.search(queries, topk)


@pytest.fixture(scope="module")
def bm25() -> BM25Retriever:
    return BM25Retriever.build(load_passages(FIXTURE_CORPUS))


def _ids(hits: list[SearchHits]) -> list[list[int]]:
    return [h.passage_indices.tolist() for h in hits]


def test_concurrent_requests_are_coalesced_and_answers_unchanged(bm25: BM25Retriever) -> None:
    gated = GatedBM25(bm25)

    async def scenario() -> list[list[SearchHits]]:
        batcher = SearchBatcher(gated, ThreadPoolExecutor(1), max_batch_queries=64)
        batcher.start()
        queries = QUERIES * 4
        tasks = [asyncio.create_task(batcher.search(queries[0:1], 3))]
        await asyncio.sleep(0.02)  # the consumer took it and is blocked on the gate
        tasks += [asyncio.create_task(batcher.search([q], 3)) for q in queries[1:]]
        await asyncio.sleep(0.02)  # the other 19 pile up meanwhile
        gated.gate.set()
        results = await asyncio.gather(*tasks)
        await batcher.stop()
        return results

    results = asyncio.run(scenario())
    # The first call takes the first request alone, the second the 19 that piled up while
    # it ran: 2 search calls for 20 requests.
    assert gated.calls == [(1, 3), (19, 3)]
    for query, hits in zip(QUERIES * 4, results, strict=True):
        assert _ids(hits) == _ids(bm25.search([query], 3))


def test_only_equal_topk_share_a_search_and_max_batch_is_respected(bm25: BM25Retriever) -> None:
    gated = GatedBM25(bm25)

    async def scenario() -> list[list[SearchHits]]:
        batcher = SearchBatcher(gated, ThreadPoolExecutor(1), max_batch_queries=3)
        batcher.start()
        first = asyncio.create_task(batcher.search(["Lima"], 1))
        await asyncio.sleep(0.02)
        rest = [
            asyncio.create_task(batcher.search(q, k))
            for q, k in [(["Paris", "Tokyo"], 2), (["Chile"], 5), (["Kenya"], 2), (["Oxygen"], 2)]
        ]
        await asyncio.sleep(0.05)
        gated.gate.set()
        results = await asyncio.gather(first, *rest)
        await batcher.stop()
        return results

    results = asyncio.run(scenario())
    # topk 2: ["Paris","Tokyo"] + ["Kenya"] fill max 3 queries; ["Oxygen"] waits; topk 5 alone.
    assert gated.calls == [(1, 1), (3, 2), (1, 5), (1, 2)]
    assert [len(r) for r in results] == [1, 2, 1, 1, 1]
    assert _ids(results[1]) == _ids(bm25.search(["Paris", "Tokyo"], 2))
    assert _ids(results[2]) == _ids(bm25.search(["Chile"], 5))


def test_search_error_reaches_every_request_of_the_batch(bm25: BM25Retriever) -> None:
    class Failing(GatedBM25):
        def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
            raise RuntimeError("index file vanished")

    async def scenario() -> list[object]:
        batcher = SearchBatcher(Failing(bm25), ThreadPoolExecutor(1), max_batch_queries=8)
        batcher.start()
        results = await asyncio.gather(
            batcher.search(["a"], 3), batcher.search(["b"], 3), return_exceptions=True
        )
        ok_after = None
        batcher.retriever = bm25  # a later search with a working retriever succeeds
        ok_after = await batcher.search(["Lima"], 1)
        await batcher.stop()
        return [*results, ok_after]

    first, second, after = asyncio.run(scenario())
    assert isinstance(first, RuntimeError) and isinstance(second, RuntimeError)
    assert "vanished" in str(first)
    assert _ids(after) == _ids(bm25.search(["Lima"], 1))
