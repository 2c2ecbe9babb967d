"""Domain errors raised by services; `app.py` maps each to one HTTP status."""

from __future__ import annotations


class AmpwatchServerError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(AmpwatchServerError):
    status_code = 404


class InvalidInput(AmpwatchServerError):
    """Well-formed JSON that contradicts stored state (e.g. vector lengths)."""

    status_code = 422


class TooMany(AmpwatchServerError):
    """A write past a per-run count limit (notes, bundles): nothing stored."""

    status_code = 413


class Conflict(AmpwatchServerError):
    """A valid request that stored state or the configuration cannot serve."""

    status_code = 409


class Busy(AmpwatchServerError):
    """The server is at a budget (reads in flight): retry in `retry_after` seconds."""

    status_code = 503
    retry_after = 1


class SeqConflict(Conflict):
    """A (run, rank, seq) already used by a batch with other steps."""


MAX_REPORTED_ERRORS = 10
MAX_MESSAGE_CHARS = 300


def short_errors(errors: list[dict]) -> list[dict]:
    """Validation errors as `loc`, `msg`, `type`: never the input (it can be a 1 MB string
    or a whole body), at most MAX_REPORTED_ERRORS of them, each message cut short."""
    short = [{"loc": [str(p)[:100] if isinstance(p, str) else p for p in e.get("loc", ())],
              "msg": str(e.get("msg", ""))[:MAX_MESSAGE_CHARS],
              "type": str(e.get("type", "value_error"))[:64]}
             for e in errors[:MAX_REPORTED_ERRORS]]
    if len(errors) > MAX_REPORTED_ERRORS:
        short.append({"loc": [], "msg": f"and {len(errors) - MAX_REPORTED_ERRORS} more errors",
                      "type": "value_error"})
    return short
