"""Precision map: the dtype each layer actually computed in. Flags matmul layers that ran
in fp32 under active autocast (no tensor-core speedup) and precision-sensitive layers
(norms, softmax, losses) that ran in fp16.

A sensitive layer is judged by what its reductions computed in (the layer table's
`reduces_in`, probed by the agent): a norm that upcasts inside and casts back returns
fp16 but is not flagged, one that returns fp32 after taking its variance in fp16 is. A
layer the agent did not probe (an older agent) is judged by its output dtype."""

from __future__ import annotations

import re

import numpy as np

from ampwatch.server.analysis.context import (
    BF16,
    FP16,
    MIXED,
    LayerInfo,
    LayerTable,
    autocast_codes,
    step_rows,
)
from ampwatch.server.analysis.draft import Detection, FindingDraft, recent_steps
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import DTYPE_CODE, DTYPES

KIND = FindingKind.PRECISION_MAP
FP32 = DTYPE_CODE["float32"]
MATMUL_TYPE = re.compile(
    r"^(Lazy)?(Linear|Bilinear|Conv\d?[dD]?|ConvTranspose\dd|MultiheadAttention|LSTM|GRU|RNN"
    r"|NonDynamicallyQuantizableLinear)$"
)
# BatchNorm keeps fp32 statistics inside cuDNN whatever its output dtype: not flagged
SENSITIVE_TYPE = re.compile(r"(Norm\w*|Softmax|Softmin|Loss)$")
EXEMPT_TYPE = re.compile(r"^(Sync)?BatchNorm")


def layer_role(layer: LayerInfo) -> str | None:
    """"fp32_matmul" for matmul-class layers, "fp16_sensitive" for norm/softmax/loss-like
    ones, None for the rest: the problem each kind of layer can have."""
    if MATMUL_TYPE.match(layer.type):
        return "fp32_matmul"
    if SENSITIVE_TYPE.search(layer.type) and not EXEMPT_TYPE.match(layer.type):
        return "fp16_sensitive"
    return None


def _message(problem: str, layer_type: str, name: str, step: int, autocast: str) -> str:
    if problem == "fp32_matmul":
        return (f"{layer_type} {name!r} computed in float32 under {autocast} autocast "
                f"(step {step}), so it gets no tensor-core speedup: remove the "
                "autocast(enabled=False) region or .float() cast around it, unless it needs "
                "fp32 on purpose.")
    return (f"{layer_type} {name!r} computed in float16 (step {step}), where norms, softmax "
            "and losses lose precision or overflow: run it in fp32 (autocast(enabled=False) "
            "with a .float() input), as torch's built-in layers do under autocast.")


def _layer_roles(table: LayerTable, n_layers: int) -> tuple:
    """Per table: each layer's role, the matmul and sensitive masks over n_layers, the
    dtype code each layer's reductions computed in (0: not probed), and the finding key
    each judged layer covers (computed once per table, not per batch)."""
    roles = {x.index: layer_role(x) for x in table.layers}
    matmul = table.mask(lambda x: roles[x.index] == "fp32_matmul", n_layers)
    sensitive = table.mask(lambda x: roles[x.index] == "fp16_sensitive", n_layers)
    reduces_in = np.zeros(n_layers, dtype=np.uint8)
    for x in table.layers:
        if x.index < n_layers:
            reduces_in[x.index] = DTYPE_CODE.get(x.attrs.get("reduces_in"), 0)
    cover_keys = np.full(n_layers, "", dtype=object)
    for x in table.layers:
        if x.index < n_layers and roles[x.index]:
            cover_keys[x.index] = f"{KIND}:{x.name}:{roles[x.index]}"
    return roles, matmul, sensitive, reduces_in, cover_keys


def detect_precision_map(window: Window, settings: AnalysisSettings) -> Detection:
    """Judge each layer's sampled compute dtypes in the window; a layer whose latest
    sample is fine again resolves its finding. Vectorised over samples and layers."""
    series, run = window.series, window.run
    if series.act_dtype is None or not len(series.act_step):
        return Detection()
    dtypes = series.act_dtype
    n_layers = dtypes.shape[1]
    rows = step_rows(series, series.act_step)
    codes = np.where(rows >= 0, autocast_codes(series)[rows.clip(0)], 0)
    under_autocast = (codes == FP16) | (codes == BF16) | (codes == MIXED)  # np.isin, cheaper
    autocast_name = (DTYPES[int(np.bincount(codes[under_autocast]).argmax())]
                     if under_autocast.any() else "")
    roles, matmul, sensitive, reduces_in, cover_keys = run.table.derived(
        f"precision_layers:{n_layers}", lambda table: _layer_roles(table, n_layers))
    judged = (dtypes != 0) & ((under_autocast[:, None] & matmul) | sensitive)
    computed = np.where(reduces_in != 0, reduces_in, dtypes)  # a probed layer: its reductions
    bad = judged & np.where(matmul, dtypes == FP32, computed == FP16)
    ever_bad = bad.any(axis=0)
    drafts = []
    covers = tuple(cover_keys[judged.any(axis=0) & ~ever_bad])
    for index in np.flatnonzero(ever_bad):
        layer = run.layer(int(index))
        problem = roles[layer.index]
        hits = bad[:, index]
        steps = series.act_step[hits]
        last_judged = np.flatnonzero(judged[:, index])[-1]
        drafts.append(FindingDraft(
            kind=KIND, key=f"{KIND}:{layer.name}:{problem}", code=problem,
            severity="info" if problem == "fp32_matmul" else "warning",
            message=_message(problem, layer.type, layer.name, int(steps[0]), autocast_name),
            step=int(steps[0]), last_step=int(steps[-1]), layer=layer.name,
            evidence={"type": layer.type,
                      "computed_in": "float32" if problem == "fp32_matmul" else "float16",
                      "autocast_dtype": autocast_name or None,
                      "steps": recent_steps(steps, settings.evidence_steps)},
            occurrences=steps, active=bool(hits[last_judged]),
        ))
    return Detection(drafts=drafts, covers=covers)
