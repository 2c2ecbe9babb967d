"""Every API route answers with the model its OpenAPI schema declares: the body validates
against it and holds no key it does not declare (routes that build JSON by hand for
speed, such as the series routes, are held to their `response_model` here)."""

from __future__ import annotations

import importlib
import pkgutil
import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel

from ampwatch import server
from tests.utils import make_steps, post_batch, register_run

N_LAYERS = 4
# query strings that reach each route's other code paths (downsampled, other metrics)
VARIANTS = {
    "/api/v1/runs/{run_id}/steps": [{}, {"max_points": 10}, {"rank": 0}],
    "/api/v1/runs/{run_id}/layers/matrix": [{}, {"metric": "act_absmax"}, {"buckets": 10}],
    "/api/v1/runs/{run_id}/layers/{index}/series": [{}, {"max_points": 10}],
    "/api/v1/runs/{run_id}/grad_norms": [{}, {"layers": True}],
}


def _schema_classes() -> dict[str, type[BaseModel]]:
    """The server's pydantic models by class name (OpenAPI names components so)."""
    found: dict[str, type[BaseModel]] = {}
    for info in pkgutil.walk_packages(server.__path__, f"{server.__name__}."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) \
                    and value.__module__.startswith(server.__name__):
                found[value.__name__] = value
    return found


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (directly, in a list or dict, or optionally)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            if (model := _model_in(arg)) is not None:
                return model
    return None


def undeclared(model: type[BaseModel], data: Any, where: str) -> list[str]:
    """Keys of `data` (recursively) that `model` does not declare."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    names = {field.alias or name for name, field in fields.items()}
    found = [f"{where}.{key}" for key in data if key not in names]
    for name, field in fields.items():
        inner, value = _model_in(field.annotation), data.get(field.alias or name)
        if inner is None or value is None:
            continue
        items = value if isinstance(value, list) else \
            list(value.values()) if isinstance(value, dict) and inner is not model and \
            not set(value) <= set(inner.model_fields) else [value]
        for i, item in enumerate(items):
            found += undeclared(inner, item, f"{where}.{name}[{i}]")
    return found


def check(model: type[BaseModel], response, what: str) -> None:
    assert response.status_code in (200, 201), (what, response.status_code, response.text)
    body = response.json()
    model.model_validate(body)
    assert undeclared(model, body, model.__name__) == [], what


def _declared(openapi: dict) -> list[tuple[str, str, str]]:
    """(method, path, component name) of every route's 2xx JSON answer."""
    routes = []
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            for code, answer in operation.get("responses", {}).items():
                schema = answer.get("content", {}).get("application/json", {}).get("schema")
                if code.startswith("2") and schema and "$ref" in schema:
                    routes.append((method, path, schema["$ref"].rsplit("/", 1)[-1]))
    return routes


@pytest.fixture
def run_with_data(api) -> str:
    """A run with two ranks' steps, sampled activations, skipped (non-finite) steps and so
    findings."""
    registered = register_run(api, "declared", N_LAYERS,
                              environment={"world_size": 2, "autocast_dtype": "float16"})
    assert registered["id"] == "declared"
    for rank in (0, 1):
        for seq, first in enumerate(range(0, 120, 40)):
            steps = make_steps(first, 40, N_LAYERS, skipped=set(range(60, 70)),
                               sample_every=5)
            assert post_batch(api, "declared", seq, steps, rank=rank).status_code == 200
    return "declared"


def test_every_route_returns_its_declared_model(api, run_with_data):
    classes = _schema_classes()
    routes = _declared(api.get("/openapi.json").json())
    assert len(routes) >= 15, routes
    checked = 0
    for method, path, component in routes:
        model = classes[component]
        url = (path.replace("{run_id}", run_with_data).replace("{index}", "1")
               .replace("{project}", "tests"))
        if "{notification_id}" in path:
            deliveries = api.get("/api/v1/alerts/deliveries").json()["items"]
            if not deliveries:
                continue  # no alert rule here: no delivery to read
            url = url.replace("{notification_id}", str(deliveries[0]["id"]))
        if method == "get":
            for params in VARIANTS.get(path, [{}]):
                check(model, api.get(url, params=params), f"GET {path} {params}")
                checked += 1
        elif method == "put" and "/bundles/" in path:
            continue  # a bundle file from real training: tests/server/test_bundles.py
        elif method == "put":
            body = {"name": run_with_data, "project": "tests"}
            check(model, api.put(url, json=body), f"PUT {path}")
            checked += 1
        elif method == "post" and path.endswith("/batches"):
            steps = make_steps(120, 5, N_LAYERS, sample_every=5)
            check(model, api.post(url, json={"rank": 0, "seq": 3, "steps": steps}),
                  f"POST {path}")
            checked += 1
    assert checked >= 20
