"""AMP pitfalls: each code fires for a loop that commits it and stays silent for the
correct loop; the setup pitfalls follow the environment."""

from __future__ import annotations

import pytest

from ampwatch.server.analysis.pitfalls import detect_loop_pitfalls, detect_setup_pitfalls
from ampwatch.server.analysis.speed import detect_speed
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import StepSeries
from tests.server.analysis.factories import (
    SETTINGS,
    context,
    drafts_by_key,
    linear,
    scaler_steps,
    series,
)

# the correct loop: scaler, unscale before clipping, scheduler only on real steps,
# one update per optimizer step, eval under autocast
CORRECT = {"clip_before_unscale": False, "scheduler_steps": 1, "scaler_updates": 1,
           "eval_forwards": 2, "eval_forwards_no_autocast": 0}


def correct_loop(n=200):
    steps = scaler_steps(n, overflow={50, 120}, **CORRECT)
    for before, after in zip(steps, steps[1:], strict=False):
        if before["skipped"]:  # no scheduler step after a skipped step
            after["scheduler_steps"] = 0
    return steps


def loop_codes(steps):
    return {d.code for d in detect_loop_pitfalls(Window(series(steps), context()), SETTINGS).drafts}


def test_correct_loop_is_silent():
    assert loop_codes(correct_loop()) == set()


def commit(code, steps):
    """Change the correct loop's steps into ones that commit `code` from step 100 on."""
    for s in steps[100:]:
        if code == "clip_before_unscale":
            s["clip_before_unscale"] = True
        elif code == "scheduler_on_skipped_step":
            s["scheduler_steps"] = 1
        elif code == "fp16_without_scaler":
            del s["loss_scale"], s["scale_after"]
            s["skipped"] = False
        elif code == "mixed_autocast_dtypes":
            s["autocast_dtype"] = "bfloat16" if s["step"] % 2 else "float16"
        elif code == "eval_without_autocast":
            s["eval_forwards_no_autocast"] = 2
        elif code == "update_without_step":
            s["scaler_updates"] = 4
    return steps


@pytest.mark.parametrize("code", ["clip_before_unscale", "scheduler_on_skipped_step",
                                  "fp16_without_scaler", "mixed_autocast_dtypes",
                                  "eval_without_autocast", "update_without_step"])
def test_loop_pitfall_fires_with_first_step_and_fix(code):
    steps = commit(code, correct_loop())
    drafts = drafts_by_key(detect_loop_pitfalls(Window(series(steps), context()), SETTINGS))
    assert set(drafts) == {f"pitfall:{code}"}
    finding = drafts[f"pitfall:{code}"]
    first = 120 if code == "scheduler_on_skipped_step" else (101 if code ==
                                                             "mixed_autocast_dtypes" else 100)
    assert finding.step == first and finding.code == code
    assert finding.message.startswith(f"Step {first}: ")
    assert finding.active


def test_loop_pitfalls_are_never_resolved_by_absence():
    assert detect_loop_pitfalls(Window(series(correct_loop()), context()), SETTINGS).covers == ()


def setup_codes(env, layers=None, data=None):
    run = context(layers if layers is not None else 4, env)
    result = detect_setup_pitfalls(Window(data or StepSeries.empty(4), run), SETTINGS)
    return {d.code: d for d in result.drafts}


def big_model():
    return [linear(i, in_features=4096, out_features=4096) for i in range(4)]


def test_bf16_on_pre_ampere_gpu():
    env = {"autocast_dtype": "bfloat16", "compute_capability": "7.0",
           "device_name": "Tesla V100"}
    codes = setup_codes(env, big_model())
    assert set(codes) == {"bf16_unsupported_device"}
    assert codes["bf16_unsupported_device"].severity == "warning"
    assert "float16" in codes["bf16_unsupported_device"].message
    assert setup_codes({**env, "compute_capability": "8.0"}, big_model()) == {}


def test_scaler_with_bf16_is_info():
    env = {"autocast_dtype": "bfloat16", "scaler": {"enabled": True}}
    codes = setup_codes(env, big_model())
    assert set(codes) == {"scaler_with_bf16"} and codes["scaler_with_bf16"].severity == "info"
    assert setup_codes({**env, "scaler": {"enabled": False}}, big_model()) == {}


def test_small_model_is_info():
    codes = setup_codes({}, [linear(0)])
    assert set(codes) == {"small_model"} and codes["small_model"].severity == "info"
    assert setup_codes({}, big_model()) == {}
    assert setup_codes({"autocast_dtype": None}, [linear(0)]) == {}  # no AMP seen yet


@pytest.mark.parametrize(("speedup", "verdict"), [(1.05, "stay_fp32"), (1.3, "optional"),
                                                  (2.4, "use_amp")])
def test_speed_check_verdict(speedup, verdict):
    events = [{"step": 3, "kind": "speed_check",
               "detail": {"fp32_ms": 10.0, "amp_ms": 5.0, "speedup": 0.5, "dtype": "float16"}},
              {"step": 9, "kind": "speed_check",
               "detail": {"fp32_ms": 10.0 * speedup, "amp_ms": 10.0, "speedup": speedup,
                          "dtype": "float16"}}]
    window = Window(series(correct_loop(20), events=events), context())
    drafts = drafts_by_key(detect_speed(window, SETTINGS))
    finding = drafts["speed"]
    assert finding.code == verdict and finding.step == 9
    assert finding.evidence["speedup"] == speedup


def test_a_scheduler_stepped_on_a_guarded_step_is_no_pitfall():
    """The step guard's users step the scheduler as usual (docs/guard.md): a step the
    guard left out of a bf16 run is not a step GradScaler skipped."""
    steps = correct_loop()
    for s in steps:
        del s["loss_scale"], s["scale_after"]
        s.update(skipped=False, scheduler_steps=1, autocast_dtype="bfloat16")
    for bad in (50, 120):
        steps[bad].update(skipped=True, guarded="nonfinite_grads")
    assert loop_codes(steps) == set()
