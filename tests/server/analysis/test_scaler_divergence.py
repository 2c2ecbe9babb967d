"""Diverging GradScaler: collapse, streaks, skip share, slow decline, causes; and silence
for a healthy scaler."""

from __future__ import annotations

import pytest

from ampwatch.server.analysis import AnalysisSettings
from ampwatch.server.analysis.scaler import calibration_mask, detect_scaler_divergence
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
)


def detect(steps, run=None, settings=SETTINGS):
    window = Window(series(steps), run or context())
    return drafts_by_key(detect_scaler_divergence(window, settings))


@pytest.mark.parametrize("growth_interval", [10, 100, 2000])
def test_healthy_scaler_raises_nothing(growth_interval):
    # calibrates from 65536 down to 1024 (six skips in a row), then one halving per
    # growth interval as it probes 2048 and backs off
    steps = scaler_steps(max(1500, 3 * growth_interval), fits=1024,
                         growth_interval=growth_interval)
    assert sum(s["skipped"] for s in steps) > 6
    run = context(environment={"scaler": {"growth_interval": growth_interval}})
    assert detect(steps, run) == {}


def test_calibration_covers_the_initial_skips_only():
    steps = scaler_steps(300, overflow={0, 1, 2, 3, 4, 5, 8, 150})
    mask = calibration_mask(series(steps), context(), SETTINGS)
    assert mask[:9].all() and not mask[9:].any()


def test_long_calibration_streak_is_not_a_divergence():
    # 10 skips in a row from a far too high init scale, then clean
    assert detect(scaler_steps(400, init_scale=2.0**25, fits=2.0**15)) == {}


@pytest.mark.parametrize(("length", "severity"), [(4, None), (5, "warning"), (19, "warning"),
                                                  (20, "critical")])
def test_streak_after_calibration(length, severity):
    steps = scaler_steps(300, overflow=range(100, 100 + length))
    drafts = detect(steps)
    streak = drafts.get("scaler_divergence:skip_streak")
    if severity is None:
        assert streak is None
        return
    assert streak.severity == severity
    assert (streak.step, streak.last_step) == (100, 100 + length - 1)
    assert streak.evidence["longest_streak"] == length
    assert not streak.active  # the scaler recovered: the finding resolves
    assert streak.evidence["cause"] == "grad_overflow"
    assert streak.layer == "fc0"


def test_ongoing_streak_is_active():
    steps = scaler_steps(130, overflow=range(120, 130))
    streak = detect(steps)["scaler_divergence:skip_streak"]
    assert streak.active and streak.evidence["current_streak"] == 10


def test_collapse_to_one_is_critical_and_recovery_resolves_it():
    steps = scaler_steps(150, overflow=range(100, 117))  # 65536 / 2**17 = 0.5
    drafts = detect(steps)
    collapse = drafts["scaler_divergence:scale_collapse"]
    assert collapse.severity == "critical" and collapse.step == 115  # scale 1.0
    assert collapse.evidence["loss_scale"] == 0.5
    assert collapse.active  # the scale stays at 0.5 until it grows back

    recovered = steps + scaler_steps(50, first=150, init_scale=4.0)
    assert not detect(recovered)["scaler_divergence:scale_collapse"].active


@pytest.mark.parametrize(("skips", "flagged"), [(30, True), (20, False)])
def test_skip_share_of_the_last_500_steps(skips, flagged):
    overflow = set(range(100, 100 + 16 * skips, 16))  # isolated skips, no streak
    steps = scaler_steps(600, overflow=overflow, init_scale=2.0**40)
    ratio = detect(steps).get("scaler_divergence:skip_ratio")
    assert (ratio is not None) == flagged
    if flagged:
        assert ratio.severity == "warning" and ratio.active
        assert ratio.evidence["skipped"] == skips and ratio.evidence["window"] == 500


def test_skip_share_needs_enough_steps():
    assert "scaler_divergence:skip_ratio" not in detect(scaler_steps(60, overflow={20, 40, 50}))


