"""The real retrieval server (uvicorn subprocess, loopback) against hostile clients: a chunked
body with no Content-Length, half-sent requests, a flood of idle connections.

Raw sockets, because HTTP clients refuse to send these. Each test bounds its own time and
the server's memory (RSS read with psutil), and checks the server still answers real
queries afterwards.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from fixture_paths import FIXTURE_CORPUS

from retrieval_server.config import RetrievalServerConfig
from retrieval_server.launcher import RunningServer, start_server, stop_server

pytestmark = pytest.mark.integration

LIMIT_BYTES = 64 * 1024
"""max_body_bytes of the server under test (the schema limits below need < 3 KiB)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("hostile")
    config = RetrievalServerConfig(
        corpus_path=FIXTURE_CORPUS,
        index_dir=tmp / "index",
        port=0,
        max_queries_per_request=4,
        max_query_chars=64,
        max_body_bytes=LIMIT_BYTES,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        max_connections=64,
    )
    running = start_server(config, tmp / "server.log")
    yield running
    stop_server(running)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5.0)


def _rss_bytes(server: RunningServer) -> int:
    return psutil.Process(server.process.pid).memory_info().rss


def _assert_serves(url: str) -> None:
    response = httpx.post(url + "/retrieve", json={"queries": ["capital of Peru"]}, timeout=10)
    assert response.status_code == 200
    assert [d["id"] for d in response.json()["result"][0]] == ["0", "1", "17"]


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; (bytes, seconds taken)."""
    start = time.monotonic()
    data = b""
    sock.settimeout(timeout_s)
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - start


def test_streamed_body_without_content_length_gets_413_in_bounded_time_and_memory(
    server: RunningServer,
) -> None:
    """A chunked upload of up to 256 MiB (4,096x the limit) with no Content-Length header.
    The server must answer 413 once it has read just over the limit, and close: the client
    gets to push at most the limit plus the kernel socket buffers."""
    rejected_before = _metric(server.url, 'stppo_retrieval_errors_total{reason="body_too_large"}')
    rss_before = _rss_bytes(server)
    sock = _connect(server.url)
    sock.sendall(
        b"POST /retrieve HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b'{"queries": ["' + b"a" * (64 * 1024 - 16)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent, start, answer = 0, time.monotonic(), b""
    sock.setblocking(False)
    while sent < 256 * 2**20 and time.monotonic() - start < 30:
        readable, writable, _ = select.select([sock], [sock], [], 1.0)
        if readable:
            break  # the server answered (or closed): stop sending
        if writable:
            try:
                sent += sock.send(chunk)  # a partial send only shortens this chunk: fine here
            except (BrokenPipeError, ConnectionResetError):
                break
    sock.setblocking(True)
    with contextlib.suppress(ConnectionResetError, OSError):
        answer, _ = _read_until_closed(sock, timeout_s=5.0)
    elapsed_s = time.monotonic() - start
    sock.close()

    assert elapsed_s < 10.0
    # what was pushed before the server stopped reading: the limit + socket buffers (a few MiB)
    assert sent < 32 * 2**20, f"server kept reading: {sent / 2**20:.0f} MiB sent"
    if answer:  # the kernel may drop the answer when the close resets the connection
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b'"error":"body_too_large"' in answer
        assert b"connection: close" in answer.lower()
    rejected = _metric(server.url, 'stppo_retrieval_errors_total{reason="body_too_large"}')
    assert rejected == rejected_before + 1
    assert _rss_bytes(server) - rss_before < 32 * 2**20
    _assert_serves(server.url)


def test_half_sent_requests_are_closed(server: RunningServer) -> None:
    """Silent connections, half a request head, a head whose body stalls: every one is closed
    by the server within its deadlines (1 s here), while real queries keep being served."""
    silent = [_connect(server.url) for _ in range(10)]
    half_head = [_connect(server.url) for _ in range(10)]
    for sock in half_head:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: test\r\nContent-Le")
    half_body = [_connect(server.url) for _ in range(10)]
    for sock in half_body:
        sock.sendall(
            b"POST /retrieve HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"queries": ["lima'
        )
    _assert_serves(server.url)
    start = time.monotonic()
    for sock in silent + half_head:
        data, _ = _read_until_closed(sock, timeout_s=10.0)
        assert data == b""  # closed without an answer: no request was ever made
    for sock in half_body:
        data, _ = _read_until_closed(sock, timeout_s=10.0)
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        assert b'"error":"body_timeout"' in data
    # 30 connections with 1 s deadlines: closed well before anyone's patience runs out
    assert time.monotonic() - start < 5.0
    for sock in silent + half_head + half_body:
        sock.close()
    _assert_serves(server.url)


def test_connection_limit_answers_503_then_recovers(tmp_path: Path) -> None:
    """With max_connections=4, four idle connections make the next request 503 at once
    (never a hang); once the head deadline closes them, requests are served again."""
    config = RetrievalServerConfig(
        corpus_path=FIXTURE_CORPUS,
        index_dir=tmp_path / "index",
        port=0,
        max_connections=4,
        header_timeout_s=1.5,
    )
    server = start_server(config, tmp_path / "server.log")
    try:
        idle = [_connect(server.url) for _ in range(4)]
        time.sleep(0.2)  # let the server accept them
        refused = httpx.post(server.url + "/retrieve", json={"queries": ["lima"]}, timeout=5)
        assert refused.status_code == 503
        for sock in idle:
            assert _read_until_closed(sock, timeout_s=10.0)[0] == b""
            sock.close()
        _assert_serves(server.url)
    finally:
        stop_server(server)
