"""Findings speak the run's own dtype (issue #35, point 1): every message a registered
detector and the incident grouping write, for fp16, bf16 and fp8 runs, names the dtype
the run computes in wherever it says what overflowed, underflowed or fell, never
advises bf16 to a bf16 run, and calls gradients that ran away before any value
overflowed a divergence ("lower the learning rate"), not a precision problem."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import pytest

from ampwatch.server.analysis.context import LayerInfo
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.registry import Inputs, run_detectors
from ampwatch.server.analysis.window import Window
from ampwatch.server.findings.incidents import group_incidents
from ampwatch.server.store.fp8_samples import ROLES, STATS, Fp8Window
from ampwatch.server.store.spike_samples import SIGNALS, SpikeWindow
from tests.server.analysis.factories import (
    INF,
    NAN,
    SETTINGS,
    activations,
    context,
    linear,
    scaler_steps,
    series,
    step,
)

WORDS = {"float16": "fp16", "bfloat16": "bf16"}
# what a message says of the run's own values: the dtype named there must be the run's
CLAIMS = (r"overflows (fp16|bf16|fp32|fp8)", r"(fp16|bf16|fp32)'s maximum",
          r"(fp16|bf16|fp32) can no longer hold", r"mark of (fp16|bf16) underflow",
          r"produced (fp16|bf16) outputs", r"(float16|bfloat16) \(step \d+\), where norms")
E4M3_MAX = 448.0
FP8_LAYER = {"fp8_recipe": "delayed (amax history 16)", "fp8_input_format": "e4m3",
             "fp8_weight_format": "e4m3", "fp8_grad_format": "e5m2"}


def _steps(dtype: str, n: int, scaler: bool, **fields) -> list[dict]:
    if scaler:
        return scaler_steps(n, autocast_dtype=dtype, **fields)
    return [step(s, autocast_dtype=dtype, loss_scale=None, scale_after=None, **fields)
            for s in range(n)]


def _forward_overflow(dtype: str, scaler: bool) -> list[dict]:
    """fc2 overflows in the forward from step 100 (the scaler, if any, skips those steps
    until its scale collapses)."""
    steps = (scaler_steps(160, overflow=range(100, 160), autocast_dtype=dtype) if scaler
             else _steps(dtype, 160, False))
    for s in steps[100:]:
        s["activations"] = activations([5.0, 9.0, INF, NAN], dtype)
        s["layer_grad_norm"] = [NAN] * 4
        s["grad_norm"], s["loss"] = NAN, NAN
    return steps


def _divergence(dtype: str, scaler: bool) -> list[dict]:
    """The grad norm grows a thousandfold a step from step 40, with every activation far
    from any dtype's maximum, then the step goes NaN: a learning rate too high."""
    steps = _steps(dtype, 60, scaler)
    for s in steps:
        s["activations"] = activations([3.0, 4.0, 5.0, 6.0], dtype)
    for i, s in enumerate(steps[40:44]):
        s["grad_norm"] = 10.0 ** (3 * (i + 1))
    for s in steps[44:]:
        s["grad_norm"], s["loss"], s["layer_grad_norm"] = NAN, NAN, [NAN] * 4
        s["activations"] = activations([NAN] * 4, dtype)
    return steps


def _risks(dtype: str, scaler: bool) -> list[dict]:
    """fc1's output near fp16's maximum, every layer's gradients mostly zero, and a
    LayerNorm computed in the run's dtype."""
    steps = _steps(dtype, 240, scaler)
    for s in steps:
        s["activations"] = activations([3.0, 50_000.0, 5.0, 6.0], dtype)
        s["layer_grad_zero_share"] = [0.97] * 4
    return steps


def _loss_spike(dtype: str, scaler: bool) -> list[dict]:
    """A falling noisy loss with a spike at step 150 (the spike signals: `_spike_samples`)."""
    steps = _steps(dtype, 200, scaler)
    rng = np.random.default_rng(0)
    for i, s in enumerate(steps):
        s["loss"] = 4.0 if i == 150 else float(np.interp(i, [0, 199], [2.0, 1.5])
                                                  * (1 + 0.03 * rng.standard_normal()))
    return steps


def _spike_samples() -> SpikeWindow:
    """Before the spike: fc2's second moments empty from step 100, fc0's updates
    eps-dominated from step 50, and fc1's largest attention logit growing fourfold per
    sample from step 60 (a precursor of its own); after it, fc2's weights x1000 at 180."""
    steps = np.arange(0, 200, 10)
    values = np.full((steps.size, len(SIGNALS), 4), np.nan)
    values[:, SIGNALS.index("update_ratio")] = 1e-3
    values[:, SIGNALS.index("adam_eps_share")] = 0.0
    values[:, SIGNALS.index("adam_v_zero_share")] = 0.0
    values[:, SIGNALS.index("attn_max_logit"), 1] = 3.0
    values[10:, SIGNALS.index("adam_v_zero_share"), 2] = 0.4
    values[5:, SIGNALS.index("adam_eps_share"), 0] = 0.9
    values[6:, SIGNALS.index("attn_max_logit"), 1] *= 4.0 ** np.arange(1, steps.size - 5)
    values[:, SIGNALS.index("weight_norm")] = 3.0
    values[18:, SIGNALS.index("weight_norm"), 2] = 3e3  # fc2's weights rescaled after it
    return SpikeWindow(steps, values)