@pytest.mark.parametrize(("every", "flagged"), [(50, True), (100, False)])
def test_slow_decline(every, flagged):
    steps = scaler_steps(600, overflow=range(100, 600, every), growth_interval=2000)
    decline = detect(steps).get("scaler_divergence:scale_decline")
    assert (decline is not None) == flagged
    if flagged:
        assert decline.evidence["net_halvings"] >= 3
        assert decline.severity == "warning"


def test_slow_checks_stay_quiet_while_a_streak_is_active():
    drafts = detect(scaler_steps(200, overflow=range(150, 200)))
    assert set(drafts) == {"scaler_divergence:skip_streak", "scaler_divergence:scale_collapse"}


def test_forward_overflow_names_the_first_layer_in_forward_order():
    # table order fc0..fc3, forward order fc2, fc0, fc3, fc1; fc0 overflows first,
    # everything after it in forward order is non-finite too
    layers = [linear(0, forward_index=1), linear(1, forward_index=3),
              linear(2, forward_index=0), linear(3, forward_index=2)]
    steps = scaler_steps(200, overflow=range(150, 200))
    for s in steps[150:]:
        s["activations"] = activations([INF, NAN, 3.0, NAN])
        s["loss"] = NAN
        s["layer_grad_norm"] = [NAN] * 4
    streak = detect(steps, context(layers))["scaler_divergence:skip_streak"]
    assert streak.evidence["cause"] == "forward_overflow"
    assert streak.layer == "fc0"
    assert "no loss scale can fix" in streak.message


@pytest.mark.parametrize(("field", "cause"), [("loss", "nonfinite_loss"),
                                              ("input_nonfinite", "nonfinite_input")])
def test_loss_and_input_causes(field, cause):
    steps = scaler_steps(130, overflow=range(120, 130))
    for s in steps[120:]:
        s[field] = True if field == "input_nonfinite" else INF
    streak = detect(steps)["scaler_divergence:skip_streak"]
    assert streak.evidence["cause"] == cause and streak.layer is None


def test_thresholds_are_settings():
    steps = scaler_steps(300, overflow=range(100, 106))
    assert "scaler_divergence:skip_streak" in detect(steps)
    strict = AnalysisSettings(skip_streak_warning=7, skip_streak_critical=30)
    assert "scaler_divergence:skip_streak" not in detect(steps, settings=strict)


def test_no_scaler_no_findings():
    steps = scaler_steps(100)
    for s in steps:
        del s["loss_scale"], s["scale_after"]
    result = detect_scaler_divergence(Window(series(steps), context()), SETTINGS)
    assert result.drafts == [] and result.covered("scaler_divergence:skip_streak")


def test_skips_of_a_reported_streak_are_not_counted_again():
    steps = scaler_steps(400, overflow=range(100, 140), init_scale=2.0**60)
    drafts = detect(steps)
    assert set(drafts) == {"scaler_divergence:skip_streak"}
    assert not drafts["scaler_divergence:skip_streak"].active


def test_a_streak_judged_as_it_arrives_is_only_a_streak():
    """A window that ends two or three skips into a streak (a batch cut there) does not
    call its halvings a decline: the same findings whatever step the windows end on."""
    steps = scaler_steps(60, overflow=range(20, 60), init_scale=2.0**60)
    seen = {(key, draft.step) for end in range(1, len(steps) + 1)
            for key, draft in detect(steps[:end]).items()}
    assert seen == {("scaler_divergence:skip_streak", 20)}


def test_a_slow_decline_is_told_at_the_same_step_whatever_the_window_ends_on():
    steps = scaler_steps(400, overflow=range(100, 400, 50), growth_interval=2000)
    seen = {(key, draft.step) for end in range(100, len(steps) + 1)
            for key, draft in detect(steps[:end]).items()}
    assert seen == {("scaler_divergence:scale_decline", 200)}
