"""Every API operation has a short, stable operation id (`get_run`, `list_findings`): a
client generated from the OpenAPI schema (openapi-python-client, openapi-generator) names
its methods after them."""

from __future__ import annotations

import re

SHORT_ID = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+){0,3}")
MAX_LENGTH = 24
# the ids clients already call: renaming one breaks every generated client
PINNED = {
    ("get", "/api/v1/runs/{run_id}"): "get_run",
    ("get", "/api/v1/runs"): "list_runs",
    ("put", "/api/v1/runs/{run_id}"): "register_run",
    ("post", "/api/v1/runs/{run_id}/batches"): "send_batch",
    ("get", "/api/v1/runs/{run_id}/findings"): "list_findings",
    ("get", "/api/v1/runs/{run_id}/incidents"): "list_incidents",
    ("get", "/api/v1/findings"): "list_all_findings",
    ("get", "/api/v1/runs/{run_id}/steps"): "list_steps",
    ("get", "/api/v1/health"): "get_health",
}


def test_every_operation_id_is_set_unique_and_short(app) -> None:
    operations = {(method, path): operation["operationId"]
                  for path, methods in app.openapi()["paths"].items()
                  for method, operation in methods.items()}
    assert len(operations) > 20  # the whole API, not one router
    long_or_odd = {key: op for key, op in operations.items()
                   if not SHORT_ID.fullmatch(op) or len(op) > MAX_LENGTH}
    assert long_or_odd == {}, "give these routes an operation_id= (or a shorter name)"
    assert len(set(operations.values())) == len(operations), "operation ids repeat"
    assert {key: operations.get(key) for key in PINNED} == PINNED
