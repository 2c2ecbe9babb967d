"""What the agent, the server and the client must agree on: the run id pattern, the
limits of run labels, and the wire encoding of non-finite floats.

Standard JSON has no NaN or infinity, so API v1 sends them as the strings "NaN",
"Infinity" and "-Infinity" (docs/wire-format.md). `null` always means missing.
This module imports nothing beyond the standard library and numpy.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

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


def encode_float(x: float | None) -> float | str | None:
    """A float as API v1 JSON: itself when finite, else its string name."""
    if x is None or math.isfinite(x):
        return x
    if math.isnan(x):
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def decode_float(x: float | int | str | None) -> float | None:
    """Inverse of `encode_float`; raises ValueError for any other string."""
    if x is None:
        return None
    if isinstance(x, str):
        try:
            return NONFINITE_STRINGS[x]
        except KeyError:
            raise ValueError(f"not a number: {x!r}") from None
    return float(x)


def encode_tree(obj: Any) -> Any:
    """Replace every non-finite float inside dicts, lists and tuples by its string name."""
    if isinstance(obj, float):
        return encode_float(obj)
    if isinstance(obj, dict):
        return {k: encode_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_tree(v) for v in obj]
    if isinstance(obj, np.generic):
        return encode_tree(obj.item())
    return obj


def decode_tree(obj: Any) -> Any:
    """Inverse of `encode_tree`: the three special strings become floats again."""
    if isinstance(obj, str) and obj in NONFINITE_STRINGS:
        return NONFINITE_STRINGS[obj]
    if isinstance(obj, dict):
        return {k: decode_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tree(v) for v in obj]
    return obj


def encode_array(values: np.ndarray, missing: np.ndarray | None = None) -> list:
    """A 1-D or 2-D float array as nested JSON lists; `missing` marks entries sent as null.

    Fast when everything is finite (one `tolist`), element-wise otherwise.
    """
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    if missing is None and finite.all():
        return values.tolist()
    out = values.astype(object)
    out[np.isnan(values)] = "NaN"
    out[np.isposinf(values)] = "Infinity"
    out[np.isneginf(values)] = "-Infinity"
    if missing is not None:
        out[missing] = None
    return out.tolist()
