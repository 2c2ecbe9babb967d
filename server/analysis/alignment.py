"""Misaligned layers: matrix dimensions that are not a multiple of the tensor-core
alignment for the run's compute dtype (16 bytes: 8 elements for fp16/bf16, 16 for
fp8/int8, 4 for tf32; 64 elements is best)."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.context import LayerInfo, RunContext, compute_dtype
from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.series import MISSING, StepSeries

KIND = "misaligned_layer"
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


def detect_misaligned_layers(series: StepSeries, run: RunContext,
                             settings: AnalysisSettings) -> Detection:
    """One finding per misaligned (layer, dimension), with the padded size to use and the
    layer's share of parameters (and of forward time, when measured). Aligned layers and
    runs whose compute dtype is unknown or plain fp32 raise nothing."""
    dtype = compute_dtype(series, run)
    multiple = alignment_for(dtype, run.environment)
    if multiple is None:
        return Detection()
    misaligned = run.table.derived(f"misaligned_dimensions:{multiple}", lambda table: [
        (layer, dim, value) for layer in table.layers
        for dim, value in layer_dimensions(layer).items() if value % multiple])
    if not misaligned:
        return Detection(covers=(f"{KIND}:",))
    total = run.total_params
    shares = time_shares(series)
    drafts = []
    for layer, dim, value in misaligned:
        padded = round_up(value, multiple)
        optimal = round_up(value, OPTIMAL)
        share = layer.param_count / total if total else 0.0
        fix = FIXES.get(dim, "pad it to {padded}").format(padded=padded)
        if optimal != padded:
            fix += f" ({optimal}, a multiple of {OPTIMAL}, is best)"
        evidence = {"type": layer.type, "dimension": dim, "value": value,
                    "multiple": multiple, "padded": padded, "optimal": optimal,
                    "dtype": dtype, "param_count": layer.param_count,
                    "param_share": round(share, 4)}
        if shares is not None and layer.index < shares.size:
            # rounded so that evidence does not churn on every batch
            evidence["time_share"] = round(float(shares[layer.index]), 2)
        severity = "warning" if share >= settings.misaligned_warning_share else "info"
        drafts.append(FindingDraft(
            kind=KIND, key=f"{KIND}:{layer.name}:{dim}", severity=severity,
            message=(f"{layer.type} {layer.name!r} ({share:.1%} of the parameters): "
                     f"{dim} = {value} is not a multiple of {multiple}, which {dtype} "
                     f"tensor cores need; {fix}."),
            layer=layer.name, evidence=evidence,
        ))
    return Detection(drafts=drafts, covers=(f"{KIND}:",))
