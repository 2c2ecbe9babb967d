"""The client's exception tree, and the one function that maps an HTTP response to it."""

from __future__ import annotations

import httpx


class AmpwatchError(Exception):
    """Base of every error the client raises; `message` is the server's `detail`
    (or what went wrong on the way to the server), `status_code` the HTTP status
    (None when no response came back)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code


class NotFound(AmpwatchError):
    """404: no such run, layer or route."""


class Unauthorized(AmpwatchError):
    """401/403: the server wants a token (AMPWATCH_TOKEN) and got none or a wrong one."""


class BadRequest(AmpwatchError):
    """4xx other than 401/403/404: the server refused the request as invalid."""


class ServerError(AmpwatchError):
    """5xx, or a response that is not the JSON the API promises."""


class ConnectionFailed(AmpwatchError):
    """No response: the server is down, unreachable, or too slow (timeout)."""


class AnalysisPending(AmpwatchError, TimeoutError):
    """`wait_for_analysis` ran out of time: the server has not judged `pending` stored
    batches of the run yet, so its findings are not all in (no analysis worker running?).
    Also a TimeoutError."""

    def __init__(self, message: str, pending: int) -> None:
        super().__init__(message)
        self.pending = pending


def error_for_response(response: httpx.Response) -> AmpwatchError:
    """The exception for a non-2xx response, carrying the server's `detail` message."""
    status = response.status_code
    if status == 404:
        kind: type[AmpwatchError] = NotFound
    elif status in (401, 403):
        kind = Unauthorized
    elif 400 <= status < 500:
        kind = BadRequest
    else:
        kind = ServerError
    return kind(f"{status} {response.reason_phrase}: {_detail(response)}", status)


def _detail(response: httpx.Response) -> str:
    """FastAPI's `detail`: a string, or a list of validation errors (422)."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str) and detail:
        return detail
    if isinstance(detail, list) and detail:
        return "; ".join(_validation_error(e) for e in detail)
    return response.text.strip()[:200] or "no detail"


def _validation_error(error: object) -> str:
    if not isinstance(error, dict):
        return str(error)
    location = ".".join(str(part) for part in error.get("loc", ()))
    message = error.get("msg", "invalid")
    return f"{location}: {message}" if location else str(message)
