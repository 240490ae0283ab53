"""A search sent while the retrieval server is down succeeds once it is back on the same
port (the default client config, real server process): the retry window outlasts a restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from actors.config import RetrievalClientConfig
from actors.retrieval_client import RetrievalClient
from retrieval_server.config import RetrievalServerConfig
from retrieval_server.testing import FIXTURE_CORPUS, free_port, start_server, stop_server

pytestmark = pytest.mark.integration


def test_search_in_flight_waits_through_a_4_s_outage(tmp_path: Path) -> None:
    from retrieval_server.index import build_index

    config = RetrievalServerConfig(
        corpus_path=FIXTURE_CORPUS, index_dir=tmp_path / "index", port=free_port()
    )
    build_index(config)
    servers = []

    def start_later() -> None:
        time.sleep(4.0)  # what a restart of the managed server takes here
        servers.append(start_server(config, tmp_path / "server.log"))

    starter = threading.Thread(target=start_later)
    starter.start()
    client = RetrievalClient(f"http://127.0.0.1:{config.port}", RetrievalClientConfig())
    try:
        start = time.monotonic()
        [passages] = client.retrieve(["capital of Peru"])
        waited_s = time.monotonic() - start
    finally:
        starter.join()
        for server in servers:
            stop_server(server)
    assert [p.id for p in passages] == ["0", "1", "17"]
    assert waited_s > 4.0
    assert client.stats.num_retries >= 2 and client.stats.num_failures == 0
