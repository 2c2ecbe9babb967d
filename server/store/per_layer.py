"""Per-layer vectors packed as float32, as a batch row stores them, without refusing a
value float32 cannot keep: it is stored as the nearest value float32 has, and said in an
event."""

from __future__ import annotations

import numpy as np

from ampwatch.server.errors import InvalidInput
from ampwatch.server.fields import missing_entries
from ampwatch.server.store.series import MISSING

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).smallest_subnormal)
# the event of a step whose per-layer values float32 could not keep (stored clamped)
FLOAT32_CLAMPED = "float32_clamped"


def per_layer_block(rows: list[list[float]], steps: list[int], name: str,
                     events: list[dict]) -> np.ndarray:
    """float32 matrix of validated per-layer vectors, a missing entry as MISSING. A value
    float32 cannot keep is stored as the nearest it can, never refusing the batch: beyond
    its range (a float64 model's 1e300) as its largest finite, so it stays a finite
    value; non-zero below its smallest subnormal as that subnormal, so it stays
    non-zero; each such step gets a `FLOAT32_CLAMPED` event in `events` naming the field,
    the layers and the values as sent. Refuses (InvalidInput) negatives, which norms,
    abs-maxes and times never are (so no sent value can be taken for MISSING, -1)."""
    wide = np.array(rows, dtype=np.float64)
    missing = missing_entries(wide)
    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(np.float32)
        negative = wide < 0
        overflow = np.isinf(narrow) & np.isfinite(wide)
        underflow = (narrow == 0) & (wide != 0) & ~missing
    if negative.any():
        row, layer = np.argwhere(negative)[0]
        raise InvalidInput(f"step {steps[row]}: {name}[{layer}] = {wide[row, layer]!r} is "
                           "negative: norms, abs-maxes and times never are")
    narrow[overflow] = _FLOAT32_MAX
    narrow[underflow] = _FLOAT32_TINY
    clamped = overflow | underflow
    for row in np.flatnonzero(clamped.any(axis=1)):
        layers = np.flatnonzero(clamped[row])
        events.append({"step": steps[row], "kind": FLOAT32_CLAMPED, "detail": {
            "field": name, "layers": layers.tolist(),
            "sent": [float(wide[row, layer]) for layer in layers]}})
    narrow[missing] = MISSING
    return narrow
