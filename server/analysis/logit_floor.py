"""The smallest logit that matters to the dtype it is computed in: where a precursor (a
layer's largest attention logit, or the output log-partition, grown over its trained
level) is a numerical risk rather than a model that learned sharper attention or more
confident outputs.

A logit x held in a dtype with machine epsilon eps is off by up to half an ulp,
|x|·eps/2, and the softmax turns an error d on a logit into a factor exp(d) on its
weight. A logit matters once that error reaches `precursor_logit_error` nats:
|x| >= 2·precursor_logit_error/eps (0.25 nats, weights off by up to 1.28x: 64 in
bfloat16, 512 in float16, about 4·10^6 in float32). In float16 an attention logit also
matters once the product q·k before its 1/sqrt(head_dim) scaling nears the dtype's
largest value: |x|·sqrt(head_dim) >= fp16_max / overflow_factor.

The dtype is the one the logits are computed from: the layer table's `logits_in` (the
agent's record of the dtype q and k meet in, autocast's where it is on, or the output
layer's logits), else the run's autocast dtype, else float32 (a run without autocast).
"""

from __future__ import annotations

import math

from ampwatch.server.analysis.context import LayerInfo, RunContext
from ampwatch.server.analysis.settings import AnalysisSettings

# machine epsilon (the gap from 1 to the next value) of the dtypes logits are computed in
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def logits_dtype(layer: LayerInfo | None, run_dtype: str | None) -> str:
    """The dtype a layer's logits are computed in: the agent's `logits_in`, else the
    run's autocast dtype, else float32."""
    recorded = None if layer is None else layer.attrs.get("logits_in")
    for name in (recorded, run_dtype):
        if name in EPS:
            return name
    return "float32"


def logit_floor(dtype: str, settings: AnalysisSettings, head_dim: int | None = None) -> float:
    """The smallest |logit| that matters in `dtype` (module docstring); `head_dim`: an
    attention layer's, for the float16 bound on q·k before scaling."""
    floor = 2 * settings.precursor_logit_error / EPS.get(dtype, EPS["float32"])
    if dtype == "float16" and head_dim:
        floor = min(floor, settings.fp16_max / settings.overflow_factor / math.sqrt(head_dim))
    return floor


def layer_logit_floor(run: RunContext, layer: int, signal: str, run_dtype: str | None,
                      settings: AnalysisSettings) -> tuple[str, float]:
    """(dtype, floor) of one layer's logit signal (`attn_max_logit`: with the layer's
    head_dim; `logit_lse`, `logit_absmax`: the output's)."""
    info = run.layer(layer)
    dtype = logits_dtype(info, run_dtype)
    head_dim = info.attrs.get("head_dim") if info is not None and signal == "attn_max_logit" \
        else None
    return dtype, logit_floor(dtype, settings, head_dim if isinstance(head_dim, int) else None)
