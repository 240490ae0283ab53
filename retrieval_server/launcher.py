"""Start a real retrieval server (uvicorn in a subprocess, loopback, free port) and stop it
again: the driver's supervisor (:mod:`services.retrieval_supervisor`), ``stppo eval``, the
tests' ``retrieval_server_url`` / ``retrieval_server_factory`` fixtures and the benchmarks::

    with running_server(RetrievalServerConfig(corpus_path=..., index_dir=tmp)) as server:
        httpx.post(server.url + "/retrieve", json={"queries": ["lima"], "topk": 3})

The index is built in this process first (``build_index``: BM25 on a few dozen passages takes
milliseconds); the child only loads it. Only the child this helper started is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from retrieval_server.__main__ import PARENT_PID_ENV
from retrieval_server.config import RetrievalServerConfig

"""36 hand-written passages with known rankings (see tests/fixtures/retrieval/README.md)."""


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time (message has its log)."""


@dataclass
class RunningServer:
    """A live server started by :func:`start_server`."""

    url: str
    """Base URL, e.g. ``http://127.0.0.1:41234`` (no trailing slash)."""
    process: subprocess.Popen
    config: RetrievalServerConfig
    log_path: Path
    """File receiving the child's stdout and stderr."""

    def log_tail(self, num_chars: int = 4000) -> str:
        """The last characters of the server log (for failure messages)."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return text[-num_chars:]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _command(config: RetrievalServerConfig) -> list[str]:
    args = [sys.executable, "-m", "retrieval_server"]
    for name, value in config.model_dump(exclude_defaults=True).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


PORT_ATTEMPTS = 3
"""Ports tried when ``config.port`` is 0 and another process takes the picked port first."""


def start_server(
    config: RetrievalServerConfig,
    log_path: Path,
    startup_timeout_s: float = 120.0,
    append: bool = False,
) -> RunningServer:
    """Build the index if needed, start ``python -m retrieval_server`` and wait for /healthz 200.

    ``config.port`` 0 is replaced by a free port; if another process binds it before the
    server does ("address already in use"), another one is tried, up to
    :data:`PORT_ATTEMPTS` in all. ``config.host`` should be loopback. ``append`` keeps what
    ``log_path`` already holds (a restart after a crash).

    Raises:
        ServerStartError: the process exited, /healthz said ``failed``, or it was not healthy
            within ``startup_timeout_s`` seconds (the child is stopped first).
    """
    from retrieval_server.index import build_index

    build_index(config)
    pick = config.port == 0
    for attempt in range(PORT_ATTEMPTS if pick else 1):
        chosen = config.model_copy(update={"port": free_port(config.host)}) if pick else config
        appending = append or attempt > 0
        offset = log_path.stat().st_size if appending and log_path.exists() else 0
        server = _spawn(chosen, log_path, append=appending)
        try:
            _wait_healthy(server, startup_timeout_s)
            return server
        except ServerStartError:
            stop_server(server)
            with log_path.open("rb") as log:  # this attempt's lines only
                log.seek(offset)
                lost_race = b"address already in use" in log.read().lower()
            if not (pick and lost_race and attempt + 1 < PORT_ATTEMPTS):
                raise
        except BaseException:
            stop_server(server)
            raise
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _spawn(config: RetrievalServerConfig, log_path: Path, append: bool) -> RunningServer:
    url = f"http://{config.host}:{config.port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    # the server exits when this process does (a kill -9 of the driver leaves no orphan
    # holding the port); PR_SET_PDEATHSIG would fire when the starting *thread* ends, and
    # the supervisor restarts servers from short-lived threads
    env[PARENT_PID_ENV] = str(os.getpid())
    with log_path.open("ab" if append else "wb") as log_file:
        process = subprocess.Popen(
            _command(config), stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=root
        )
    return RunningServer(url=url, process=process, config=config, log_path=log_path)


def _wait_healthy(server: RunningServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerStartError(
                f"retrieval server exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        with contextlib.suppress(httpx.TransportError):
            response = httpx.get(server.url + "/healthz", timeout=2.0)
            if response.status_code == 200:
                return
            if response.json().get("status") == "failed":
                raise ServerStartError(f"index load failed: {response.json().get('detail')}")
        time.sleep(0.1)
    raise ServerStartError(
        f"retrieval server not healthy after {timeout_s} s:\n{server.log_tail()}"
    )


def stop_server(server: RunningServer, timeout_s: float = 10.0) -> int:
    """SIGTERM the child (then SIGKILL after ``timeout_s``); returns its exit status."""
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)
    return int(process.returncode)


@contextlib.contextmanager
def running_server(
    config: RetrievalServerConfig, log_path: Path, startup_timeout_s: float = 120.0
) -> Iterator[RunningServer]:
    """Context manager around :func:`start_server` / :func:`stop_server`."""
    server = start_server(config, log_path, startup_timeout_s)
    try:
        yield server
    finally:
        stop_server(server)
