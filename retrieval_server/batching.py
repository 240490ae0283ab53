"""Coalesce concurrent ``/retrieve`` calls into one ``Retriever.search`` call.

Rollout actors send many small concurrent requests (one query per turn). Searching them one
by one costs a thread hand-off per request and, for the dense retriever, one encoder forward
pass per request; while a search runs, the requests that arrive meanwhile are queued and the
next search takes all of them at once (up to ``max_batch_queries``). Only requests with the
same ``topk`` share a search, so every answer is exactly what a lone request would get.

Example::

    batcher = SearchBatcher(retriever, executor, max_batch_queries=256, num_consumers=1)
    batcher.start()                      # inside the running event loop
    hits = await batcher.search(["capital of peru"], topk=3)
    await batcher.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from retrieval_server.retrievers import Retriever, SearchHits


@dataclass
class _Pending:
    queries: Sequence[str]
    topk: int
    future: asyncio.Future


class SearchBatcher:
    """Queue of pending searches drained by ``num_consumers`` tasks, each running one
    ``retriever.search`` at a time in ``executor``.

    Errors: an exception raised by ``retriever.search`` is set on every request of that batch.
    """

    def __init__(
        self,
        retriever: Retriever | None,
        executor: Executor,
        max_batch_queries: int,
        num_consumers: int = 1,
    ) -> None:
        if max_batch_queries < 1 or num_consumers < 1:
            raise ValueError("max_batch_queries and num_consumers must be >= 1")
        self.retriever = retriever
        """Set (or replaced) once the index is loaded; searched at the time of each batch."""
        self._executor = executor
        self._max_batch_queries = max_batch_queries
        self._num_consumers = num_consumers
        self._pending: deque[_Pending] = deque()
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self.num_search_calls = 0
        """Calls made to ``retriever.search`` so far (a request count above it = coalescing)."""

    def start(self) -> None:
        """Start the consumer tasks on the running event loop."""
        self._wakeup = asyncio.Event()
        self._tasks = [asyncio.create_task(self._consume()) for _ in range(self._num_consumers)]

    async def stop(self) -> None:
        """Cancel the consumers; pending requests get ``CancelledError``."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while self._pending:
            self._pending.popleft().future.cancel()

    async def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
        """Top-``topk`` hits per query, like ``retriever.search`` (awaits its turn)."""
        if self._wakeup is None or self.retriever is None:
            raise RuntimeError("SearchBatcher has no retriever or start() was not called")
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(queries, topk, future))
        self._wakeup.set()
        return await future

    def _take_batch(self) -> list[_Pending]:
        """The oldest live request plus the following ones with the same topk that fit."""
        batch: list[_Pending] = []
        num_queries = 0
        skipped: deque[_Pending] = deque()
        while self._pending:
            item = self._pending.popleft()
            if item.future.done():  # client went away
                continue
            fits = num_queries + len(item.queries) <= self._max_batch_queries
            if batch and (item.topk != batch[0].topk or not fits):
                skipped.append(item)
                continue
            batch.append(item)
            num_queries += len(item.queries)
        self._pending.extendleft(reversed(skipped))
        return batch

    async def _consume(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            batch = self._take_batch()
            if not self._pending:
                self._wakeup.clear()
            if not batch:
                continue
            queries = [q for item in batch for q in item.queries]
            self.num_search_calls += 1
            try:
                hits = await loop.run_in_executor(
                    self._executor, self.retriever.search, queries, batch[0].topk
                )
            except Exception as exc:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            offset = 0
            for item in batch:
                if not item.future.done():
                    item.future.set_result(hits[offset : offset + len(item.queries)])
                offset += len(item.queries)
