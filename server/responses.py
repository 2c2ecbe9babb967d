"""JSON responses in wire form: non-finite floats as "NaN", "Infinity", "-Infinity"."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from client.wire import encode_tree


class WireJSONResponse(JSONResponse):
    """Compact JSON; content that still holds a non-finite float is encoded first."""

    def render(self, content: Any) -> bytes:
        try:
            text = json.dumps(content, ensure_ascii=False, allow_nan=False,
                              separators=(",", ":"))
        except ValueError:
            text = json.dumps(encode_tree(content), ensure_ascii=False, allow_nan=False,
                              separators=(",", ":"))
        return text.encode("utf-8")
