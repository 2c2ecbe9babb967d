"""Runs on the wire: the run id pattern, the limits of run labels, and the server address
the agent and the client use when told none."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

DEFAULT_SERVER = "http://127.0.0.1:8000"

# A run id is a URL path segment and a spool directory name: no '/', no leading '.', ASCII.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
RUN_ID_RULE = ("1 to 128 characters: ASCII letters, digits, '.', '_' and '-', "
               "starting with a letter or a digit")
LABEL_MAX_CHARS = 256  # a run's name, project and each tag
# control characters (NUL above all: Postgres text cannot hold it) are refused in labels
LABEL_PATTERN = r"^[^\x00-\x1f\x7f]*$"
_RUN_ID = re.compile(RUN_ID_PATTERN)
_LABEL = re.compile(LABEL_PATTERN)


def check_run_id(run_id: object) -> str:
    """`run_id` itself when API v1 accepts it, else ValueError naming the allowed characters."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        shown = repr(run_id) if len(repr(run_id)) <= 80 else f"{repr(run_id)[:76]}...'"
        raise ValueError(f"invalid run id {shown}: a run id is {RUN_ID_RULE}")
    return run_id


def check_label(value: object, what: str) -> str:
    """A run's name, project or tag as API v1 accepts it (1 to 256 characters, no control
    characters); else ValueError saying which `what` and why."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, not {type(value).__name__}")
    if not 1 <= len(value) <= LABEL_MAX_CHARS:
        raise ValueError(f"{what} must have 1 to {LABEL_MAX_CHARS} characters, "
                         f"not {len(value)}")
    if not _LABEL.fullmatch(value):
        raise ValueError(f"{what} {value[:80]!r} holds a control character "
                         "(NUL, newline, ...)")
    return value


def url_problem(url: str) -> str | None:
    """What makes `url` unusable as the server's base URL ("has no http:// or https://"),
    None when it is usable. Syntax only: no network."""
    if any(c.isspace() for c in url):
        return "contains whitespace"
    if "://" not in url:
        return "has no http:// or https://"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port out of range or not a number, a bad IPv6 address
        return f"cannot be read ({exc})"
    if parts.scheme.lower() not in ("http", "https"):
        return f"has the unsupported scheme {parts.scheme + '://'!r}: use http:// or https://"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "has port 0"
    if parts.query or parts.fragment:
        return "has a query or fragment (a base URL has neither)"
    return None
