"""bf16-era findings: loss spikes with their likely cause (`loss_spike`, the cause as its
code), precursors before any spike (`spike_precursor`: a layer's largest attention logit
or the output log-partition grown `precursor_factor` times over its level, to where its
dtype's rounding matters: server/analysis/logit_floor.py), and optimizer
states that silently lose updates (`optimizer_state`: eps-dominated or zero second
moments). Judged on the loss series and the agent's sampled spike signals
(server/store/spike_samples.py); docs/spikes.md says how each is found and fixed.

The findings of one spike (the spike and the precursor or optimizer state that it is
labelled with) carry its first step as `evidence.spike_step`: incidents.py makes them one
incident.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.context import RunContext, compute_dtype
from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.logit_floor import layer_logit_floor
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.spike_causes import FIXES, LEVEL_FLOOR, SpikeCause, label_spike
from ampwatch.server.analysis.spike_finder import Spike, find_spikes
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.spike_samples import SpikeWindow

CAUSE_WORDS = {
    "weight_jump": "the layer's weights jumped (their sampled norm)",
    "lr_change": "the learning rate rose",
    "attention_logit_growth": "attention logits grew",
    "output_logit_divergence": "the output logits diverged (log-partition drifting)",
    "second_moment_underflow": "Adam's second moment underflowed to zero",
    "adam_epsilon": "Adam's eps dominated the update's denominator",
    "update_ratio_all": "the update-to-weight ratio jumped in most layers at once (the "
                        "optimizer's doing, not one layer's)",
    "update_ratio_spike": "the update-to-weight ratio jumped",
    "bad_batch": "a bad batch (a one-step jump, the grad norm jumped with the loss)",
    "unknown": "no sampled signal grew before it",
}


def detect_spikes(window: Window, settings: AnalysisSettings) -> Detection:
    """Every spike, precursor and optimizer-state finding of the window (its steps' loss
    and grad norm, and `window.spikes`, the sampled signals over the same span); pure."""
    series, run = window.series, window.run
    signals = (window.spikes if window.spikes is not None
               else SpikeWindow.empty(series.n_layers))
    spikes = find_spikes(series.steps, series.column("loss"),
                         reference=settings.spike_reference_steps,
                         min_history=settings.spike_min_history,
                         spread_factor=settings.spike_spread_factor,
                         min_rise=settings.spike_min_rise)
    last = int(series.steps[-1]) if len(series.steps) else 0
    run_dtype = compute_dtype(series, run)

    def floor_of(signal: str, layer: int) -> float:
        return layer_logit_floor(run, layer, signal, run_dtype, settings)[1]

    labelled = [(spike, label_spike(spike, signals, window, settings, floor_of))
                for spike in spikes]
    guarded = series.steps[series.guarded > 0]  # steps the agent's step guard left out
    drafts = [_spike_draft(spike, cause, run, last, settings, guarded)
              for spike, cause in labelled]
    warm = (int(series.steps[0]) + settings.spike_min_history if len(series.steps) else 0)
    drafts += _precursors(signals, run, settings, labelled, warm, run_dtype)
    drafts += _optimizer_states(signals, run, settings, labelled)
    return Detection(drafts=drafts, covers=("spike_precursor:", "optimizer_state:"))


def cause_words(label: str, evidence: dict[str, Any]) -> str:
    """What a spike's cause reads as, everywhere it is shown (message, incident title)."""
    words = CAUSE_WORDS.get(label, label)
    if label == "lr_change" and "lr_before" in evidence:
        words += (f" {float(evidence['lr_factor']):.3g}x, from {float(evidence['lr_before']):.3g}"
                  f" to {float(evidence['lr_after']):.3g} at step {evidence['lr_step']}")
        jumped = evidence.get("update_ratio_jumped") or [0, 0]
        if jumped[1]:
            words += (f"; the update-to-weight ratio jumped in {jumped[0]} of {jumped[1]} "
                      "measured layers")
    elif label == "update_ratio_all" and "layers_jumped" in evidence:
        words += f" ({evidence['layers_jumped'][0]} of {evidence['layers_jumped'][1]} layers)"
    elif label == "bad_batch" and int(evidence.get("steps_over", 1)) > 1:
        words += (f"; the {int(evidence['steps_over']) - 1} steps after it are that "
                  "step's update settling")
    return words


