"""Supervision of the managed retrieval server, with real processes: the server is killed
(SIGKILL) while rollouts are searching through it. The supervisor restarts it on the same
port, the searches in flight wait through the outage (client retry deadline), and every
trajectory still searched: none was failed, dropped or replaced by one that never searched.
When the restart budget is spent the run gets a clear error instead.

The policy is the scripted engine (it always searches, then answers), the rollout loop,
retrieval client, server and supervisor are the real ones.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from fixture_paths import FIXTURE_CORPUS
from scripted_engine import ScriptedEngine
from transformers import AutoTokenizer

from actors.config import RetrievalClientConfig, RolloutConfig
from actors.rollout import RolloutWorker
from retrieval_server.config import RetrievalServerConfig
from services.retrieval_supervisor import (
    RetrievalServerLost,
    RetrievalSupervisor,
    RetrievalSupervisorConfig,
)

pytestmark = pytest.mark.integration

QUESTIONS = {
    "What is the capital of Peru?": ["<search> capital of Peru </search>", "<answer> Lima </answer>"],
    "Who discovered polonium?": ["<search> who discovered polonium </search>", "<answer> Marie Curie </answer>"],
}  # fmt: skip
RECORDS = [
    {"id": "peru", "question": q, "golden_answers": [a], "data_source": "single_hop"}
    for q, a in zip(QUESTIONS, ["Lima", "Marie Curie"], strict=True)
]


def _supervisor(tmp_path: Path, max_restarts: int) -> RetrievalSupervisor:
    server = RetrievalServerConfig(corpus_path=FIXTURE_CORPUS, index_dir=tmp_path / "index", port=0)
    restarts_counted = []
    supervisor = RetrievalSupervisor(
        server,
        tmp_path / "retrieval.log",
        RetrievalSupervisorConfig(max_restarts=max_restarts, poll_interval_s=0.2),
        on_restart=lambda: restarts_counted.append(1),
    )
    supervisor.restarts_counted = restarts_counted  # type: ignore[attr-defined]
    return supervisor


def _worker(model_dir: Path, url: str, client: RetrievalClientConfig) -> RolloutWorker:
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = RolloutConfig(group_size=2, max_turns=2, max_information_tokens=64, retrieval=client)
    return RolloutWorker("unused", cfg, url, engine=ScriptedEngine(tok, QUESTIONS))


def test_killed_server_is_restarted_and_searching_rollouts_recover(
    tmp_path: Path, model_dir: Path
) -> None:
    supervisor = _supervisor(tmp_path, max_restarts=2)
    url = supervisor.start()
    worker = _worker(model_dir, url, RetrievalClientConfig(backoff_max_s=0.5))
    trajectories = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def roll() -> None:  # rollouts back to back, as the actors do during a run
        try:
            while not stop.is_set():
                trajectories.extend(worker.rollout(RECORDS))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=roll)
    thread.start()
    try:
        time.sleep(1.0)
        first_pid = supervisor.pid
        before_kill = len(trajectories)
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while supervisor.restarts < 1 and time.monotonic() < deadline:
            supervisor.raise_if_failed()
            time.sleep(0.1)
        assert supervisor.restarts == 1 and supervisor.up
        during_outage = worker.client.stats.num_retries
        time.sleep(1.0)  # more rollouts against the restarted server
    finally:
        stop.set()
        thread.join(120)
        worker.close()
        supervisor.stop()
    assert not errors, errors
    assert supervisor.pid != first_pid and supervisor.url == url  # same port, new process
    assert supervisor.restarts_counted == [1]  # the Prometheus counter's hook, once
    assert before_kill > 0 and len(trajectories) > before_kill
    assert during_outage >= 1  # searches did hit the dead server and were retried
    # nothing failed, nothing went without its search: every trajectory searched and got passages
    assert [t.retrieval_failed for t in trajectories] == [False] * len(trajectories)
    assert all(t.num_searches == 1 for t in trajectories)
    assert all(t.reward == 1.0 for t in trajectories)
    assert worker.client.stats.num_failures == 0


def test_server_that_cannot_come_back_fails_the_run_clearly(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, max_restarts=1)
    supervisor.start()
    try:
        os.kill(supervisor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while supervisor.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert supervisor.restarts == 1
        supervisor.raise_if_failed()  # one restart was within budget
        os.kill(supervisor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(RetrievalServerLost, match=r"exited with code -9 after 1 restart\(s\); max_restarts=1 is spent"):  # fmt: skip
            while time.monotonic() < deadline:
                supervisor.raise_if_failed()
                time.sleep(0.1)
        assert not supervisor.up
    finally:
        supervisor.stop()


def test_driver_pauses_rollouts_while_down_and_stops_when_lost(tmp_path: Path) -> None:
    """The driver loop's gate (``Services.retrieval_up``) over a real supervisor."""
    from services.loop.bootstrap import Services

    services = Services(tmp_path, None, None, None)  # type: ignore[arg-type]
    assert services.retrieval_up()  # external server (no supervisor): never paused
    supervisor = _supervisor(tmp_path, max_restarts=0)
    supervisor.start()
    services.retrieval = supervisor
    try:
        assert services.retrieval_up()
        os.kill(supervisor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(RetrievalServerLost, match="max_restarts=0 is spent"):
            while time.monotonic() < deadline:
                if not services.retrieval_up():
                    assert not supervisor.up  # paused: no rollout admitted
                time.sleep(0.05)
    finally:
        supervisor.stop()
