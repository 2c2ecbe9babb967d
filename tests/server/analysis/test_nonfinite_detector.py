"""Non-finite localisation: first layer in forward order, grad offenders, loss and input."""

from __future__ import annotations

from ampwatch.server.analysis.nonfinite import detect_nonfinite
from ampwatch.server.analysis.window import Window
from tests.server.analysis.factories import (
    INF,
    NAN,
    SETTINGS,
    activations,
    context,
    drafts_by_key,
    linear,
    scaler_steps,
    series,
    step,
)


def detect(steps, run=None):
    return drafts_by_key(detect_nonfinite(Window(series(steps), run or context()), SETTINGS))


def test_forward_overflow_first_layer_in_forward_order():
    layers = [linear(0, forward_index=3), linear(1, forward_index=0),
              linear(2, forward_index=1), linear(3, forward_index=2)]
    steps = scaler_steps(120, overflow=range(100, 120))
    for s in steps[100:]:
        # forward order fc1, fc2, fc3, fc0: fc2 overflows, fc3 and fc0 inherit it
        s["activations"] = activations([NAN, 5.0, INF, NAN])
        s["layer_grad_norm"] = [NAN, 0.1, NAN, NAN]
        s["loss"] = NAN
    drafts = detect(steps, context(layers))
    assert list(drafts) == ["nonfinite:forward_overflow:fc2"]
    finding = drafts["nonfinite:forward_overflow:fc2"]
    assert finding.layer == "fc2" and finding.severity == "warning"
    assert finding.evidence["first_nonfinite_layer"] == "fc2"
    assert finding.evidence["grad_nonfinite_layers"] == ["fc2", "fc3", "fc0"]
    assert finding.evidence["loss_nonfinite"] is True
    assert (finding.step, finding.last_step, finding.count) == (100, 119, 20)
    assert finding.active


def test_injected_grad_inf_names_that_layer_at_exactly_those_steps():
    injected = [130, 160, 190]
    drafts = detect(scaler_steps(250, overflow=injected, grad_layer=2))
    finding = drafts["nonfinite:grad_overflow:fc2"]
    assert len(drafts) == 1
    assert finding.evidence["steps"] == injected
    assert finding.evidence["grad_nonfinite_layers"] == ["fc2"]
    assert finding.evidence["skipped_steps"] == 3
    assert finding.severity == "info"  # the scaler skipped them


def test_calibration_overflows_are_not_findings():
    assert detect(scaler_steps(300, fits=1024)) == {}


def test_nan_that_reached_the_weights_is_critical():
    # bf16 without a scaler: nothing is skipped
    steps = [step(s, autocast_dtype="bfloat16", loss_scale=None, scale_after=None)
             for s in range(50)]
    steps[40].update(loss=NAN, grad_norm=NAN, layer_grad_norm=[NAN] * 4)
    finding = detect(steps)["nonfinite:nonfinite_loss:-"]
    assert finding.severity == "critical" and finding.step == 40
    assert "reached the weights" in finding.message


def test_nonfinite_input_is_the_cause_before_everything_it_breaks():
    steps = scaler_steps(60, overflow={50})
    steps[50].update(input_nonfinite=True, loss=NAN,
                     activations=activations([NAN, NAN, NAN, NAN]))
    assert list(detect(steps)) == ["nonfinite:nonfinite_input:-"]


def test_resolves_after_enough_clean_steps():
    steps = scaler_steps(400, overflow={150}, grad_layer=1)
    finding = detect(steps)["nonfinite:grad_overflow:fc1"]
    assert not finding.active
    assert detect(steps[:200])["nonfinite:grad_overflow:fc1"].active


def test_a_tied_layer_is_evidence_never_the_verdict():
    """wte (0) and head (3) share one weight; its grad, accumulated from both uses, is
    inf with fc2's: fc2 is named, the tie is listed. When only the tied layers' grads are
    inf, the last of them in forward order is named, as before."""
    layers = [linear(0, "wte"), linear(1), linear(2), linear(3, "head", tied_to="wte")]
    steps = scaler_steps(250, overflow=[130, 160])
    for s in steps:
        if s["step"] == 130:
            s["layer_grad_norm"] = [INF, 0.1, INF, INF]
        if s["step"] == 160:
            s["layer_grad_norm"] = [INF, 0.1, 0.2, INF]
    drafts = detect(steps, context(layers))
    assert set(drafts) == {"nonfinite:grad_overflow:fc2", "nonfinite:grad_overflow:head"}
    finding = drafts["nonfinite:grad_overflow:fc2"]
    assert finding.step == 130 and finding.evidence["grad_nonfinite_layers"] == [
        "wte", "fc2", "head"]
    assert drafts["nonfinite:grad_overflow:head"].step == 160