def _spike_draft(spike: Spike, cause: SpikeCause, run: RunContext, last: int,
                 settings: AnalysisSettings, guarded: np.ndarray) -> FindingDraft:
    layer = None if cause.layer is None else run.layer_name(cause.layer)
    lead = None if cause.precursor_step is None else spike.start - cause.precursor_step
    # a loss that stayed up is the damage that matters most: critical
    stuck = spike.recovered_at is None and last - spike.start >= settings.spike_critical_steps
    back = (f"back under it at step {spike.recovered_at}" if spike.recovered_at is not None
            else f"not back in {last - spike.start} steps" if stuck else "not back yet")
    where = f" in layer {layer!r}" if layer else ""
    since = (f", first seen at step {cause.precursor_step} ({lead} steps ahead)"
             if cause.precursor_step is not None and cause.label != "lr_change" else "")
    message = (f"Loss spike at step {spike.start}: {spike.peak:.4g} against a recent median "
               f"of {spike.median:.4g} ({spike.size:.0f} spreads, {spike.ratio:.2f}x), {back}. "
               f"Likely cause: {cause_words(cause.label, cause.evidence)}{where}{since}. "
               f"Fix: {FIXES[cause.label]}.")
    left_out = guarded[(guarded >= spike.start) & (guarded <= spike.end)].tolist()
    if left_out:
        message += (f" The ampwatch guard left out step{'s' if len(left_out) > 1 else ''} "
                    f"{', '.join(map(str, left_out))}: their updates never reached the "
                    "weights or the optimizer state.")
    evidence = {"cause": Cause.LOSS_SPIKE, "label": cause.label, "spike_step": spike.start,
                "end_step": spike.end,
                "peak_step": spike.peak_step, "peak": spike.peak, "median": spike.median,
                "spread": spike.spread, "size_spreads": spike.size, "ratio": spike.ratio,
                "recovered_at": spike.recovered_at, "precursor_step": cause.precursor_step,
                "lead_steps": lead, "fix": FIXES[cause.label], "guarded_steps": len(left_out),
                **cause.evidence}
    if cause.label == "weight_jump":  # one story with the layer's weight finding
        evidence.update(cause=Cause.WEIGHT_JUMP, layer=layer)
    return FindingDraft(kind=FindingKind.LOSS_SPIKE, code=cause.label,
                        key=f"{FindingKind.LOSS_SPIKE}:{spike.start}",
                        severity="critical" if stuck else "warning", message=message,
                        step=spike.start, last_step=spike.end, layer=layer, evidence=evidence,
                        occurrences=np.arange(spike.start, spike.end + 1),
                        active=spike.recovered_at is None)


def _spike_after(labelled: list[tuple[Spike, SpikeCause]], label: str, layer: int,
                 step: int) -> int | None:
    """The first spike at or after `step` labelled `label` in `layer`."""
    return next((spike.start for spike, cause in labelled if cause.label == label
                 and cause.layer == layer and spike.start >= step), None)


