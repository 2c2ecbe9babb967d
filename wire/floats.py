"""The wire encoding of floats, non-finite ones included.

Standard JSON has no NaN or infinity, so API v1 sends them as the strings "NaN",
"Infinity" and "-Infinity" (docs/wire-format.md). `null` always means missing.
This module imports nothing beyond the standard library and numpy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


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


def encode_float_array(values: np.ndarray, missing: np.ndarray | None = None) -> list:
    """A 1-D or 2-D float array as nested JSON lists (server/store/codec.py's `encode_array` packs
    binary columns instead); `missing` marks entries sent as null.

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
