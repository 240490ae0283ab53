"""A search sent while the retrieval server is down succeeds once it is back on the same
port (the default client config, real server process): the retry window outlasts a restart."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fixture_paths import FIXTURE_CORPUS

from actors.config import RetrievalClientConfig
from actors.retrieval_client import RetrievalClient
from retrieval_server.config import RetrievalServerConfig
from retrieval_server.launcher import free_port, start_server, stop_server

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


def test_start_server_tries_another_port_when_the_picked_one_is_taken(
    tmp_path: Path, monkeypatch
) -> None:
    """Port 0: the picked port is free when picked, but another process may bind it before
    the server does. The server then exits with "address already in use" and another port
    is tried, instead of the start (and the test or job) failing on the race."""
    import socket

    import httpx

    from retrieval_server import launcher

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real_free_port = launcher.free_port
        monkeypatch.setattr(
            launcher,
            "free_port",
            lambda host="127.0.0.1": next(picks, None) or real_free_port(host),
        )
        config = RetrievalServerConfig(
            corpus_path=FIXTURE_CORPUS, index_dir=tmp_path / "index", port=0
        )
        server = launcher.start_server(config, tmp_path / "server.log")
        try:
            assert server.config.port != taken
            assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
            log = (tmp_path / "server.log").read_text().lower()
            assert "address already in use" in log  # the first attempt lost the race
        finally:
            stop_server(server)
