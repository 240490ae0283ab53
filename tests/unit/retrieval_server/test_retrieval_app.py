"""The FastAPI app in process (Starlette TestClient): Search-R1 contract, 4xx reasons for bad
input, health states and metrics. The real uvicorn process is covered in tests/integration."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from fixture_paths import FIXTURE_CORPUS

from retrieval_server.config import RetrievalServerConfig
from retrieval_server.passages import load_passages
from retrieval_server.retrievers import BM25Retriever
from retrieval_server.server import create_app, validation_reason


@pytest.fixture(scope="module")
def client() -> TestClient:
    config = RetrievalServerConfig(
        max_queries_per_request=4, max_query_chars=64, max_body_bytes=4096
    )
    app = create_app(config, BM25Retriever.build(load_passages(FIXTURE_CORPUS)))
    with TestClient(app) as test_client:
        yield test_client


def test_retrieve_with_scores_search_r1_shape(client: TestClient) -> None:
    response = client.post(
        "/retrieve",
        json={
            "queries": ["who discovered polonium", "capital of Peru"],
            "topk": 2,
            "return_scores": True,
        },
    )
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2 and [len(r) for r in result] == [2, 2]
    first = result[0][0]
    assert set(first) == {"document", "score"}
    assert first["document"]["id"] == "15"
    assert first["document"]["contents"].startswith('"Polonium"\nPolonium is a radioactive')
    assert first["score"] > result[0][1]["score"] > 0
    assert [r["document"]["id"] for r in result[1]] == ["0", "1"]


def test_retrieve_without_scores_and_default_topk(client: TestClient) -> None:
    response = client.post("/retrieve", json={"queries": ["capital of Peru"]})
    assert response.status_code == 200
    [docs] = response.json()["result"]
    assert [d["id"] for d in docs] == ["0", "1", "17"]  # default_topk = 3
    assert set(docs[0]) == {"id", "contents"}
    null_topk = client.post("/retrieve", json={"queries": ["capital of Peru"], "topk": None})
    assert null_topk.json() == response.json()
    float_topk = client.post("/retrieve", json={"queries": ["capital of Peru"], "topk": 3.0})
    assert float_topk.json() == response.json()  # 3.0 is an integer in JSON Schema


def test_stopword_only_query_gets_empty_list(client: TestClient) -> None:
    response = client.post("/retrieve", json={"queries": ["the of and", "Lima"], "topk": 1})
    assert [len(r) for r in response.json()["result"]] == [0, 1]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"queries": []}, "empty_queries"),
        ({"queries": [""]}, "blank_query"),
        ({"queries": ["   \n"]}, "blank_query"),
        ({"queries": ["a"], "topk": 0}, "topk_out_of_range"),
        ({"queries": ["a"], "topk": 101}, "topk_out_of_range"),
        ({"queries": ["a"] * 5}, "too_many_queries"),
        ({"queries": ["a" * 65]}, "query_too_long"),
        ({"queries": "capital of Peru"}, "wrong_type"),
        ({"queries": [3]}, "wrong_type"),
        ({"queries": ["a"], "topk": "3"}, "wrong_type"),
        ({"queries": ["a"], "topk": 2.5}, "wrong_type"),
        ({"queries": ["a"], "return_scores": "yes"}, "wrong_type"),
        ({"topk": 3}, "missing_field"),
        ({"queries": ["a"], "top_k": 3}, "unknown_field"),
        ([1, 2], "body_not_object"),
    ],
)
def test_bad_input_gets_422_with_reason(client: TestClient, body: object, reason: str) -> None:
    response = client.post("/retrieve", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == reason
    assert response.json()["detail"]


@pytest.mark.parametrize(
    ("content", "headers", "status", "reason"),
    [
        (b'{"queries": ["a"', {"content-type": "application/json"}, 422, "invalid_json"),
        (b"\xff\xfe", {"content-type": "application/json"}, 422, "invalid_json"),
        (b'{"queries": ["\xc3\x28"]}', {"content-type": "application/json"}, 400, "invalid_json"),
        (
            b"queries=a",
            {"content-type": "application/x-www-form-urlencoded"},
            422,
            "body_not_object",
        ),
        (b'{"queries": ["a"]}', {"content-type": "text/plain"}, 422, "body_not_object"),
        (b"", {"content-type": "application/json"}, 422, None),
        (
            b'{"queries": ["' + b"a" * 5000 + b'"]}',
            {"content-type": "application/json"},
            413,
            "body_too_large",
        ),
    ],
)
def test_non_json_bodies_get_4xx(
    client: TestClient, content: bytes, headers: dict, status: int, reason: str | None
) -> None:
    response = client.post("/retrieve", content=content, headers=headers)
    assert response.status_code == status, response.text
    if reason is not None:
        assert response.json()["error"] == reason
    # The server keeps serving afterwards.
    assert client.post("/retrieve", json={"queries": ["Lima"]}).status_code == 200


def test_metrics_count_requests_errors_and_batches(client: TestClient) -> None:
    client.post("/retrieve", json={"queries": ["a"], "topk": 0})
    client.post("/retrieve", json={"queries": ["Lima", "Paris", "Tokyo"], "topk": 1})
    text = client.get("/metrics").text
    samples = _samples(text)
    assert samples['stppo_retrieval_errors_total{reason="topk_out_of_range"}'] >= 1
    assert samples['stppo_retrieval_requests_total{endpoint="/retrieve",status="200"}'] >= 1
    assert (
        samples['stppo_retrieval_queries_per_request_bucket{le="2.0"}']
        < samples['stppo_retrieval_queries_per_request_bucket{le="4.0"}']
    )  # the 3-query batch lands in (2, 4]
    assert samples["stppo_retrieval_index_passages"] == 36
    assert samples["stppo_retrieval_ready"] == 1
    assert samples["stppo_retrieval_request_latency_seconds_count"] >= 2


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_openapi_documents_the_contract(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    request_schema = spec["components"]["schemas"]["RetrieveRequest"]
    queries = request_schema["properties"]["queries"]
    assert (queries["minItems"], queries["maxItems"]) == (1, 4)
    assert queries["items"]["maxLength"] == 64
    assert "Search-R1" in spec["paths"]["/retrieve"]["post"]["summary"]
    assert {"413", "422", "503"} <= set(spec["paths"]["/retrieve"]["post"]["responses"])


def test_health_reports_failed_load_and_retrieve_is_503(tmp_path: Path) -> None:
    config = RetrievalServerConfig(corpus_path=FIXTURE_CORPUS, index_dir=tmp_path / "none")
    with TestClient(create_app(config)) as test_client:
        app_state = test_client.app.state.retrieval
        for _ in range(500):  # the background load fails within milliseconds
            if app_state.failure:
                break
            time.sleep(0.01)
        health = test_client.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        assert "no bm25 index" in health.json()["detail"]
        response = test_client.post("/retrieve", json={"queries": ["Lima"]})
        assert response.status_code == 503 and response.json()["error"] == "not_ready"


def test_health_loading_then_ok(tmp_path: Path) -> None:
    config = RetrievalServerConfig(
        corpus_path=FIXTURE_CORPUS, index_dir=tmp_path, build_missing_index=True
    )
    app = create_app(config)
    state = app.state.retrieval
    with TestClient(app) as test_client:  # startup builds the missing index, then loads it
        assert state.loaded.wait(30)
        assert test_client.get("/healthz").json() == {
            "status": "ok",
            "method": "bm25",
            "num_passages": 36,
            "detail": "",
        }


def test_health_is_loading_before_the_index_is_there() -> None:
    app = create_app(RetrievalServerConfig())
    state = app.state.retrieval
    client = TestClient(app)  # no context manager: lifespan (the loader) never starts
    response = client.get("/healthz")
    assert response.status_code == 503 and response.json()["status"] == "loading"
    assert not state.loaded.is_set()


def test_validation_reason_mapping() -> None:
    assert validation_reason({"type": "too_long", "loc": ("body", "queries")}) == "too_many_queries"
    assert (
        validation_reason({"type": "string_too_long", "loc": ("body", "queries", 3)})
        == "query_too_long"
    )
    assert validation_reason({"type": "int_type", "loc": ("body", "topk")}) == "wrong_type"
    assert json.dumps(validation_reason({})) == '"wrong_type"'
