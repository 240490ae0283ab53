"""The managed retrieval server lives exactly as long as the process that started it: a
restart from a short-lived thread (the supervisor's) keeps running, and a ``kill -9`` of
the starting process (a driver) takes the server down instead of orphaning it on its port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from fixture_paths import FIXTURE_CORPUS

pytestmark = pytest.mark.integration

PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from retrieval_server.config import RetrievalServerConfig
    from retrieval_server.launcher import start_server

    tmp = Path(sys.argv[1])
    config = RetrievalServerConfig(
        corpus_path=sys.argv[2], index_dir=tmp / "index", port=0, build_missing_index=True
    )
    started = []
    thread = threading.Thread(target=lambda: started.append(start_server(config, tmp / "log")))
    thread.start()
    thread.join()  # the thread that forked the server is gone from here on
    print(started[0].process.pid, started[0].url, flush=True)
    time.sleep(3600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone (its parent, the killed process, never reaps it)
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_server_outlives_its_starting_thread_and_not_its_process(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), str(FIXTURE_CORPUS)],
        stdout=subprocess.PIPE, text=True, cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )  # fmt: skip
    server_pid = None
    try:
        line = parent.stdout.readline()
        assert line, f"the parent exited with {parent.wait()} before starting the server"
        server_pid, url = int(line.split()[0]), line.split()[1]
        time.sleep(2.0)  # a PR_SET_PDEATHSIG child would have been signalled by now
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20.0
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid), "the server outlived the process that started it"
    finally:
        parent.kill()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
