"""The verdict on an fp32-versus-AMP speed check (`Attachment.check_speedup` in the agent
sends {"kind": "speed_check", "detail": {"fp32_ms", "amp_ms", "speedup", "dtype"}})."""

from __future__ import annotations

import math

from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.wire import SPEED_CHECK_EVENT as EVENT
from ampwatch.wire import decode_tree

KIND = FindingKind.SPEED


def _speedup(detail: dict) -> float | None:
    speedup = detail.get("speedup")
    if not isinstance(speedup, int | float):
        fp32, amp = detail.get("fp32_ms"), detail.get("amp_ms")
        if not (isinstance(fp32, int | float) and isinstance(amp, int | float) and amp > 0):
            return None
        speedup = fp32 / amp
    return float(speedup) if math.isfinite(speedup) and speedup > 0 else None


def verdict(speedup: float, settings: AnalysisSettings) -> tuple[str, str]:
    """(verdict code, advice) as the reference judges: under 1.1x stay in fp32,
    1.1-1.5x optional, above 1.5x use AMP."""
    if speedup < settings.speedup_stay_fp32:
        return "stay_fp32", ("AMP brings no real speedup for this model: stay in fp32 and "
                             "skip the scaler and its failure modes")
    if speedup <= settings.speedup_use_amp:
        return "optional", ("AMP helps a little: keep it if memory matters, otherwise fp32 "
                            "is simpler")
    return "use_amp", "AMP pays off for this model: keep it"


def detect_speed(window: Window, settings: AnalysisSettings) -> Detection:
    """The latest speed check in the window, as one finding per run and rank (a newer
    check replaces the verdict)."""
    series = window.series
    checks = [e for e in series.events if e.get("kind") == EVENT]
    for event in reversed(checks):
        detail = decode_tree(event.get("detail") or {})
        speedup = _speedup(detail)
        if speedup is None:
            continue
        code, advice = verdict(speedup, settings)
        dtype = detail.get("dtype") or "AMP"
        timing = ""
        if isinstance(detail.get("fp32_ms"), int | float) and \
                isinstance(detail.get("amp_ms"), int | float):
            timing = f" ({detail['fp32_ms']:.3g} ms fp32 vs {detail['amp_ms']:.3g} ms)"
        step = event.get("step")
        return Detection(drafts=[FindingDraft(
            kind=KIND, code=code, key=KIND, severity="info",
            message=f"Speed check: {dtype} runs {speedup:.2f}x as fast as fp32{timing}; {advice}.",
            step=step, last_step=step, occurrences=[] if step is None else [step],
            evidence={"speedup": speedup, "verdict": code, "dtype": dtype,
                      "fp32_ms": detail.get("fp32_ms"), "amp_ms": detail.get("amp_ms")},
        )])
    return Detection()
