"""The per-step scalars a tracker gets under `ampwatch/` (agent/mirror, `ampwatch export
--to`), from a step record: the wire record the agent decodes, or one the client rebuilt
from the API (non-finite floats as floats or their string names)."""

from __future__ import annotations

import math
from typing import Any

from ampwatch.wire.floats import decode_float

PREFIX = "ampwatch/"
# the largest finite value of each low-precision output dtype: headroom is this over abs-max
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}


def _number(value: Any) -> float | None:
    return None if value is None or isinstance(value, list) else decode_float(value)


def _largest(vector: list | None) -> float | None:
    """The largest entry of a wire vector (a non-finite one wins), None if none."""
    values = [v for v in (_number(x) for x in vector or []) if v is not None]
    if not values:
        return None
    nonfinite = [v for v in values if not math.isfinite(v)]
    return nonfinite[0] if nonfinite else max(values)


def overflow_headroom(activations: dict | None) -> float | None:
    """The smallest dtype max / output abs-max over the layers whose output was fp16 or
    bf16 on this sampled step (0 for a non-finite output); None when none was."""
    if not activations:
        return None
    smallest = None
    for value, dtype in zip(activations.get("absmax") or [], activations.get("dtype") or [],
                            strict=False):
        peak, limit = _number(value), DTYPE_MAX.get(dtype or "")
        if peak is None or limit is None:
            continue
        headroom = 0.0 if not math.isfinite(peak) else (math.inf if peak == 0 else limit / peak)
        smallest = headroom if smallest is None else min(smallest, headroom)
    return smallest


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """`ampwatch/...` name -> value for one step; a signal the step did not measure is
    left out. `nonfinite` is 1 when the step's loss, gradient norm, inputs or forward
    outputs held a NaN or infinity."""
    out: dict[str, float] = {}
    scale = _number(record.get("loss_scale"))
    if scale is not None:
        out["loss_scale"] = scale
    if record.get("skipped") is not None:
        out["skipped"] = float(bool(record["skipped"]))
    grad_norm = _number(record.get("grad_norm"))
    if grad_norm is not None:
        out["grad_norm"] = grad_norm
    out["nonfinite"] = float(bool(
        record.get("forward_nonfinite") or record.get("input_nonfinite")
        or any(v is not None and not math.isfinite(v)
               for v in (grad_norm, _number(record.get("loss"))))))
    headroom = overflow_headroom(record.get("activations"))
    if headroom is not None:
        out["overflow_headroom_min"] = headroom
    spikes = record.get("spikes") or {}
    for name, key in (("attn_max_logit", "attn_max_logit"), ("logit_lse", "logit_lse")):
        largest = _largest(spikes.get(key))
        if largest is not None:
            out[f"{name}_max"] = largest
    return {PREFIX + name: value for name, value in out.items()}
