"""Messages for the person running the training script, that must not go unseen: the
server's URL is malformed, the server cannot be reached or refuses the token, delivery
recovered.

Each is one message, logged once through the `ampwatch.agent` logger at WARNING; when
no handler of that logger's chain shows it on stderr (pytest's capture, a log file only,
or handlers only above WARNING), the same text is also printed to stderr. A script
without any logging setup gets it once, from Python's last-resort handler. Setting the
`ampwatch` logger's level above WARNING silences both.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("ampwatch.agent")


def tell(message: str) -> None:
    """Log `message` at WARNING and make sure it reaches stderr once. Never raises."""
    try:
        if not logger.isEnabledFor(logging.WARNING):
            return  # the user silenced ampwatch's warnings
        logger.warning(message)
        if not _shown_on_stderr(logger):
            print(message, file=sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stderr must not reach training
        pass


def _shown_on_stderr(start: logging.Logger) -> bool:
    """Whether a WARNING of `start` is written to stderr by some handler of its chain
    (or, with no handler at all, by logging's last resort)."""
    found = False
    current: logging.Logger | None = start
    while current is not None:
        for handler in current.handlers:
            found = True
            if handler.level <= logging.WARNING and isinstance(
                    handler, logging.StreamHandler) and _is_stderr(handler.stream):
                return True
        if not current.propagate:
            break
        current = current.parent
    resort = logging.lastResort
    return not found and resort is not None and resort.level <= logging.WARNING


def _is_stderr(stream: Any) -> bool:
    if stream is sys.stderr or stream is sys.__stderr__:
        return True
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # StringIO, a closed file
        return False
