"""Retrieval client and the rollout's failure path over real HTTP.

- the real retrieval server (``retrieval_server_url`` fixture, BM25 on the fixture corpus);
- a tiny FastAPI "faulty server" started with uvicorn on loopback that answers 500, 422,
  answers too slowly, or fails N times then succeeds, and counts the attempts it received.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from scripted_engine import ScriptedEngine
from transformers import AutoTokenizer

from actors.config import RetrievalClientConfig, RolloutConfig
from actors.retrieval_client import RetrievalClient, RetrievalFailed
from actors.rollout import run_rollout

pytestmark = pytest.mark.integration

FAULTY_APP = r"""
import sys, time
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()
state = {"attempts": 0, "mode": "ok", "fail_first": 0}
DOC = {"document": {"id": "1", "contents": "\"Lima\"\nLima is the capital of Peru."}, "score": 1.5}

@app.post("/mode/{mode}/{fail_first}")
def set_mode(mode: str, fail_first: int):
    state.update(mode=mode, fail_first=fail_first, attempts=0)
    return state

@app.get("/attempts")
def attempts():
    return state

@app.post("/retrieve")
async def retrieve(request: Request):
    body = await request.json()
    state["attempts"] += 1
    if state["attempts"] <= state["fail_first"] or state["mode"] == "error":
        return JSONResponse({"error": "search_failed", "detail": "injected"}, status_code=500)
    if state["mode"] == "slow":
        time.sleep(1.0)
    if state["mode"] == "reject":
        return JSONResponse({"error": "blank_query", "detail": "injected"}, status_code=422)
    if state["mode"] == "short":
        return {"result": []}
    return {"result": [[DOC] for _ in body["queries"]]}

# bind port 0 here and hand the bound port to the parent: no pick-release-reuse race
import socket
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


@pytest.fixture(scope="module")
def faulty_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-c", FAULTY_APP], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # the port the server itself bound
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(url + "/attempts", timeout=10.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("faulty retrieval server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def set_mode(url: str, mode: str, fail_first: int = 0) -> None:
    httpx.post(f"{url}/mode/{mode}/{fail_first}", timeout=30).raise_for_status()


def attempts(url: str) -> int:
    return httpx.get(url + "/attempts", timeout=30).json()["attempts"]


# Few, quick retries, but a generous per-attempt timeout: these tests are not about timeouts
# and a loaded 2-core machine can take over 0.5 s to answer (the old value flaked).
FAST = RetrievalClientConfig(max_retries=2, backoff_initial_s=0.01, timeout_s=30.0)


def test_real_server_returns_passages_in_query_order(retrieval_server_url):
    with RetrievalClient(retrieval_server_url, RetrievalClientConfig(topk=2)) as client:
        result = client.retrieve(
            ["Lima capital of Peru Pizarro", "long narrow country western edge"]
        )
    assert [len(r) for r in result] == [2, 2]
    assert result[0][0].title == "Lima" and result[0][0].text.startswith(
        "Lima is the capital of Peru."
    )
    assert result[1][0].title == "Chile"
    assert result[0][0].score >= result[0][1].score
    assert client.stats.num_attempts == 1 and client.stats.num_failures == 0


def test_server_errors_are_retried_then_raise(faulty_url):
    set_mode(faulty_url, "error")
    client = RetrievalClient(faulty_url, FAST)
    with pytest.raises(RetrievalFailed) as info:
        client.retrieve(["q"])
    assert (info.value.attempts, info.value.reason) == (3, "http_500")  # 1 + max_retries
    assert attempts(faulty_url) == 3
    s = client.stats
    assert (s.num_requests, s.num_attempts, s.num_retries, s.num_failures) == (1, 3, 2, 1)


def test_transient_errors_recover_within_the_retry_budget(faulty_url):
    set_mode(faulty_url, "ok", fail_first=2)
    client = RetrievalClient(faulty_url, FAST)
    (passages,) = client.retrieve(["q"])
    assert [p.title for p in passages] == ["Lima"]
    assert (attempts(faulty_url), client.stats.num_retries, client.stats.num_failures) == (3, 2, 0)


def test_timeouts_are_retried_then_raise(faulty_url):
    set_mode(faulty_url, "slow")
    client = RetrievalClient(
        faulty_url, RetrievalClientConfig(max_retries=1, backoff_initial_s=0.01, timeout_s=0.2)
    )
    with pytest.raises(RetrievalFailed) as info:
        client.retrieve(["q"])
    assert (info.value.attempts, info.value.reason) == (2, "timeout")


def test_rejected_request_fails_without_retry(faulty_url):
    set_mode(faulty_url, "reject")
    client = RetrievalClient(faulty_url, FAST)
    with pytest.raises(RetrievalFailed) as info:
        client.retrieve(["q"])
    assert (info.value.attempts, info.value.reason, attempts(faulty_url)) == (1, "http_422", 1)


def test_result_count_mismatch_is_a_failure_not_an_empty_result(faulty_url):
    set_mode(faulty_url, "short")
    with pytest.raises(RetrievalFailed, match="0 result lists for 1 queries"):
        RetrievalClient(faulty_url, FAST).retrieve(["q"])


def test_unreachable_server_raises_connect():
    import socket

    with socket.socket() as held:  # bound, never listening: connections are refused, and
        held.bind(("127.0.0.1", 0))  # no other process can take the port meanwhile
        client = RetrievalClient(f"http://127.0.0.1:{held.getsockname()[1]}", FAST)
        with pytest.raises(RetrievalFailed) as info:
            client.retrieve(["q"])
    assert info.value.reason == "connect"


def test_blank_query_is_a_caller_error():
    client = RetrievalClient("http://127.0.0.1:1", FAST)
    with pytest.raises(ValueError, match="blank queries at positions \\[1\\]"):
        client.retrieve(["ok", "  "])


def test_rollout_marks_trajectories_when_the_server_keeps_failing(faulty_url, model_dir):
    """Real HF engine is not needed for the failure path: the scripted policy searches."""
    set_mode(faulty_url, "error")
    tok = AutoTokenizer.from_pretrained(model_dir)
    scripts = {
        "Q?": ["<search> capital of Peru </search>", "<answer>Lima</answer>"],
        "R?": ["<answer>x</answer>"],
    }
    recs = [
        {"id": "q", "question": "Q?", "golden_answers": ["Lima"], "data_source": "single_hop"},
        {"id": "r", "question": "R?", "golden_answers": ["x"], "data_source": "single_hop"},
    ]
    client = RetrievalClient(faulty_url, FAST)
    (failed, ok), stats = run_rollout(
        ScriptedEngine(tok, scripts), tok, client, recs, ["q", "r"], RolloutConfig()
    )
    assert (failed.retrieval_failed, failed.finish_reason, failed.reward) == (
        True,
        "retrieval_failed",
        0.0,
    )
    assert "<information>" not in tok.decode(failed.response_ids)
    assert (ok.retrieval_failed, ok.reward) == (False, 1.0)
    assert (stats.num_retrieval_failures, client.stats.num_attempts) == (1, 3)