def _precursors(signals: SpikeWindow, run: RunContext, settings: AnalysisSettings,
                labelled: list[tuple[Spike, SpikeCause]], warm: int,
                run_dtype: str | None) -> list[FindingDraft]:
    """A layer's largest attention logit, or the output log-partition, at
    `precursor_factor` times its trained level and large enough to matter to the dtype it
    is computed in (logit_floor.py; `run_dtype`: the run's autocast dtype). The level is
    the median of the earliest third of its samples from `warm` on (the window's first
    step + `spike_min_history`): a level read before is the untrained model's, and logits
    growing from their initial scale (an encoder-decoder's from under 1 to 14) is
    learning, not a precursor."""
    drafts = []
    for code, name in (("attention_logit_growth", "attn_max_logit"),
                       ("output_logit_divergence", "logit_lse")):
        values = np.abs(signals.signal(name))
        for layer in np.flatnonzero(np.isfinite(values).sum(axis=0) >= 3):
            seen = np.isfinite(values[:, layer]) & (signals.steps >= warm)
            if not seen.any():
                continue
            steps, v = signals.steps[seen], values[seen, layer]
            level = max(float(np.median(v[: max(1, v.size // 3)])), LEVEL_FLOOR[name])
            dtype, floor = layer_logit_floor(run, int(layer), name, run_dtype, settings)
            over = (v >= settings.precursor_factor * level) & (v >= floor)
            if not over.any():
                continue
            drafts.append(_precursor_draft(code, name, int(layer), steps, v, over, level,
                                           (dtype, floor), run, labelled))
    return drafts


def _precursor_draft(code: str, name: str, layer: int, steps: np.ndarray, v: np.ndarray,
                     over: np.ndarray, level: float, matters: tuple[str, float],
                     run: RunContext, labelled: list[tuple[Spike, SpikeCause]]
                     ) -> FindingDraft:
    flagged = steps[over]
    layer_name = run.layer_name(layer)
    first = int(flagged[0])
    what = ("largest attention logit" if code == "attention_logit_growth"
            else "output log-partition")
    spike = _spike_after(labelled, code, layer, first)
    # a spike that came first: its story, not one still to come
    during = next((s.start for s, _ in reversed(labelled) if s.start <= first), None)
    message = (f"Layer {layer_name!r}: its {what} reached {float(v[over][-1]):.4g}, "
               f"{float(v[over][-1]) / level:.0f}x its level of {level:.3g} and past the "
               f"{matters[1]:.4g} that matters in {matters[0]}, first at step "
               f"{first}" + (f"; the loss spiked at step {spike}" if spike is not None
                             else f"; after the loss spike of step {during}"
                             if during is not None else "; no loss spike yet")
               + f". Fix: {FIXES[code]}.")
    evidence: dict[str, Any] = {"signal": name, "level": level, "computed_in": matters[0],
                                "dtype_floor": matters[1], "latest": float(v[-1]),
                                "peak": float(v.max()), "first_step": first,
                                "steps": [int(s) for s in flagged[-20:]], "fix": FIXES[code]}
    if spike is not None:
        evidence.update(cause=Cause.LOSS_SPIKE, spike_step=spike)
    return FindingDraft(kind=FindingKind.SPIKE_PRECURSOR, code=code,
                        key=f"spike_precursor:{code}:{layer_name}", severity="warning",
                        message=message, step=first, last_step=int(flagged[-1]),
                        layer=layer_name, evidence=evidence, occurrences=flagged,
                        active=bool(over[-1]))


def _optimizer_states(signals: SpikeWindow, run: RunContext, settings: AnalysisSettings,
                      labelled: list[tuple[Spike, SpikeCause]]) -> list[FindingDraft]:
    """Layers whose eps-dominated or zero second-moment share stayed at or over its
    threshold on `optimizer_state_samples` consecutive samples."""
    drafts = []
    for code, name, threshold in (
            ("second_moment_underflow", "adam_v_zero_share", settings.adam_v_zero_share),
            ("adam_epsilon", "adam_eps_share", settings.adam_eps_share)):
        values = signals.signal(name)
        for layer in np.flatnonzero((values >= threshold).any(axis=0)):
            seen = np.isfinite(values[:, layer])
            steps, v = signals.steps[seen], values[seen, layer]
            streak = _streak(v >= threshold, settings.optimizer_state_samples)
            if not streak.any():
                continue
            drafts.append(_state_draft(code, name, int(layer), steps, v, streak, threshold,
                                       run, labelled))
    return drafts


def _streak(over: np.ndarray, length: int) -> np.ndarray:
    """Samples in runs of at least `length` consecutive True."""
    out = np.zeros_like(over)
    start = None
    for i, flag in enumerate([*over.tolist(), False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            if i - start >= length:
                out[start:i] = True
            start = None
    return out


def _state_draft(code: str, name: str, layer: int, steps: np.ndarray, v: np.ndarray,
                 streak: np.ndarray, threshold: float, run: RunContext,
                 labelled: list[tuple[Spike, SpikeCause]]) -> FindingDraft:
    flagged = steps[streak]
    layer_name = run.layer_name(layer)
    share = float(v[streak][-1])
    what = ("elements have a zero second moment while their gradient is not zero (it "
            "underflowed in the optimizer state's dtype): Adam divides by eps alone there"
            if code == "second_moment_underflow" else
            "elements have sqrt(second moment) under eps: eps, not the gradient's scale, "
            "sets the update size, so updates shrink")
    message = (f"Layer {layer_name!r}: {share:.0%} of its updated {what}, on "
               f"{int(streak.sum())} samples from step {int(flagged[0])}. "
               f"Fix: {FIXES[code]}.")
    evidence: dict[str, Any] = {"signal": name, "share": share, "threshold": threshold,
                                "first_step": int(flagged[0]),
                                "steps": [int(s) for s in flagged[-20:]], "fix": FIXES[code]}
    spike = _spike_after(labelled, code, layer, int(flagged[0]))
    if spike is not None:
        evidence.update(cause=Cause.LOSS_SPIKE, spike_step=spike)
    return FindingDraft(kind=FindingKind.OPTIMIZER_STATE, code=code,
                        key=f"optimizer_state:{code}:{layer_name}", severity="warning",
                        message=message, step=int(flagged[0]), last_step=int(flagged[-1]),
                        layer=layer_name, evidence=evidence, occurrences=flagged,
                        active=bool(streak[-1]))


def spike_story(members: list[tuple[str, str | None, dict[str, Any]]]
                ) -> tuple[str | None, str, str]:
    """(layer, headline, fix) of the incident of one spike, from its findings' (kind,
    layer, evidence)."""
    spike = next(((layer, ev) for kind, layer, ev in members
                  if kind == FindingKind.LOSS_SPIKE), None)
    if spike is None:  # its spike has left the window the findings were read in
        layer, evidence = members[0][1], members[0][2]
        return layer, f"Loss spike at step {evidence.get('spike_step')}", str(
            evidence.get("fix", ""))
    layer, evidence = spike
    label = str(evidence.get("label", "unknown"))
    where = f" in {layer!r}" if layer else ""
    headline = f"Loss spike at step {evidence.get('spike_step')}: {cause_words(label, evidence)}"
    fix = FIXES.get(label, "")
    return layer, headline + where, fix[0].upper() + fix[1:] + "." if fix else ""
