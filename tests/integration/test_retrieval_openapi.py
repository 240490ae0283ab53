"""Property test of the served OpenAPI spec (schemathesis): schema-valid (positive) and
schema-invalid (negative) requests against the real server must never get a 5xx, and every
answer must match the documented status codes, content type and response schemas.

Bounded to 30 examples per operation and mode so it runs in seconds. Drives hypothesis with
schemathesis strategies directly: ``schemathesis.pytest.from_fixture`` fails under pytest 9
(``'Function' object has no attribute '_nodeid'``).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from retrieval_server.launcher import RunningServer

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_openapi_property(retrieval_server: RunningServer, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(retrieval_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert labels == ["GET /healthz", "GET /metrics", "POST /retrieve"]
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method != "post":
            continue  # GETs take no input: nothing to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=30,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=retrieval_server.url, timeout=10)

        check()
