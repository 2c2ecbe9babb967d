"""Where a non-finite step went wrong: input, forward pass, loss or gradients, and which
layer first. Vectorised over the whole window; used by the nonfinite and scaler detectors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.context import LayerTable, RunContext, step_rows
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.store.series import FIELD_INDEX, MISSING, StepSeries

# Causes in the order they explain each other: a bad input makes the forward pass
# non-finite, which makes the loss non-finite, which makes every gradient non-finite.
# a step's cause, stored as its index here
CAUSES = (Cause.NONFINITE_INPUT, Cause.FORWARD_OVERFLOW, Cause.NONFINITE_LOSS,
          Cause.GRAD_OVERFLOW, Cause.UNKNOWN)
INPUT, FORWARD, LOSS, GRAD, UNKNOWN = range(len(CAUSES))
NO_LAYER = -1


@dataclass
class Localization:
    """Per step of the series (arrays of length n).

    nonfinite: the step shows inf/NaN anywhere (input, outputs, loss, grads).
    cause: index into CAUSES (meaningful where `nonfinite` or skipped).
    forward_layer: first layer in forward execution order whose output was non-finite
        at that step (the agent's per-step flag; for steps without it, the activation
        sample when there is one), else NO_LAYER.
    forward_observed: the step's layer outputs were checked (flag or sample), so a
        NO_LAYER there means every output was finite.
    grad_layer: the layer whose grads went non-finite first, i.e. the last in forward
        order among those with non-finite grads (backward runs in reverse), else NO_LAYER;
        layers sharing a tied parameter decide only when no other layer's grads are bad.
    grad_bad: (n, L) which layers had non-finite grads, or None without per-layer grads.
    """

    nonfinite: np.ndarray
    cause: np.ndarray
    forward_layer: np.ndarray
    grad_layer: np.ndarray
    forward_observed: np.ndarray
    grad_nonfinite: np.ndarray
    loss_nonfinite: np.ndarray
    input_nonfinite: np.ndarray
    grad_bad: np.ndarray | None


def _nonfinite_scalar(series: StepSeries, name: str) -> np.ndarray:
    i = FIELD_INDEX[name]
    return series.present[:, i] & ~np.isfinite(series.scalars[:, i])


def localize(series: StepSeries, run: RunContext) -> Localization:
    """Classify every step of `series`; cost O(n * L) numpy work, no Python loop."""
    n, n_layers = len(series), series.n_layers
    position = run.forward_position(n_layers)
    i_input = FIELD_INDEX["input_nonfinite"]
    input_bad = series.present[:, i_input] & (series.scalars[:, i_input] != 0)
    loss_bad = _nonfinite_scalar(series, "loss")
    norm_bad = _nonfinite_scalar(series, "grad_norm")

    forward_layer = np.full(n, NO_LAYER, dtype=np.int64)
    flagged = series.has("forward_nonfinite")
    forward_observed = flagged.copy()
    if series.act_absmax is not None and len(series.act_step) and n_layers:
        # older agents: only sampled steps say which layer went non-finite
        rows = step_rows(series, series.act_step)
        sampled = (rows >= 0) & (series.act_absmax != MISSING).any(axis=1)
        forward_observed[rows[sampled]] = True
        act_bad = ~np.isfinite(series.act_absmax) & sampled[:, None]
        sampled_bad = act_bad.any(axis=1)
        if sampled_bad.any():
            ranked = np.where(act_bad[sampled_bad], position, np.iinfo(np.int64).max)
            forward_layer[rows[sampled_bad]] = ranked.argmin(axis=1)
    i_first = FIELD_INDEX["first_nonfinite_layer"]
    named = series.present[:, i_first]
    forward_layer[flagged] = NO_LAYER  # the per-step flag is exact: it wins
    first = series.scalars[named, i_first].astype(np.int64)
    forward_layer[named] = np.where(first < n_layers, first, NO_LAYER)

    grad_layer = np.full(n, NO_LAYER, dtype=np.int64)
    grad_bad = None
    if series.layer_grad is not None and n_layers:
        grad_bad = ~np.isfinite(series.layer_grad)
        any_bad = grad_bad.any(axis=1)
        if any_bad.any():
            # a tied parameter's grad is accumulated from all its uses, the last at the end
            # of backward: it is evidence, never the verdict, unless nothing else is bad
            tied = tied_layers(run.table, n_layers)
            untied_bad = grad_bad[any_bad] & ~tied
            deciding = np.where(untied_bad.any(axis=1)[:, None], untied_bad,
                                grad_bad[any_bad])
            ranked = np.where(deciding, position, -1)
            grad_layer[any_bad] = ranked.argmax(axis=1)

    cause = np.full(n, UNKNOWN, dtype=np.int64)
    cause[(grad_layer != NO_LAYER) | norm_bad] = GRAD
    cause[loss_bad] = LOSS
    cause[forward_layer != NO_LAYER] = FORWARD
    cause[input_bad] = INPUT
    grad_nonfinite = norm_bad | (grad_layer != NO_LAYER)
    nonfinite = input_bad | loss_bad | grad_nonfinite | (forward_layer != NO_LAYER)
    return Localization(nonfinite=nonfinite, cause=cause, forward_layer=forward_layer,
                        grad_layer=grad_layer, forward_observed=forward_observed,
                        grad_nonfinite=grad_nonfinite, loss_nonfinite=loss_bad,
                        input_nonfinite=input_bad, grad_bad=grad_bad)


def tied_layers(table: LayerTable, n_layers: int) -> np.ndarray:
    """Per layer, whether it holds a parameter another layer holds too (a tied LM head,
    `attrs["tied_to"]`, and the layer it is tied to)."""
    tied_to = {x.attrs.get("tied_to") for x in table.layers} - {None}
    return table.mask(lambda x: bool(x.attrs.get("tied_to")) or x.name in tied_to, n_layers)


def offending_layer(loc: Localization, rows: np.ndarray, cause: int) -> int:
    """The layer named most often as the offender of `cause` on `rows` (NO_LAYER if none)."""
    if cause == FORWARD:
        layers = loc.forward_layer[rows]
    elif cause == GRAD:
        layers = loc.grad_layer[rows]
    else:
        return NO_LAYER
    layers = layers[layers != NO_LAYER]
    return int(np.bincount(layers).argmax()) if layers.size else NO_LAYER


def explain(loc: Localization, rows: np.ndarray, run: RunContext) -> dict:
    """Why the steps at `rows` (typically skipped ones) went wrong, as evidence:
    the dominant cause, its offending layer and the count of each cause."""
    causes = loc.cause[rows]
    counts = Counter(CAUSES[c] for c in causes.tolist())
    known = causes[causes != UNKNOWN]
    if not known.size:
        return {"cause": None, "layer": None, "causes": dict(counts)}
    dominant = int(np.bincount(known, minlength=len(CAUSES)).argmax())
    layer = offending_layer(loc, rows[causes == dominant], dominant)
    return {
        "cause": CAUSES[dominant],
        "layer": None if layer == NO_LAYER else run.layer_name(layer),
        "causes": dict(counts),
    }


# how runs name their dtypes in words, and the largest finite value of each
DTYPE_WORDS = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
               "float8_e4m3fn": "fp8 e4m3", "float8_e5m2": "fp8 e5m2"}
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
             "float32": 3.4028234663852886e38, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def dtype_word(dtype: str | None) -> str:
    """"fp16" for "float16"; a run that never said which dtype it computes in is taken
    for fp16, the one whose range a layer outgrows."""
    return DTYPE_WORDS.get(dtype or "float16", dtype or "fp16")


def diverged_before(series: StepSeries, row: int, dtype: str | None,
                    settings: AnalysisSettings) -> dict | None:
    """Whether training diverged before row `row` (a first non-finite step): its last
    finite grad norms grew `divergence_growth` times past the typical (median) grad norm
    of the window's first half of steps before it, while no sampled activation came
    within `overflow_factor` of the dtype's maximum (an activation that outgrows its
    dtype is a range problem, whatever the gradients did). Evidence, or None."""
    i = FIELD_INDEX["grad_norm"]
    norms = series.scalars[:row, i][series.present[:row, i]]
    norms = norms[np.isfinite(norms) & (norms > 0)]
    if norms.size < 3:
        return None
    typical = float(np.median(norms[: norms.size // 2 + 1]))
    peak = float(norms[-3:].max())
    if peak < settings.divergence_growth * typical:
        return None
    if series.act_absmax is not None and len(series.act_step):
        before = series.act_step < series.steps[row]
        sampled = series.act_absmax[before]
        sampled = sampled[(sampled != MISSING) & np.isfinite(sampled)]
        limit = DTYPE_MAX.get(dtype or "float16", DTYPE_MAX["float16"])
        if sampled.size and float(sampled.max()) >= limit / settings.overflow_factor:
            return None
    return {"grad_norm_typical": typical, "grad_norm_peak": peak,
            "growth": peak / typical}


def fix_for_cause(cause: str | None, layer: str | None, dtype: str | None = None) -> str:
    """The remedy sentence for a divergence or non-finite cause, in the words of the
    run's compute `dtype` (fp16 when unknown)."""
    where = f"layer {layer!r}" if layer else "a layer"
    word = dtype_word(dtype)
    if cause == Cause.DIVERGENCE:
        return ("training diverged (the gradients exploded before any value overflowed): "
                "lower the learning rate, add warmup, and clip gradients "
                "(torch.nn.utils.clip_grad_norm_, after scaler.unscale_() with a GradScaler)")
    if cause in (Cause.FORWARD_OVERFLOW, Cause.ABSORBED_OVERFLOW):
        if dtype not in (None, "float16"):  # fp32's range: only a diverging run gets there
            return (f"{where} overflows {word} in the forward pass, whose range is fp32's: "
                    "its values ran away, lower the learning rate, add warmup, and clip "
                    "gradients")
        return (f"{where} overflows fp16 in the forward pass, which no loss scale can fix: "
                "run it in fp32 (torch.autocast(device_type, enabled=False) with a .float() "
                "input), scale its output down, or train in bf16")
    if cause == Cause.GRAD_OVERFLOW:
        return (f"gradients of {where} are non-finite even after unscaling: lower the "
                "learning rate or add warmup, clip gradients after scaler.unscale_(), and "
                "check that layer for exploding weights")
    if cause == Cause.NONFINITE_LOSS:
        return ("the loss itself is inf/NaN: compute it in fp32 outside autocast "
                "(loss_fn(logits.float(), target)) and use stable forms such as "
                "F.cross_entropy or log-sum-exp instead of exp/log")
    if cause == Cause.NONFINITE_INPUT:
        return ("the input batch holds inf/NaN: validate the data (torch.isfinite) before "
                "the forward pass and fix the loader")
    if dtype not in (None, "float16"):
        return ("look for the first layer whose output goes inf/NaN (enable activation "
                "sampling); with a range like fp32's, lower the learning rate, add warmup, "
                "and clip gradients")
    return ("look for the layer that overflows fp16 (enable activation sampling) and keep "
            "it in fp32, or lower the learning rate")
