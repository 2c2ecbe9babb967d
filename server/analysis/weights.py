"""A layer's weights as a cause of their own (`weight_jump`), from the weight norms the
agent samples (`spikes.weight_norm`, agent/collectors/weights.py; docs/diagnosis.md).

Two shapes, each named on the layer whose weights moved, not on the layers after it that
the larger outputs overflow or saturate:

- jump: between two consecutive samples the norm changed `weight_jump_factor` times or
  more (up or down): the weights were rescaled, corrupted or hit by one bad update;
- growth: the norm grew `weight_growth_factor` times over its first sample in the window,
  rising on every sample since the growth began (a steady compounding growth; the
  finding's step is where the norm left its own trend, `change_point`: the cause's first
  step, not the first sample that normal training moved).

Adam with a sane learning rate moves a layer's norm by a few percent between samples; even
the spike suite's pushes (query/key learning rate 2.0, an output shift's 100) moved norms
11-22x in ten steps, so a jump (100x by default) is a rescale no optimizer step makes:
a warning (critical from 1000x). A growth is info: evidence that names where a growth
starts (it can be harmless: queries and keys under qk-layernorm), never an alert of its
own; its evidence lists the layers after it whose outputs grew with it (`carried`), the
only ones whose findings it explains. Pure numpy over the window's samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.draft import Detection, FindingDraft
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.spike_samples import SpikeWindow

FIX = ("find what changed this layer's weights at that step (a loop or a load that "
       "rescales them, or one update: clip it or lower the learning rate); precision is "
       "not the cause, and the layers after it overflow only because of it")
GROWTH_FIX = ("find what grows this layer's weights on every step (a loop that rescales "
              "them, or updates that compound: lower the learning rate, add weight decay or "
              "clip); precision is not the cause, and the layers after it overflow only "
              "because of it")
MIN_SAMPLES = 3


def detect_weight_jumps(window: Window, settings: AnalysisSettings) -> Detection:
    """A `weight_jump` finding per layer whose sampled weight norm jumped or grew."""
    signals = (window.spikes if window.spikes is not None
               else SpikeWindow.empty(window.series.n_layers))
    norms = signals.signal("weight_norm")
    drafts = []
    for layer in np.flatnonzero(np.isfinite(norms).sum(axis=0) >= MIN_SAMPLES):
        seen = np.isfinite(norms[:, layer])
        steps, v = signals.steps[seen], norms[seen, layer]
        draft = moved(steps, v, settings, reach(window, steps, int(layer)))
        if draft is not None:
            code, first, message, evidence, active = draft
            name = window.run.layer_name(int(layer))
            big = evidence["factor"] >= 1000 or evidence["factor"] <= 0.001
            severity = "info" if code == "weight_growth" else "critical" if big else "warning"
            fix = GROWTH_FIX if code == "weight_growth" else FIX
            if code == "weight_growth":
                evidence["carried"] = carried(window, int(layer), first, evidence["factor"])
            drafts.append(FindingDraft(
                kind=FindingKind.WEIGHT_JUMP, code=code, key=f"{FindingKind.WEIGHT_JUMP}:{name}",
                severity=severity,
                message=f"Layer {name!r}: {message}. Fix: {fix}.", step=first,
                last_step=int(steps[-1]), layer=name,
                evidence={**evidence, "cause": Cause.WEIGHT_JUMP, "fix": fix},
                occurrences=steps[steps >= first], active=active))
    return Detection(drafts=drafts, covers=("weight_jump:",))


ADAM_REACH = 2.0  # an Adam step moves each element by about lr, rarely more than twice it


def reach(window: Window, steps: np.ndarray, layer: int) -> np.ndarray:
    """Per pair of consecutive samples, the largest change of the layer's weight norm its
    optimizer's own steps can make: ADAM_REACH x the largest recorded learning rate
    between them x the steps between x sqrt(its parameter count). A near-zero initial
    scale (ConvNeXt's layer scale at 1e-6) grows 1000x in ten steps of lr 1e-3: that is
    training from an untrained level, not a rescale. Zeros where the learning rate or
    the parameter count is unknown."""
    series = window.series
    count = float(window.run.param_counts(series.n_layers)[layer])
    lr = series.column("lr")
    out = np.zeros(max(steps.size - 1, 0))
    if count <= 0 or not np.isfinite(lr).any():
        return out
    for i in range(out.size):
        between = (series.steps > steps[i]) & (series.steps <= steps[i + 1]) & np.isfinite(lr)
        if between.any():
            out[i] = (ADAM_REACH * float(lr[between].max()) * float(steps[i + 1] - steps[i])
                      * np.sqrt(count))
    return out


def carried(window: Window, layer: int, first: int, factor: float) -> list[str]:
    """The layers after `layer` in forward order whose sampled output abs-max grew with its
    weights: at least sqrt(`factor`) times from their first finite sample at or after step
    `first` to their last. A growth is the cause of what breaks in these layers only (an
    embedding growing slowly through a long run explains nothing about a layer whose
    outputs did not follow it)."""
    series = window.series
    if series.act_absmax is None or not len(series.act_step):
        return []
    values = series.act_absmax[series.act_step >= first].astype(np.float64)
    if not len(values):
        return []
    values[~((values > 0) & np.isfinite(values))] = np.nan
    seen = np.isfinite(values)
    counted = seen.sum(axis=0) >= 2
    rows = np.arange(values.shape[1])
    firsts = values[seen.argmax(axis=0), rows]
    lasts = values[len(values) - 1 - seen[::-1].argmax(axis=0), rows]
    position = window.run.forward_position(series.n_layers)
    grew = counted & (position > position[layer]) & (lasts >= np.sqrt(factor) * firsts)
    return [window.run.layer_name(int(other)) for other in np.flatnonzero(grew)]


def moved(steps: np.ndarray, v: np.ndarray, settings: AnalysisSettings,
          reachable: np.ndarray | None = None) -> tuple | None:
    """(code, first step, message, evidence, active) of a layer's norms `v` at `steps`
    that jumped or grew; None when they did neither. `reachable`: per pair of samples,
    the norm change the optimizer's own steps can make (`reach`); no jump within it."""
    if v.size < MIN_SAMPLES or (v <= 0).any():  # zero-initialised (LoRA's B): no level
        return None
    return (_jump(steps, v, settings.weight_jump_factor, reachable)
            or _growth(steps, v, settings.weight_growth_factor, reachable))


def _jump(steps: np.ndarray, v: np.ndarray, factor: float,
          reachable: np.ndarray | None = None) -> tuple | None:
    """The first pair of consecutive samples whose ratio is `factor` or more either way,
    by more than the optimizer could move it."""
    ratio = v[1:] / v[:-1]
    beyond = (np.abs(v[1:] - v[:-1]) > reachable if reachable is not None
              else np.ones(ratio.size, dtype=bool))
    moved = np.flatnonzero(((ratio >= factor) | (ratio <= 1 / factor)) & beyond)
    if not moved.size:
        return None
    i = int(moved[0]) + 1
    before, after = float(v[i - 1]), float(v[i])
    word = "jumped" if after > before else "collapsed"
    message = (f"its weights' norm {word} {after / before:.3g}x between the samples of steps "
               f"{int(steps[i - 1])} and {int(steps[i])} ({before:.4g} -> {after:.4g}), "
               f"and is {float(v[-1]):.4g} at step {int(steps[-1])}")
    evidence: dict[str, Any] = {"before": before, "after": after, "factor": after / before,
                                "before_step": int(steps[i - 1]), "jump_step": int(steps[i]),
                                "latest": float(v[-1])}
    # still out of its old range: the rescaled weights are what the run now trains with
    active = bool(v[-1] / before >= factor or v[-1] / before <= 1 / factor)
    return "weight_jump", int(steps[i]), message, evidence, active


TREND_BREAK = 3.0  # the growth's rate over the trend's before it: a change, not noise
MIN_TREND = 2  # sample-to-sample changes a trend needs before it can be left


def change_point(series: np.ndarray, begin: int = 0) -> int:
    """The sample where `series` (log norms, one per sample) leaves its own trend: the
    split of its changes since `begin` into a before and an after that fits them best (two
    means, least squares), kept when the after's median change is TREND_BREAK times the
    before's (or more, a falling or flat trend counting as none) and the before holds
    MIN_TREND changes; else `begin`. Normal training moves every norm a little from its
    first sample: the growth starts where that stops being the story, not at the first
    change. O(n^2) in the samples."""
    changes = np.diff(series[begin:])
    best, best_cost = None, np.inf
    for k in range(MIN_TREND, changes.size):
        before, after = changes[:k], changes[k:]
        cost = float(((before - before.mean()) ** 2).sum() + ((after - after.mean()) ** 2).sum())
        if cost < best_cost:
            best, best_cost = k, cost
    if best is None:
        return begin
    trend, growth = float(np.median(changes[:best])), float(np.median(changes[best:]))
    return begin + best if growth > 0 and growth >= TREND_BREAK * max(trend, 0.0) else begin


def _growth(steps: np.ndarray, v: np.ndarray, factor: float,
            reachable: np.ndarray | None = None) -> tuple | None:
    """Growth `factor` times over the first sample, rising on every sample since the rise
    that reached it began."""
    if v[-1] < factor * v[0]:
        return None
    rising = np.concatenate([[False], v[1:] > v[:-1]])
    flat = np.flatnonzero(~rising)
    begin = int(flat[-1])  # the last sample not above the one before: the rise starts there
    if v[-1] < factor * v[begin]:
        return None
    begin = change_point(np.log(v), begin)
    if reachable is not None and v[-1] - v[begin] <= reachable[begin:].sum():
        return None  # the optimizer's own pace from a small initial scale
    samples = v.size - begin - 1
    per_sample = (float(v[-1]) / float(v[begin])) ** (1 / max(samples, 1))
    per_step = per_sample ** (1 / max(float(np.median(np.diff(steps[begin:]))), 1.0))
    message = (f"its weights' norm grew {float(v[-1]) / float(v[begin]):.3g}x from step "
               f"{int(steps[begin])} to step {int(steps[-1])} ({float(v[begin]):.4g} -> "
               f"{float(v[-1]):.4g}, {100 * (per_step - 1):.2g}% a step), rising on every "
               f"sample: the growth starts in this layer")
    evidence = {"before": float(v[begin]), "after": float(v[-1]),
                "factor": float(v[-1]) / float(v[begin]), "growth_step": int(steps[begin]),
                # the growth began after growth_step and by this sample
                "rise_step": int(steps[min(begin + 1, v.size - 1)]),
                "per_step": per_step, "latest": float(v[-1])}
    return "weight_growth", int(steps[begin]), message, evidence, True
