"""fp16 overflow risk (activations near 65504) and underflow risk (scaled grads below
fp16's normal range)."""

from __future__ import annotations

import pytest

from ampwatch.server.analysis.ranges import detect_overflow_risk, detect_underflow_risk
from tests.server.analysis.factories import (
    SETTINGS,
    activations,
    context,
    drafts_by_key,
    series,
    step,
)


def sampled(values, dtype="float16", n=100, every=10):
    steps = [step(s) for s in range(n)]
    for s in steps[::every]:
        s["activations"] = activations(values, dtype)
    return steps


@pytest.mark.parametrize(("absmax", "dtype", "flagged"), [
    (40000.0, "float16", True),
    (32752.0, "float16", True),
    (30000.0, "float16", False),
    (40000.0, "float32", False),
    (40000.0, "bfloat16", False),
])
def test_overflow_risk(absmax, dtype, flagged):
    steps = sampled([1.0, absmax, 2.0, None], dtype)
    drafts = drafts_by_key(detect_overflow_risk(series(steps), context(), SETTINGS))
    assert ("overflow_risk:fc1" in drafts) == flagged
    assert len(drafts) == int(flagged)
    if flagged:
        finding = drafts["overflow_risk:fc1"]
        assert finding.layer == "fc1" and finding.evidence["absmax"] == absmax
        assert finding.active and finding.count == 10


def test_overflow_risk_resolves_when_back_in_range():
    steps = sampled([1.0, 50000.0, 1.0, 1.0], n=300, every=10)
    for s in steps[100::10]:
        s["activations"] = activations([1.0, 100.0, 1.0, 1.0])
    result = detect_overflow_risk(series(steps), context(), SETTINGS)
    assert not drafts_by_key(result)["overflow_risk:fc1"].active


def grads(norm, scale=65536.0, dtype="float16", n=300):
    return [step(s, loss_scale=scale, scale_after=scale, autocast_dtype=dtype,
                 layer_grad_norm=[0.1, norm, 0.1, None]) for s in range(n)]


@pytest.mark.parametrize(("norm", "scale", "dtype", "flagged"), [
    (1e-7, 1.0, "float16", True),       # rms ~1.5e-9 per element, unscaled
    (1e-7, 65536.0, "float16", False),  # the scaler lifts it to ~1e-4
    (1e-9, 65536.0, "float16", True),
    (1e-7, 1.0, "bfloat16", False),     # bf16 has fp32's range
])
def test_underflow_risk(norm, scale, dtype, flagged):
    run = context(environment={"autocast_dtype": dtype})
    drafts = drafts_by_key(detect_underflow_risk(series(grads(norm, scale, dtype)), run,
                                                 SETTINGS))
    assert ("underflow_risk:fc1" in drafts) == flagged
    assert len(drafts) == int(flagged)
    if flagged:
        assert drafts["underflow_risk:fc1"].evidence["share"] == 1.0


def test_underflow_fix_depends_on_the_scaler():
    steps = [step(s, loss_scale=None, scale_after=None, layer_grad_norm=[1e-7] * 4)
             for s in range(50)]
    drafts = detect_underflow_risk(series(steps), context(), SETTINGS).drafts
    assert len(drafts) == 4 and "GradScaler" in drafts[0].message
