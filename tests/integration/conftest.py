"""Integration fixtures: a real retrieval server (uvicorn subprocess on a free loopback port).

- ``retrieval_server_url``: session-wide BM25 server over the 36-passage fixture corpus
  (``tests/fixtures/retrieval/passages.jsonl``); yields its base URL.
- ``retrieval_server_factory``: start more servers on any corpus/method, e.g.
  ``url = retrieval_server_factory(corpus_path, method="bm25", max_queries_per_request=8)``;
  each is stopped at the end of the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixture_paths import FIXTURE_CORPUS

from retrieval_server.config import RetrievalServerConfig
from retrieval_server.launcher import RunningServer, start_server, stop_server


def _config(corpus_path: Path, index_dir: Path, **overrides: object) -> RetrievalServerConfig:
    return RetrievalServerConfig(corpus_path=corpus_path, index_dir=index_dir, port=0, **overrides)


@pytest.fixture(scope="session")
def retrieval_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The session's BM25 server over the fixture corpus (a :class:`RunningServer`)."""
    tmp = tmp_path_factory.mktemp("retrieval_server")
    server = start_server(_config(FIXTURE_CORPUS, tmp / "index"), tmp / "server.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def retrieval_server_url(retrieval_server: RunningServer) -> str:
    """Base URL (``http://127.0.0.1:<port>``) of the session's fixture-corpus BM25 server."""
    return retrieval_server.url


@pytest.fixture
def retrieval_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., str]]:
    """Start servers on a given corpus: ``factory(corpus_path=None, **config_fields) -> url``.

    ``corpus_path`` None serves the fixture corpus. Indexes go to a fresh temp folder.
    """
    started: list[RunningServer] = []

    def start(corpus_path: Path | None = None, **overrides: object) -> str:
        tmp = tmp_path_factory.mktemp("retrieval_server")
        config = _config(corpus_path or FIXTURE_CORPUS, tmp / "index", **overrides)
        server = start_server(config, tmp / "server.log")
        started.append(server)
        return server.url

    yield start
    for server in started:
        stop_server(server)
