"""The error boundary around every hook body and worker job: nothing raises into training.

An exception inside the agent is logged once per site, counted, and reported to the
server as an ``agent_error`` event. Tests install a handler (``set_error_handler``) that
collects what the boundary swallowed and fails the test with it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("ampwatch.agent")

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_handler: Callable[[str, BaseException], None] | None = None
_listeners: list[Callable[[str, BaseException], None]] = []


def error_counts() -> dict[str, int]:
    """Swallowed errors so far, per site."""
    with _lock:
        return dict(_counts)


def set_error_handler(handler: Callable[[str, BaseException], None] | None) -> None:
    """Install a callable that also receives every swallowed exception (tests use it)."""
    global _handler
    _handler = handler


def add_listener(listener: Callable[[str, BaseException], None]) -> None:
    """Called on the first error of each site (an attachment turns it into an event)."""
    _listeners.append(listener)


def remove_listener(listener: Callable[[str, BaseException], None]) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def report(site: str, exc: BaseException) -> None:
    """Record an exception swallowed at `site`; never raises."""
    try:
        with _lock:
            _counts[site] += 1
            first = _counts[site] == 1
        if first:
            # an exception made to report a condition (never raised) needs no traceback
            logger.warning("ampwatch agent error in %s: %s (further ones are counted)", site,
                           exc, exc_info=exc if exc.__traceback__ is not None else None)
            for listener in list(_listeners):
                listener(site, exc)
        if _handler is not None:
            _handler(site, exc)
    except Exception:  # noqa: BLE001 - the boundary itself must never raise
        pass


def guarded(site: str, default: Any = None) -> Callable[[F], F]:
    """Decorator: run the function, swallow and report any exception, return `default`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                report(site, exc)
                return default

        return inner  # type: ignore[return-value]

    return wrap
