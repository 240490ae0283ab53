"""uvicorn HTTP protocol with a deadline on the request head.

uvicorn arms a timer only between keep-alive requests (``timeout_keep_alive``, after a
response): a client that connects and sends nothing, or half a request line, or headers
without the final blank line, holds its connection (and a file descriptor, and a slot of
``limit_concurrency``) forever. :class:`HeadTimeoutProtocol` closes such a connection when
its request head is not complete ``head_timeout_s`` seconds after the connection opened or
after the first byte of the next keep-alive request. Slow *bodies* are the ASGI layer's
business (``RequestGuard`` in :mod:`retrieval_server.server` reads them under a deadline).

The timeout is a class attribute (uvicorn builds one protocol object per connection from
the class, in every worker process): call :func:`configure_head_timeout` before serving.

Example::

    configure_head_timeout(10.0)
    uvicorn.run(app, http=HeadTimeoutProtocol)
"""

from __future__ import annotations

import asyncio
from typing import Any

try:  # uvicorn's "auto" choice: httptools when installed, else h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - httptools is a dependency of uvicorn[standard]
    from uvicorn.protocols.http.h11_impl import H11Protocol as _BaseProtocol  # type: ignore


def configure_head_timeout(head_timeout_s: float) -> None:
    """Set the request-head deadline (seconds, > 0) for connections opened from now on."""
    if not head_timeout_s > 0:
        raise ValueError(f"head_timeout_s must be > 0, got {head_timeout_s}")
    HeadTimeoutProtocol.head_timeout_s = float(head_timeout_s)


class HeadTimeoutProtocol(_BaseProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol plus a deadline for receiving a complete request head.

    Invariant: while no request is being handled (``cycle`` is None or its response is
    complete) and bytes of a new request have arrived, or the connection just opened, a timer
    of ``head_timeout_s`` seconds is armed; it is cancelled once a request head is parsed, and
    otherwise closes the transport.
    """

    head_timeout_s: float = 10.0

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm_head_timer()
        super().data_received(data)
        if not self._between_requests():  # a head was parsed: the request now runs
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()
