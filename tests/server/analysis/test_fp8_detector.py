"""FP8 detectors on recorded series: delayed scaling (Transformer Engine's default, which
needs a GPU to run) is judged here on the statistics such a run records."""

from __future__ import annotations

import numpy as np

from ampwatch.server.analysis.fp8 import detect_fp8
from ampwatch.server.store.fp8_samples import ROLES, STATS, Fp8Window
from tests.server.analysis.factories import SETTINGS, context, fp8_window, linear

E4M3_MAX = 448.0
DELAYED = {"fp8_recipe": "delayed (amax history 16)", "fp8_input_format": "e4m3",
           "fp8_weight_format": "e4m3", "fp8_grad_format": "e5m2"}


def window(steps: list[int], n_layers: int = 2) -> Fp8Window:
    """Healthy samples: amax 4, scale covering it with a margin, nothing lost."""
    m = len(steps)
    values = np.zeros((m, len(ROLES), len(STATS), n_layers), dtype=np.float32)
    values[:, :, STATS.index("amax")] = 4.0
    values[:, :, STATS.index("scale")] = E4M3_MAX / 8.0
    values[:, :, STATS.index("rms")] = 1.0
    return Fp8Window(np.array(steps, dtype=np.int64), values,
                     np.ones((m, len(ROLES), n_layers), dtype=bool))


def run(n_layers: int = 2):
    return context([linear(i, **DELAYED) for i in range(n_layers)])


def set_stat(w: Fp8Window, rows, layer: int, role: str, name: str, values) -> None:
    w.values[rows, ROLES.index(role), STATS.index(name), layer] = values


def drafts(w: Fp8Window):
    return {(d.kind, d.layer, d.step, d.severity, d.evidence["tensor"], d.active)
            for d in detect_fp8(fp8_window(w, run(w.values.shape[-1])), SETTINGS).drafts}


def test_healthy_delayed_scaling_raises_nothing_and_covers_every_tensor():
    w = window(list(range(0, 100, 10)))
    detection = detect_fp8(fp8_window(w, run()), SETTINGS)
    assert detection.drafts == []
    assert detection.covered("fp8_saturation:fc1:grad")
    assert detection.covered("fp8_underflow:fc0:input")


def test_a_growing_tensor_outgrows_its_delayed_scale_then_saturates():
    w = window(list(range(0, 100, 10)))
    # fc1's input grows from step 50; the scale (from the amax history) lags behind
    growth = [4.0, 6.0, 9.0, 14.0, 20.0]
    set_stat(w, slice(5, 10), 1, "input", "amax", growth)
    set_stat(w, slice(5, 10), 1, "input", "scale", [E4M3_MAX / 8.0, E4M3_MAX / 8.0,
                                                    E4M3_MAX / 8.0, E4M3_MAX / 9.0,
                                                    E4M3_MAX / 14.0])
    set_stat(w, slice(5, 10), 1, "input", "saturated", [0.0, 0.0, 0.0004, 0.004, 0.003])
    found = drafts(w)
    # amax over what the scale covers (8, 8, 8, 9, 14): 0.5, 0.75, 1.125, 1.56, 1.43
    assert found == {
        ("fp8_stale_scale", "fc1", 80, "info", "input", True),
        ("fp8_saturation", "fc1", 80, "warning", "input", True),
    }


def test_saturation_that_stopped_is_resolved_but_kept_in_history():
    w = window(list(range(0, 100, 10)))
    set_stat(w, [3], 0, "grad", "saturated", 0.02)
    assert drafts(w) == {("fp8_saturation", "fc0", 30, "warning", "grad", False)}


def test_underflow_threshold_and_outlier_ratio():
    w = window(list(range(0, 50, 10)))
    set_stat(w, slice(2, 5), 0, "weight", "underflow", [0.005, 0.3, 0.4])
    set_stat(w, slice(2, 5), 0, "weight", "amax", 1e5)  # an outlier, covered by its scale
    set_stat(w, slice(2, 5), 0, "weight", "scale", E4M3_MAX / 1e5)
    detection = detect_fp8(fp8_window(w, run()), SETTINGS)
    (draft,) = detection.drafts
    assert (draft.kind, draft.layer, draft.step, draft.severity) == (
        "fp8_underflow", "fc0", 30, "warning")
    assert draft.evidence["underflow_share"] == np.float32(0.4)
    assert draft.evidence["outlier_ratio"] == 1e5
    assert "40.0%" in draft.message and "weight" in draft.message
    assert not detection.covered("fp8_underflow:fc0:weight")


def test_absent_tensors_are_neither_judged_nor_covered():
    w = window([0, 10])
    w.present[:, ROLES.index("grad"), 1] = False
    set_stat(w, slice(0, 2), 1, "grad", "underflow", 0.9)  # not measured: ignored
    detection = detect_fp8(fp8_window(w, run()), SETTINGS)
    assert detection.drafts == []
    assert not detection.covered("fp8_underflow:fc1:grad")
