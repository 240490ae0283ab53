"""The real retrieval server: ``python -m retrieval_server`` under uvicorn in a subprocess on a
free loopback port, queried over HTTP."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import httpx
import pytest

from retrieval_server.launcher import RunningServer

pytestmark = pytest.mark.integration

POLONIUM = "who discovered polonium"  # fixture passage "15" ranks first for every method


def _metric(url: str, sample: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_healthz_and_search_r1_retrieve(retrieval_server_url: str) -> None:
    health = httpx.get(retrieval_server_url + "/healthz")
    assert health.status_code == 200
    assert health.json()["num_passages"] == 36
    response = httpx.post(
        retrieval_server_url + "/retrieve",
        json={"queries": [POLONIUM, "capital of Peru"], "topk": 3, "return_scores": True},
    )
    assert response.status_code == 200
    result = response.json()["result"]
    assert result[0][0]["document"]["id"] == "15"
    assert [hit["document"]["id"] for hit in result[1]] == ["0", "1", "17"]
    plain = httpx.post(retrieval_server_url + "/retrieve", json={"queries": [POLONIUM], "topk": 1})
    assert plain.json()["result"][0][0]["id"] == "15"


def test_bad_inputs_get_4xx_and_server_keeps_serving(retrieval_server_url: str) -> None:
    url = retrieval_server_url + "/retrieve"
    before = _metric(retrieval_server_url, 'stppo_retrieval_errors_total{reason="blank_query"}')
    bad = [
        httpx.post(url, json={"queries": []}),
        httpx.post(url, json={"queries": [""]}),
        httpx.post(url, json={"queries": ["a"], "topk": 1000}),
        httpx.post(url, json={"queries": ["a"] * 257}),
        httpx.post(url, json={"queries": ["a" * 4097]}),
        httpx.post(url, json={"queries": [None]}),
        httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(url, content=b"x" * 9_000_000, headers={"content-type": "application/json"}),
    ]
    assert [r.status_code for r in bad] == [422] * 7 + [413]
    assert [r.json()["error"] for r in bad] == [
        "empty_queries", "blank_query", "topk_out_of_range", "too_many_queries",
        "query_too_long", "wrong_type", "invalid_json", "body_too_large",
    ]  # fmt: skip
    after = _metric(retrieval_server_url, 'stppo_retrieval_errors_total{reason="blank_query"}')
    assert after == before + 1
    assert httpx.post(url, json={"queries": [POLONIUM], "topk": 1}).status_code == 200


def test_concurrent_clients_get_their_own_answers(retrieval_server_url: str) -> None:
    queries = {"who discovered polonium": "15", "capital of Peru": "0", "Narita airport": "18"}

    async def one(client: httpx.AsyncClient, query: str) -> str:
        response = await client.post("/retrieve", json={"queries": [query], "topk": 1})
        response.raise_for_status()
        return response.json()["result"][0][0]["id"]

    async def many() -> list[str]:
        async with httpx.AsyncClient(base_url=retrieval_server_url, timeout=30) as client:
            return await asyncio.gather(*(one(client, q) for q in list(queries) * 20))

    assert asyncio.run(many()) == list(queries.values()) * 20


def test_server_on_a_given_corpus(retrieval_server_factory: Callable[..., str], tmp_path) -> None:
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text(
        '{"id": "x1", "contents": "\\"Zebra\\"\\nZebras are striped."}\n'
        '{"id": "x2", "contents": "\\"Okapi\\"\\nThe okapi is related to the giraffe."}\n'
    )
    url = retrieval_server_factory(corpus, max_queries_per_request=2)
    assert httpx.get(url + "/healthz").json()["num_passages"] == 2
    response = httpx.post(url + "/retrieve", json={"queries": ["giraffe relative"], "topk": 5})
    assert [d["id"] for d in response.json()["result"][0]] == ["x2"]
    too_many = httpx.post(url + "/retrieve", json={"queries": ["a", "b", "c"]})
    assert too_many.json()["error"] == "too_many_queries"


def test_two_workers_share_the_port_and_sum_metrics(
    retrieval_server_factory: Callable[..., str],
) -> None:
    url = retrieval_server_factory(workers=2)
    with httpx.Client(base_url=url) as client:
        for _ in range(10):  # new connections, so both workers may take requests
            assert httpx.post(url + "/retrieve", json={"queries": [POLONIUM]}).status_code == 200
        text = client.get("/metrics").text
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('stppo_retrieval_requests_total{endpoint="/retrieve",status="200"}')
    )
    assert total == 10


def test_hybrid_server_end_to_end(retrieval_server_factory: Callable[..., str]) -> None:
    """Dense + BM25 fused over HTTP (builds the MiniLM index of 36 passages first)."""
    url = retrieval_server_factory(method="hybrid")
    response = httpx.post(
        url + "/retrieve",
        json={
            "queries": [POLONIUM, "tallest peak on the planet"],
            "topk": 3,
            "return_scores": True,
        },
        timeout=30,
    )
    result = response.json()["result"]
    assert result[0][0]["document"]["id"] == "15"
    assert result[0][0]["score"] == pytest.approx(2 / 61, rel=1e-6)  # first in both rankings
    assert "10" in [hit["document"]["id"] for hit in result[1]]  # Everest, found by dense


def test_stop_server_terminates_the_child(tmp_path) -> None:
    from fixture_paths import FIXTURE_CORPUS

    from retrieval_server.config import RetrievalServerConfig
    from retrieval_server.launcher import start_server, stop_server

    server: RunningServer = start_server(
        RetrievalServerConfig(corpus_path=FIXTURE_CORPUS, index_dir=tmp_path / "i", port=0),
        tmp_path / "log.txt",
    )
    # uvicorn shuts down gracefully, then re-raises SIGTERM (exit status -15).
    assert stop_server(server) in (0, -signal.SIGTERM)
    assert "Finished server process" in server.log_tail()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/healthz", timeout=2)
