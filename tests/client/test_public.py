"""The client's public surface: `__all__` is complete, importable and documented."""

from __future__ import annotations

import inspect

import httpx
import pytest

from ampwatch import client
from ampwatch.client import (
    AmpwatchError,
    BadRequest,
    ConnectionFailed,
    NotFound,
    ServerError,
    Unauthorized,
)
from ampwatch.client.errors import error_for_response


def test_all_names_every_public_name() -> None:
    public = {name for name, value in vars(client).items()
              if not name.startswith("_") and not inspect.ismodule(value)}
    assert public == set(client.__all__)
    assert len(client.__all__) == len(set(client.__all__))


@pytest.mark.parametrize("name", client.__all__)
def test_every_public_name_is_documented(name: str) -> None:
    value = getattr(client, name)
    if inspect.isclass(value):
        assert inspect.getdoc(value), f"{name} has no docstring"
        own = {k: v for k, v in vars(value).items()
               if not k.startswith("_") and inspect.isfunction(v)}
        for method, function in own.items():
            assert inspect.getdoc(function), f"{name}.{method} has no docstring"
    else:
        assert name == "DEFAULT_SERVER" and value.startswith("http://")


def test_the_exception_tree() -> None:
    for error in (NotFound, Unauthorized, BadRequest, ServerError, ConnectionFailed):
        assert issubclass(error, AmpwatchError)
    assert issubclass(AmpwatchError, Exception)


@pytest.mark.parametrize("status, body, kind, message", [
    (404, {"detail": "no run with id 'x'"}, NotFound, "404 Not Found: no run with id 'x'"),
    (401, {"detail": "missing or wrong token"}, Unauthorized, "missing or wrong token"),
    (403, {"detail": "forbidden"}, Unauthorized, "forbidden"),
    (413, {"detail": "request body over the limit"}, BadRequest, "over the limit"),
    (422, {"detail": [{"loc": ["query", "status"], "msg": "Input should be 'healthy'"}]},
     BadRequest, "query.status: Input should be 'healthy'"),
    (500, None, ServerError, "Internal Server Error: boom"),
    (503, {"detail": "database unavailable"}, ServerError, "database unavailable"),
])
def test_one_function_maps_status_to_exception(status, body, kind, message) -> None:
    response = (httpx.Response(status, json=body) if body is not None
                else httpx.Response(status, text="boom"))
    error = error_for_response(response)
    assert type(error) is kind
    assert error.status_code == status
    assert message in error.message and message in str(error)
