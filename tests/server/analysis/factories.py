"""Hand-made step series for detector tests, built through the real storage packing
(wire-form step dicts -> `StepIn` -> packed batch row -> `StepSeries`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from ampwatch.server.analysis import AnalysisSettings, RunContext
from ampwatch.server.analysis.context import LayerInfo
from ampwatch.server.analysis.window import Window
from ampwatch.server.schemas.batches import StepIn
from ampwatch.server.store.fp8_samples import Fp8Window
from ampwatch.server.store.series import StepSeries, concat
from ampwatch.server.store.storage import new_batch_row, unpack_row

INF = math.inf
NAN = math.nan
SETTINGS = AnalysisSettings()


def linear(index: int, name: str | None = None, in_features: int = 64, out_features: int = 64,
           forward_index: int | None = None, **attrs: Any) -> LayerInfo:
    return LayerInfo(index=index, name=name or f"fc{index}", type="Linear",
                     param_count=in_features * out_features + out_features,
                     attrs={"in_features": in_features, "out_features": out_features, **attrs},
                     forward_index=index if forward_index is None else forward_index)


def context(layers: int | Iterable[LayerInfo] = 4, environment: dict | None = None,
            first_step: int | None = 0, rank: int = 0) -> RunContext:
    """A run with `layers` (a count of 64x64 Linears, or the layers themselves)."""
    if isinstance(layers, int):
        layers = [linear(i) for i in range(layers)]
    env = {"autocast_dtype": "float16", "device": "cuda:0", "compute_capability": "9.0"}
    return RunContext.build(layers, {**env, **(environment or {})}, rank, first_step)


def step(s: int, n_layers: int = 4, **fields: Any) -> dict[str, Any]:
    """A healthy fp16 step with a scaler at 65536; `fields` override or add (None
    removes a field)."""
    base: dict[str, Any] = {
        "step": s, "loss_scale": 65536.0, "scale_after": 65536.0, "skipped": False,
        "grad_norm": 1.0, "loss": 2.0, "lr": 1e-3, "autocast_dtype": "float16",
        "layer_grad_norm": [0.1] * n_layers,
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


def scaler_steps(n: int, *, overflow: Iterable[int] = (), fits: float | None = None,
                 init_scale: float = 65536.0, growth_interval: int = 2000, first: int = 0,
                 n_layers: int = 4, grad_layer: int = 0, **fields: Any) -> list[dict[str, Any]]:
    """Steps of a simulated GradScaler (halve and skip on overflow, double after
    `growth_interval` clean steps). A step overflows when it is in `overflow`, or when
    the scale exceeds `fits` (the largest scale the gradients tolerate); its grads are
    inf in layer `grad_layer`."""
    overflow = set(overflow)
    scale, clean, steps = init_scale, 0, []
    for s in range(first, first + n):
        bad = s in overflow or (fits is not None and scale > fits)
        after = scale
        if bad:
            after, clean = scale * 0.5, 0
        else:
            clean += 1
            if clean == growth_interval:
                after, clean = scale * 2.0, 0
        grads = [0.1] * n_layers
        if bad:
            grads[grad_layer] = INF
        steps.append(step(s, n_layers, loss_scale=scale, scale_after=after, skipped=bad,
                          grad_norm=INF if bad else 1.0, layer_grad_norm=grads, **fields))
        scale = after
    return steps


def activations(absmax: list[float | None], dtype: str | list | None = "float16",
                time_ms: list[float | None] | None = None) -> dict[str, Any]:
    n = len(absmax)
    dtypes = [dtype] * n if isinstance(dtype, str | None) else dtype
    return {"absmax": absmax, "dtype": dtypes, "time_ms": time_ms or [0.1] * n}


def series(steps: list[dict[str, Any]], n_layers: int = 4, events: list[dict] = (),
           batch: int = 100) -> StepSeries:
    """Pack `steps` in batches of `batch` the way ingest stores them and read them back."""
    parts = []
    for i in range(0, max(len(steps), 1), batch):
        chunk = [StepIn.model_validate(s) for s in steps[i:i + batch]]
        row = new_batch_row("run", 0, i, chunk, n_layers, list(events) if i == 0 else [])
        parts.append(unpack_row(SimpleNamespace(**row), n_layers, True, True))
    return concat(parts, n_layers)


def drafts_by_key(detection) -> dict[str, Any]:
    return {d.key: d for d in detection.drafts}


def fp8_window(samples: Fp8Window, run: RunContext) -> Window:
    """A detector's window holding only FP8 samples."""
    return Window(StepSeries.empty(samples.values.shape[-1]), run, fp8=samples)
