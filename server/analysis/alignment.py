"""Misaligned layers: matrix dimensions that are not a multiple of the tensor-core
alignment for the run's compute dtype (16 bytes: 8 elements for fp16/bf16, 16 for
fp8/int8, 4 for tf32; 64 elements is best), weighted by the layer's share of the
model's matmul FLOPs.

An embedding lookup is not a matmul: an Embedding's sizes matter only through a layer
that multiplies by the same weight (a tied LM head, `attrs["tied_to"]`), and that layer
reports them, once, as the vocabulary to pad."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.context import LayerInfo, LayerTable, compute_dtype
from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import MISSING, StepSeries

KIND = FindingKind.MISALIGNED_LAYER
OPTIMAL = 64
ALIGNMENT = {
    "float16": 8,
    "bfloat16": 8,
    "float8_e4m3fn": 16,
    "float8_e5m2": 16,
    "int8": 16,
}
TF32_ALIGNMENT = 4
# layer attrs that are GEMM dimensions (docs/wire-format.md); token_count: tokens per
# forward as seen at run time, when the agent reports it
DIMENSIONS = (
    "in_features",
    "out_features",
    "in_channels",
    "out_channels",
    "num_embeddings",
    "embedding_dim",
    "embed_dim",
    "head_dim",
    "token_count",
)
FIXES = {
    "num_embeddings": "pad the vocabulary (embedding rows) to {padded}; the extra rows are "
                      "never looked up",
    "token_count": "pad sequences so each forward sees {padded} tokens",
}
TIED_VOCAB_FIX = ("pad the vocabulary to {padded} (the weight is tied to {embedding!r}: pad "
                  "both; the extra rows are never looked up)")


def is_embedding(layer: LayerInfo) -> bool:
    return "Embedding" in layer.type


def token_counts(table: LayerTable) -> np.ndarray:
    """Per layer index, the GEMM rows of one forward: the layer's token count, else the
    most common one in the table (1 when none was seen)."""
    seen = [x.attrs["token_count"] for x in table.layers
            if isinstance(x.attrs.get("token_count"), int) and x.attrs["token_count"] > 0]
    default = max(set(seen), key=seen.count) if seen else 1
    out = np.full(table.size, float(default))
    for x in table.layers:
        count = x.attrs.get("token_count")
        if isinstance(count, int) and count > 0:
            out[x.index] = count
    return out


def matmul_flops(table: LayerTable) -> np.ndarray:
    """Per layer index, the multiply-adds of its matmuls in one forward, estimated from
    the layer table: in x out x tokens for Linear-like layers, weight elements x tokens
    for Conv and attention blocks (their spatial size is not known), 0 for embedding
    lookups and layers without a weight matrix."""
    tokens = token_counts(table)
    flops = np.zeros(table.size)
    for x in table.layers:
        attrs = x.attrs
        if is_embedding(x):
            continue
        if isinstance(attrs.get("in_features"), int) and isinstance(
                attrs.get("out_features"), int):
            flops[x.index] = attrs["in_features"] * attrs["out_features"] * tokens[x.index]
        elif any(isinstance(attrs.get(k), int) for k in ("in_channels", "embed_dim")):
            flops[x.index] = x.param_count * tokens[x.index]
    return flops


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tf32_enabled(environment: dict) -> bool:
    """Whether the environment says fp32 matmuls use TF32 tensor cores."""
    if any(environment.get(k) is True for k in ("tf32", "allow_tf32", "matmul_allow_tf32")):
        return True
    return environment.get("float32_matmul_precision") in ("high", "medium")


def alignment_for(dtype: str | None, environment: dict) -> int | None:
    """Elements per 16 bytes for the compute dtype; None where no tensor core applies
    (plain fp32) or the dtype is not known yet."""
    if dtype in ALIGNMENT:
        return ALIGNMENT[dtype]
    if dtype == "float32" and tf32_enabled(environment):
        return TF32_ALIGNMENT
    return None


def layer_dimensions(layer: LayerInfo) -> dict[str, int]:
    """The GEMM dimensions among the layer's attrs (attention head size derived when
    only embed_dim and num_heads are given)."""
    dims = {k: v for k in DIMENSIONS
            if isinstance(v := layer.attrs.get(k), int) and not isinstance(v, bool) and v > 0}
    heads = layer.attrs.get("num_heads")
    if "head_dim" not in dims and "embed_dim" in dims and isinstance(heads, int) and heads > 0:
        dims["head_dim"] = dims["embed_dim"] // heads
    return dims


def time_shares(series: StepSeries) -> np.ndarray | None:
    """Per layer, its share of measured forward time (None when nothing was timed)."""
    times = series.act_time
    if times is None or not times.size:
        return None
    timed = (times != MISSING) & np.isfinite(times)
    counts = timed.sum(axis=0)
    mean = np.divide(np.where(timed, times, 0).sum(axis=0), counts,
                     out=np.zeros(times.shape[1]), where=counts > 0)
    total = mean.sum()
    return mean / total if total > 0 else None


def _tied_embedding(layer: LayerInfo, table: LayerTable) -> str | None:
    """The embedding whose weight this layer multiplies by (a tied LM head), if any."""
    by_name = table.derived("by_name", lambda t: {x.name: x for x in t.layers})
    other = by_name.get(layer.attrs.get("tied_to"))
    if other is not None and is_embedding(other):
        return other.name
    for x in table.layers:  # the embedding came later in the table and names the head
        if x.attrs.get("tied_to") == layer.name and is_embedding(x):
            return x.name
    return None


def detect_misaligned_layers(window: Window, settings: AnalysisSettings) -> Detection:
    """One finding per misaligned (layer, dimension) of a layer that does matmuls, with
    the padded size to use; warning when the layer does `misaligned_warning_share` of the
    model's matmul FLOPs or more (its share of forward time goes in the evidence when
    measured). Aligned layers, embedding lookups and runs whose compute dtype is unknown
    or plain fp32 raise nothing."""
    series, run = window.series, window.run
    dtype = compute_dtype(series, run)
    multiple = alignment_for(dtype, run.environment)
    if multiple is None:
        return Detection()
    misaligned = run.table.derived(f"misaligned_dimensions:{multiple}", lambda table: [
        (layer, dim, value) for layer in table.layers if not is_embedding(layer)
        for dim, value in layer_dimensions(layer).items() if value % multiple])
    if not misaligned:
        return Detection(covers=(f"{KIND}:",))
    flops = run.table.derived("matmul_flops", matmul_flops)
    total = flops.sum()
    shares = time_shares(series)
    drafts = []
    for layer, dim, value in misaligned:
        padded = round_up(value, multiple)
        optimal = round_up(value, OPTIMAL)
        share = float(flops[layer.index] / total) if total else 0.0
        embedding = _tied_embedding(layer, run.table) if dim == "out_features" else None
        fix = (TIED_VOCAB_FIX.format(padded=padded, embedding=embedding) if embedding else
               FIXES.get(dim, "pad it to {padded}").format(padded=padded))
        if optimal != padded:
            fix += f" ({optimal}, a multiple of {OPTIMAL}, is best)"
        evidence = {"type": layer.type, "dimension": dim, "value": value,
                    "multiple": multiple, "padded": padded, "optimal": optimal,
                    "dtype": dtype, "param_count": layer.param_count,
                    "flops_share": round(share, 4)}
        if embedding:
            evidence["tied_embedding"] = embedding
        if shares is not None and layer.index < shares.size:
            # rounded so that evidence does not churn on every batch
            evidence["time_share"] = round(float(shares[layer.index]), 2)
        severity = "warning" if share >= settings.misaligned_warning_share else "info"
        drafts.append(FindingDraft(
            kind=KIND, key=f"{KIND}:{layer.name}:{dim}", severity=severity,
            message=(f"{layer.type} {layer.name!r} ({share:.1%} of the model's matmul "
                     f"FLOPs): {dim} = {value} is not a multiple of {multiple}, which "
                     f"{dtype} tensor cores need; {fix}."),
            layer=layer.name, evidence=evidence,
        ))
    return Detection(drafts=drafts, covers=(f"{KIND}:",))