def _run(dtype: str, fp8: bool = False):
    layers = [linear(i, **(FP8_LAYER if fp8 else {})) for i in range(3)]
    layers.append(LayerInfo(index=3, name="norm", type="LayerNorm", param_count=128,
                            attrs={}, forward_index=3))
    return context(layers, {"autocast_dtype": dtype})


def _fp8_samples() -> Fp8Window:
    """fc0's weight cast flushes 40% of its elements to zero; fc1's input saturates."""
    steps = np.arange(0, 100, 10)
    values = np.zeros((steps.size, len(ROLES), len(STATS), 4), dtype=np.float32)
    values[:, :, STATS.index("amax")] = 4.0
    values[:, :, STATS.index("scale")] = E4M3_MAX / 8.0
    values[:, :, STATS.index("rms")] = 1.0
    values[5:, ROLES.index("weight"), STATS.index("underflow"), 0] = 0.4
    values[5:, ROLES.index("input"), STATS.index("saturated"), 1] = 0.01
    values[5:, ROLES.index("input"), STATS.index("amax"), 1] = 40.0
    present = np.ones((steps.size, len(ROLES), 4), dtype=bool)
    present[:, :, 3] = False  # the LayerNorm casts nothing to FP8
    return Fp8Window(steps, values, present)


def _findings(dtype: str, scenario, *, scaler: bool, fp8: bool = False) -> list[dict]:
    """Every registered detector over the scenario's steps, as stored findings."""
    run = _run(dtype, fp8)
    window = Window(series(scenario(dtype, scaler)), run, fp8=_fp8_samples() if fp8 else None,
                    spikes=_spike_samples() if scenario is _loss_spike else None)
    drafts = [d for detection in run_detectors(window, SETTINGS, list(Inputs))
              for d in detection.drafts]
    return [{"id": i, "run_id": "run", "rank": 0, "kind": str(d.kind), "code": d.code,
             "layer": d.layer, "severity": d.severity, "status": "open", "step": d.step,
             "last_step": d.last_step, "evidence": d.evidence, "message": d.message}
            for i, d in enumerate(drafts, 1)]


def _texts(findings: list[dict]) -> Iterator[tuple[str, str]]:
    for finding in findings:
        yield finding["kind"], finding["message"]
    for incident in group_incidents(findings):
        for text in (incident.headline, incident.fix):
            if text:
                yield "incident", text


CASES = [(dtype, scenario, scaler, fp8)
         for dtype, fp8 in (("float16", False), ("bfloat16", False), ("bfloat16", True))
         for scenario in (_forward_overflow, _divergence, _risks, _loss_spike)
         for scaler in ((True,) if dtype == "float16" else (False, True))]


@pytest.mark.parametrize(("dtype", "scenario", "scaler", "fp8"), CASES,
                         ids=[f"{'fp8-' if c[3] else ''}{WORDS[c[0]]}-{c[1].__name__[1:]}"
                              f"{'-scaler' if c[2] else ''}" for c in CASES])
def test_every_message_names_the_runs_own_dtype(dtype, scenario, scaler, fp8):
    findings = _findings(dtype, scenario, scaler=scaler, fp8=fp8)
    assert findings, "the scenario raised nothing"
    word = WORDS[dtype]
    for kind, text in _texts(findings):
        for claim in CLAIMS:
            for named in re.findall(claim, text):
                assert named in (word, dtype), (kind, text)
        if dtype == "bfloat16":
            assert "train in bf16" not in text and "raise init_scale" not in text, (kind, text)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gradients_that_run_away_first_are_a_divergence(dtype):
    findings = _findings(dtype, _divergence, scaler=dtype == "float16")
    nonfinite = [f for f in findings if f["kind"] == FindingKind.NONFINITE]
    assert [f["evidence"]["cause"] for f in nonfinite] == ["divergence"]
    assert nonfinite[0]["step"] == 44  # the first NaN step the scenario made
    (incident,) = [i for i in group_incidents(findings) if i.cause == "divergence"]
    assert incident.headline.startswith("Training diverged")
    for text in (nonfinite[0]["message"], incident.fix):
        assert "lower the learning rate" in text.lower() and "warmup" in text
        assert "fp32" not in text and "train in bf16" not in text


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_overflow_with_calm_gradients_is_not_a_divergence(dtype):
    findings = _findings(dtype, _forward_overflow, scaler=dtype == "float16")
    causes = {f["evidence"].get("cause") for f in findings if f["kind"] == "nonfinite"}
    assert causes == {"forward_overflow"}
    (incident,) = [i for i in group_incidents(findings) if i.cause == "forward_overflow"]
    assert incident.headline == f"Layer 'fc2' overflows {WORDS[dtype]} in the forward pass"


def test_the_scenarios_raise_every_kind_a_run_of_one_rank_can_have():
    kinds = {f["kind"] for dtype, scenario, scaler, fp8 in CASES
             for f in _findings(dtype, scenario, scaler=scaler, fp8=fp8)}
    # ranks compare several ranks; misaligned layers, speed checks and learning-rate
    # changes say no dtype
    assert kinds >= set(FindingKind) - {FindingKind.RANKS, FindingKind.MISALIGNED_LAYER,
                                        FindingKind.SPEED, FindingKind.LR_CHANGE}, sorted(kinds)
