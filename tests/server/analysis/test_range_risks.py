"""fp16 overflow risk (activations near 65504) and underflow risk (the measured share of
exactly-zero grad elements)."""

from __future__ import annotations

import pytest

from ampwatch.server.analysis.context import LayerInfo
from ampwatch.server.analysis.ranges import detect_overflow_risk, detect_underflow_risk
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
    drafts = drafts_by_key(detect_overflow_risk(Window(series(steps), context()), SETTINGS))
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
    result = detect_overflow_risk(Window(series(steps), context()), SETTINGS)
    assert not drafts_by_key(result)["overflow_risk:fc1"].active


def zero_shares(share, dtype="float16", n=300, every=10, skipped=()):
    """Steps whose sampled ones measured fc1's share of exactly-zero grad elements."""
    steps = [step(s, autocast_dtype=dtype) for s in range(n)]
    for s in steps[::every]:
        s["layer_grad_zero_share"] = [0.01, share, 0.0, None]
    for s in skipped:
        steps[s].update(skipped=True, grad_norm=float("inf"))
    return steps


@pytest.mark.parametrize(("share", "dtype", "flagged"), [
    (0.97, "float16", True),
    (0.2, "float16", False),   # dead units and sparse inputs leave some zeros
    (0.97, "bfloat16", False),  # bf16 has fp32's range: no underflow to measure
])
def test_underflow_risk_judges_the_measured_zero_share(share, dtype, flagged):
    run = context(environment={"autocast_dtype": dtype})
    window = Window(series(zero_shares(share, dtype)), run)
    drafts = drafts_by_key(detect_underflow_risk(window, SETTINGS))
    assert set(drafts) == ({"underflow_risk:fc1"} if flagged else set())
    if flagged:
        finding = drafts["underflow_risk:fc1"]
        assert finding.evidence["zero_share"] == pytest.approx(0.97)
        assert finding.evidence["share_of_steps"] == 1.0 and finding.step == 100  # risk_window
        assert "97%" in finding.message


def test_underflow_leaves_out_lookups_and_skipped_steps():
    layers = [linear(0), linear(1), linear(2),
              LayerInfo(3, "emb", "Embedding", 64 * 64, {"num_embeddings": 64}, 3)]
    steps = zero_shares(0.97, skipped=range(0, 300, 10))  # every measured step was skipped
    assert detect_underflow_risk(Window(series(steps), context(layers)), SETTINGS).drafts == []
    steps = zero_shares(0.2)
    for s in steps[::10]:
        s["layer_grad_zero_share"][3] = 0.99  # rows not looked up: zero by design
    assert detect_underflow_risk(Window(series(steps), context(layers)), SETTINGS).drafts == []


def test_underflow_fix_depends_on_the_scaler():
    steps = [step(s, loss_scale=None, scale_after=None, layer_grad_zero_share=[0.9] * 4)
             for s in range(50)]
    drafts = detect_underflow_risk(Window(series(steps), context()), SETTINGS).drafts
    assert len(drafts) == 4 and "GradScaler" in drafts[0].message
