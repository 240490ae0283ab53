"""Supervision of the managed retrieval server (the ``python -m retrieval_server`` child).

The driver starts the server through :class:`RetrievalSupervisor`. A watcher thread polls the
child; when it exits (crash, OOM kill, SIGKILL) the watcher restarts it on the same port, so
the URL the rollout actors hold stays valid, at most ``max_restarts`` times per run. While it
is down :attr:`RetrievalSupervisor.up` is False and the driver admits no new rollout;
searches already in flight retry (``rollout.retrieval.retry_deadline_s``, longer than a
restart) and succeed once it is back. When it cannot come back (budget spent, or the restart
itself fails) :meth:`RetrievalSupervisor.raise_if_failed` raises
:class:`RetrievalServerLost` with a message naming the cause and the log, and the run stops:
training never goes on with trajectories that could not search.

Example::

    supervisor = RetrievalSupervisor(server_cfg, run_dir / "retrieval.log",
                                     RetrievalSupervisorConfig(), on_restart=counter.inc)
    url = supervisor.start()
    ...
    supervisor.raise_if_failed()      # in the loop
    if supervisor.up: admit_rollouts()
    supervisor.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from retrieval_server.config import RetrievalServerConfig
    from retrieval_server.launcher import RunningServer

log = logging.getLogger("stppo.retrieval_supervisor")


class RetrievalSupervisorConfig(BaseModel):
    """How the driver keeps the managed retrieval server up."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    max_restarts: int = Field(3, ge=0, le=1000)
    """Restarts allowed per run after the server process exits; one more exit fails the run."""

    poll_interval_s: float = Field(0.5, gt=0.0, le=60.0)
    """Seconds between checks of the server process."""

    restart_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Seconds a restarted server may take to answer ``/healthz`` 200 (index load)."""


class RetrievalServerLost(RuntimeError):
    """The managed retrieval server died and could not be brought back."""


class RetrievalSupervisor:
    """Starts the managed retrieval server and restarts it when its process exits.

    Args:
        server_config: the server's settings; port 0 is replaced by a free port on the first
            start and kept for every restart.
        log_path: file receiving the server's output (restarts append to it, so the
            output of the process that died is kept).
        config: restart budget and timings.
        on_restart: called after each successful restart (e.g. a Prometheus counter's inc).

    Thread-safety: the watcher thread writes ``up``, ``restarts`` and the failure; the driver
    thread only reads them.
    """

    def __init__(
        self,
        server_config: RetrievalServerConfig,
        log_path: Path,
        config: RetrievalSupervisorConfig,
        on_restart: Callable[[], Any] = lambda: None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.server_config = server_config
        self.log_path = Path(log_path)
        self.config = config
        self.on_restart = on_restart
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        """Successful restarts so far."""
        self.up = False
        """True while the server process is running (and was healthy when it started)."""
        self._server: RunningServer | None = None
        self._failure: str = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the server (stable across restarts)."""
        if self._server is None:
            raise RuntimeError("RetrievalSupervisor.start() was not called")
        return self._server.url

    @property
    def pid(self) -> int | None:
        """Process id of the current server process (None before start)."""
        return None if self._server is None else self._server.process.pid

    def start(self) -> str:
        """Start the server, wait until healthy, start watching; returns its base URL.

        Raises:
            retrieval_server.launcher.ServerStartError: the first start failed (not retried:
                a server that never came up is a configuration problem).
        """
        from retrieval_server.launcher import start_server

        self._server = start_server(self.server_config, self.log_path, self.startup_timeout_s)
        self.server_config = self._server.config  # the concrete port, reused on restarts
        self.up = True
        self._thread = threading.Thread(
            target=self._watch, name="retrieval-supervisor", daemon=True
        )
        self._thread.start()
        return self._server.url

    def raise_if_failed(self) -> None:
        """Raise :class:`RetrievalServerLost` once the server cannot come back."""
        if self._failure:
            raise RetrievalServerLost(self._failure)

    def stop(self) -> None:
        """Stop watching, then stop the server (SIGTERM, SIGKILL after 10 s)."""
        from retrieval_server.launcher import stop_server

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.restart_timeout_s + 30.0)
        if self._server is not None:
            stop_server(self._server)
        self.up = False

    # ----------------------------------------------------------------- watcher thread

    def _watch(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            server = self._server
            assert server is not None
            code = server.process.poll()
            if code is None:
                continue
            self.up = False
            if not self._restart(code):
                return

    def _restart(self, exit_code: int) -> bool:
        """Restart after the process exited with ``exit_code``; False once given up."""
        from retrieval_server.launcher import ServerStartError, start_server

        if self.restarts >= self.config.max_restarts:
            self._fail(
                f"retrieval server (pid {self.pid}) exited with code {exit_code} after "
                f"{self.restarts} restart(s); max_restarts={self.config.max_restarts} is spent"
            )
            return False
        log.warning(
            "retrieval server (pid %s) exited with code %s; restarting (%d of %d)",
            self.pid,
            exit_code,
            self.restarts + 1,
            self.config.max_restarts,
        )
        started = time.perf_counter()
        try:
            self._server = start_server(
                self.server_config, self.log_path, self.config.restart_timeout_s, append=True
            )
        except ServerStartError as exc:
            self._fail(f"retrieval server exited with code {exit_code} and restart failed: {exc}")
            return False
        self.restarts += 1
        self.up = True
        self.on_restart()
        log.warning(
            "retrieval server back at %s (pid %s) in %.1f s",
            self.url,
            self.pid,
            time.perf_counter() - started,
        )
        return True

    def _fail(self, message: str) -> None:
        self._failure = f"{message} (log: {self.log_path})"
        log.error("%s", self._failure)
