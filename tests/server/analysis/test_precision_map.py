"""Precision map: fp32 matmuls under autocast, precision-sensitive layers in fp16."""

from __future__ import annotations

from ampwatch.server.analysis.context import LayerInfo
from ampwatch.server.analysis.precision import detect_precision_map
from ampwatch.server.analysis.window import Window
from tests.server.analysis.factories import (
    SETTINGS,
    activations,
    context,
    drafts_by_key,
    linear,
    series,
    step,
)

LAYERS = [
    linear(0, "fc"),
    LayerInfo(1, "ln", "LayerNorm", 128, {}, 1),
    LayerInfo(2, "rms", "RMSNorm", 64, {}, 2),
    LayerInfo(3, "bn", "BatchNorm2d", 128, {}, 3),
    LayerInfo(4, "conv", "Conv2d", 9 * 64 * 64, {"in_channels": 64, "out_channels": 64}, 4),
]


def detect(dtypes_per_sample, autocast="float16"):
    steps = [step(s, 5, autocast_dtype=autocast) for s in range(len(dtypes_per_sample) * 10)]
    for i, dtypes in enumerate(dtypes_per_sample):
        steps[i * 10]["activations"] = activations([1.0] * 5, dtypes)
    return detect_precision_map(Window(series(steps, 5), context(LAYERS)), SETTINGS)


def test_healthy_autocast_map_raises_nothing():
    healthy = ["float16", "float32", "float32", "float16", "float16"]
    result = detect([healthy, healthy])
    assert result.drafts == []
    assert result.covered("precision_map:fc:fp32_matmul")
    assert result.covered("precision_map:rms:fp16_sensitive")


def test_fp32_matmul_under_autocast_and_fp16_norm():
    bad = ["float32", "float32", "float16", "float16", "float32"]
    drafts = drafts_by_key(detect([bad]))
    assert set(drafts) == {"precision_map:fc:fp32_matmul", "precision_map:conv:fp32_matmul",
                           "precision_map:rms:fp16_sensitive"}
    assert drafts["precision_map:fc:fp32_matmul"].severity == "info"
    assert drafts["precision_map:rms:fp16_sensitive"].severity == "warning"
    assert drafts["precision_map:rms:fp16_sensitive"].layer == "rms"


def test_fp32_matmul_without_autocast_is_not_flagged():
    assert detect([["float32"] * 5], autocast=None).drafts == []


def test_latest_sample_fine_again_deactivates():
    bad = ["float32", "float32", "float32", "float16", "float16"]
    good = ["float16", "float32", "float32", "float16", "float16"]
    finding = drafts_by_key(detect([bad, good]))["precision_map:fc:fp32_matmul"]
    assert not finding.active and finding.step == 0


def detect_probed(dtypes, reduces_in):
    layers = [LayerInfo(2, "rms", "RMSNorm", 64, {"reduces_in": reduces_in}, 2)
              if x.name == "rms" else x for x in LAYERS]
    steps = [step(s, 5, autocast_dtype="float16") for s in range(20)]
    steps[0]["activations"] = activations([1.0] * 5, dtypes)
    steps[10]["activations"] = activations([1.0] * 5, dtypes)
    return detect_precision_map(Window(series(steps, 5), context(layers)), SETTINGS)


def test_a_norm_is_judged_by_what_its_reductions_computed_in():
    # upcasts inside (x.float()), returns fp16: its statistics are fp32, nothing to say
    upcasting = detect_probed(["float16", "float32", "float16", "float16", "float16"],
                              "float32")
    assert upcasting.drafts == []
    assert upcasting.covered("precision_map:rms:fp16_sensitive")
    # variance taken in fp16, returned fp32 (times an fp32 weight): flagged
    drafts = drafts_by_key(detect_probed(
        ["float16", "float32", "float32", "float16", "float16"], "float16"))
    assert set(drafts) == {"precision_map:rms:fp16_sensitive"}
