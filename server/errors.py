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


class SeqConflict(AmpwatchServerError):
    """A (run, rank, seq) already used by a batch with other steps."""

    status_code = 409
