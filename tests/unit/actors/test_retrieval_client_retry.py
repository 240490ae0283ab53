"""The retrieval client's retry schedule: exponential backoff with jitter, capped, inside a
total deadline (no retry starts after ``retry_deadline_s``). Nothing listens on the port, so
every attempt fails at once with a connection error; sleeps are recorded, not slept."""

from __future__ import annotations

import time

import pytest

from actors.config import RetrievalClientConfig
from actors.retrieval_client import RetrievalClient, RetrievalFailed
from retrieval_server.launcher import free_port


def test_default_retry_window_outlasts_a_server_restart() -> None:
    # a managed-server restart takes about 4 s here (full corpus: index load 2.3 s)
    assert RetrievalClientConfig().retry_deadline_s >= 30.0


def test_backoff_doubles_up_to_the_cap_with_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    config = RetrievalClientConfig(
        max_retries=6, backoff_initial_s=0.1, backoff_max_s=0.4, retry_deadline_s=600.0
    )
    client = RetrievalClient(f"http://127.0.0.1:{free_port()}", config)
    with pytest.raises(RetrievalFailed) as info:
        client.retrieve(["q"])
    assert (info.value.attempts, info.value.reason) == (7, "connect")
    assert client.stats.num_failures == 1  # counted, never an empty result
    # base before retry n: min(0.1 * 2**n, 0.4) = .1, .2, .4, .4, .4, .4; jitter in [0, 0.1)
    bases = [0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    assert len(sleeps) == 6
    assert all(b <= s <= b + 0.1 for s, b in zip(sleeps, bases, strict=True)), sleeps
    assert len({round(s - b, 9) for s, b in zip(sleeps, bases, strict=True)}) > 1  # jittered


def test_no_retry_starts_after_the_deadline() -> None:
    config = RetrievalClientConfig(
        max_retries=1000, backoff_initial_s=0.05, backoff_max_s=0.1, retry_deadline_s=1.0
    )
    client = RetrievalClient(f"http://127.0.0.1:{free_port()}", config)
    start = time.monotonic()
    with pytest.raises(RetrievalFailed) as info:
        client.retrieve(["q"])
    elapsed_s = time.monotonic() - start
    # ~1 s of retries every 0.1-0.2 s, then it gives up: bounded by the deadline, not by the
    # count (1000 retries would take > 100 s); generous above for a loaded machine
    assert 0.5 < elapsed_s < 10.0
    assert 4 <= info.value.attempts < 30
