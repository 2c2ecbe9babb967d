"""JSON responses in wire form: non-finite floats as "NaN", "Infinity", "-Infinity".

Rendered with orjson, which writes float32 arrays in their shortest form and embeds
pre-rendered fragments; it would turn a NaN float into null, so content is encoded
with `encode_tree` first unless the caller says it already is (the bulk queries).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
from fastapi.responses import JSONResponse

from ampwatch.wire import encode_float_array, encode_tree


class WireJSONResponse(JSONResponse):
    """Compact JSON of `content`; pass `encoded=True` when every float in it is finite
    or already a string (server/services/series.py builds its answers that way)."""

    def __init__(self, content: Any, status_code: int = 200, *, encoded: bool = False,
                 **kwargs: Any) -> None:
        self.encoded = encoded
        super().__init__(content, status_code, **kwargs)

    def render(self, content: Any) -> bytes:
        if not getattr(self, "encoded", False):
            content = encode_tree(content)
        try:
            return orjson.dumps(content, default=_fragment, option=orjson.OPT_SERIALIZE_NUMPY)
        except orjson.JSONEncodeError:
            # integers beyond 64 bits (a user's run config may hold one): stdlib json
            return json.dumps(content, ensure_ascii=False, allow_nan=False, default=_lists,
                              separators=(",", ":")).encode()


class FloatRows:
    """A float matrix as JSON rows in wire form, rendered only when a response is
    written (`WireJSONResponse`): a page that draws the matrix reads `matrix` and
    `missing` (server/pages/columns.py) and never pays for its JSON (about 20 ms for a
    1,000 x 1,000 heatmap, and as long again to parse it back)."""

    def __init__(self, matrix: np.ndarray, missing: np.ndarray) -> None:
        self.matrix = matrix
        self.missing = missing

    def fragment(self) -> orjson.Fragment:
        """The rows as one JSON array; rows that are all finite and present (the usual
        case) go straight from numpy to bytes."""
        rows = []
        for values, absent in zip(self.matrix, self.missing, strict=True):
            if not absent.any() and np.isfinite(values).all():
                rows.append(orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY))
            else:
                rows.append(orjson.dumps(encode_float_array(values, missing=absent)))
        return orjson.Fragment(b"[" + b",".join(rows) + b"]")

    def lists(self) -> list:
        return encode_float_array(self.matrix, missing=self.missing)


def _fragment(value: Any) -> orjson.Fragment:
    if isinstance(value, FloatRows):
        return value.fragment()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _lists(value: Any) -> list:
    if isinstance(value, FloatRows):
        return value.lists()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
