"""The likely cause of one loss spike, from what the sampled spike signals did before it.

Only samples strictly before the spike's first step count (that step's own forward and
update are the spike, not its warning), and none from the run's first `spike_min_history`
steps (the untrained model's logits grow from their initial scale as it learns: a level
read there makes healthy learning look like a precursor; weights are told from learning
by what the optimizer's own steps can move them, `weights.reach`, from step 0). A signal
"grew" when its latest samples reach `spike_growth_factor` times its level at the start
of the lookback (the median of the earliest third of the samples there, floored so a
level near zero cannot make noise look like growth). The labels are tried in this
order, the first that holds wins:

0. lr_change: the recorded learning rate (the first param group's, as the agent records
   it) rose `spike_lr_jump` times or more within the `spike_lr_steps` steps before the
   spike (a change made by the loop or a scheduler; a fall cannot push a loss up);
0. weight_jump: a layer's sampled weight norm jumped `weight_jump_factor` times between
   two samples, the later one at or before the spike's first step (the norm is taken as
   a step's forward begins, so the spike's own step counts): that layer, not those after
   it (a steady growth, `weight_growth_factor` times rising on every sample, is tried
   after the logit growths below: a logit that grew names its own fix);
1. attention_logit_growth or output_logit_divergence: a layer's largest attention logit,
   or the output log-partition (|log Z|) or largest output logit, grew to a value that
   matters to the dtype it is computed in (logit_floor.py); when both did, the one that
   grew more (a breaking output layer drags the attention logits along). A growth short
   of that floor is a model learning sharper attention: it names the spike only when no
   label below does (instead of unknown);
3. second_moment_underflow: a layer's share of elements with a zero second moment and a
   gradient reached `adam_v_zero_share`;
4. adam_epsilon: a layer's eps-dominated share reached `adam_eps_share`;
5. update_ratio_all: the update ratio jumped `spike_update_jump` times in at least
   `spike_layers_share` of the measured layers at once (the optimizer's doing, no layer
   named); update_ratio_spike: it jumped in fewer, the largest jump's layer named;
6. bad_batch: the grad norm jumped with the loss, and the spike lasts one step or is one
   step's jump whose tail settles (the loss falls back at once, and the steps after stay
   under `spike_settle_share` of the jump's rise: the bad step's update still showing);
7. unknown, with the largest growth of each signal in the evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.spike_finder import Spike
from ampwatch.server.analysis.weights import moved, reach
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import StepSeries
from ampwatch.server.store.spike_samples import SIGNALS, SpikeWindow

FIXES = {
    "lr_change": "undo or soften the learning-rate change (a smaller step, or a warmup "
                 "to the new value); precision is not the cause",
    "weight_jump": "find what changed this layer's weights at that step (a loop or a load "
                   "that rescales them, or one update: clip it or lower the learning rate); "
                   "precision is not the cause",
    "attention_logit_growth": "add qk-layernorm (normalise queries and keys before their "
                              "product) or lower the learning rate",
    "output_logit_divergence": "add z-loss (1e-4 * logsumexp(logits)**2) or weight decay on "
                               "the output layer",
    "second_moment_underflow": "keep the optimizer state in float32 (fp32 master weights "
                               "and moments) or scale the loss up",
    "adam_epsilon": "lower Adam's eps (1e-15 or less at this gradient scale) or scale the "
                    "loss up",
    "update_ratio_spike": "clip the update (or the gradient) harder, or lower the learning "
                          "rate around this step",
    "update_ratio_all": "lower the learning rate (check the schedule and the optimizer's "
                        "hyperparameters) or clip the update harder",
    "bad_batch": "inspect or skip this step's batch; the run recovered by itself",
    "unknown": "look at the loss and grad norm around the spike; nothing sampled grew before it",
}
LEVEL_FLOOR = {"attn_max_logit": 1.0, "logit_lse": 1.0, "logit_absmax": 1.0}
MIN_SAMPLES = 3


@dataclass
class Growth:
    """One layer's growth of one signal before a spike."""

    layer: int
    level: float
    latest: float
    first_step: int | None  # the first sample at or over the factor

    @property
    def factor(self) -> float:
        return self.latest / self.level if self.level > 0 else float("inf")


@dataclass
class SpikeCause:
    label: str
    layer: int | None = None
    precursor_step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def growth(steps: np.ndarray, values: np.ndarray, factor: float, floor: float) -> Growth | None:
    """The layer whose signal grew most: latest (the larger of the last two samples) over
    the level (median of the earliest third), floored. `values` (m, L), NaN: not measured."""
    best = None
    for layer in np.flatnonzero(np.isfinite(values).sum(axis=0) >= MIN_SAMPLES):
        seen = np.isfinite(values[:, layer])
        s, v = steps[seen], np.abs(values[seen, layer])
        level = max(float(np.median(v[: max(1, v.size // 3)])), floor)
        latest = float(v[-2:].max())
        over = np.flatnonzero(v >= factor * level)
        found = Growth(int(layer), level, latest, int(s[over[0]]) if over.size else None)
        if best is None or found.factor > best.factor:
            best = found
    return best


def _share_over(steps: np.ndarray, values: np.ndarray, threshold: float) -> Growth | None:
    """The layer with the largest latest share at or over `threshold`, and since when it
    has been (the first sample of its last run over the threshold)."""
    if not len(steps):
        return None
    latest = np.where(np.isfinite(values), values, -1.0)
    last_seen = np.array([latest[np.flatnonzero(latest[:, j] >= 0)[-1], j]
                          if (latest[:, j] >= 0).any() else -1.0
                          for j in range(values.shape[1])])
    layer = int(np.argmax(last_seen))
    if last_seen[layer] < threshold:
        return None
    column = latest[:, layer]
    under = np.flatnonzero((column >= 0) & (column < threshold))
    since = under[-1] + 1 if under.size else int(np.flatnonzero(column >= 0)[0])
    return Growth(layer, threshold, float(last_seen[layer]), int(steps[since]))


def label_spike(spike: Spike, signals: SpikeWindow, window: Window,
                settings: AnalysisSettings,
                floor_of: Callable[[str, int], float]) -> SpikeCause:
    """The cause of `spike`, from the samples in its lookback and the per-step loss,
    grad norm and learning rate of the window's steps. `floor_of(signal, layer)`: the smallest logit
    that matters to the dtype that layer's logits are computed in (logit_floor.py); a
    logit grown short of it names the spike only when nothing else does."""
    # a level read in the run's first steps is the untrained model's: logits and weights
    # growing from their initial scale is learning, not a precursor (the spike finder waits
    # as long)
    series = window.series
    warm = int(series.steps[0]) + settings.spike_min_history if len(series.steps) else 0
    before = (signals.steps < spike.start) & (signals.steps >= warm) & (
        signals.steps >= spike.start - settings.spike_lookback_steps)
    steps, values = signals.steps[before], signals.values[before]
    factor = settings.spike_growth_factor
    seen: dict[str, Any] = {}

    def signal(name: str) -> np.ndarray:
        return values[:, SIGNALS.index(name)]

    update_jumps = jumps(steps, signal("update_ratio"))
    if update_jumps:
        seen["update_ratio"] = _describe(max(update_jumps, key=lambda g: g.factor))
    lr = _lr_rise(spike, series.steps, series.column("lr"), settings)
    if lr is not None:
        jumped = [g for g in update_jumps if g.factor >= settings.spike_update_jump]
        lr["update_ratio_jumped"] = [len(jumped), len(update_jumps)]
        return SpikeCause("lr_change", precursor_step=lr["lr_step"], evidence={"seen": seen, **lr})
    weights = _weights_moved(spike, signals, window, settings)
    if weights is not None and weights["shape"] == "weight_jump":  # sudden: nothing else is
        return _weight_cause(weights, seen)
    attention = growth(steps, signal("attn_max_logit"), factor, LEVEL_FLOOR["attn_max_logit"])
    lse = growth(steps, signal("logit_lse"), factor, LEVEL_FLOOR["logit_lse"])
    absmax = growth(steps, signal("logit_absmax"), factor, LEVEL_FLOOR["logit_absmax"])
    for name, found in (("attn_max_logit", attention), ("logit_lse", lse),
                        ("logit_absmax", absmax)):
        if found is not None:
            seen[name] = _describe(found)
    output = max((g for g in (lse, absmax) if g is not None), key=lambda g: g.factor,
                 default=None)
    grown = [(g.factor, label, g) for label, g in (("attention_logit_growth", attention),
                                                  ("output_logit_divergence", output))
             if g is not None and g.factor >= factor]
    matter = [item for item in grown if item[2].latest >= floor_of(
        "attn_max_logit" if item[1] == "attention_logit_growth" else "logit_lse",
        item[2].layer)]
    if matter:
        _, label, found = max(matter, key=lambda item: item[0])
        return _cause(label, found, seen)
    cause = _later_causes(spike, steps, signal, update_jumps, weights, series, settings, seen)
    if cause.label == "unknown" and grown:  # a small growth is all there is to go by
        _, label, found = max(grown, key=lambda item: item[0])
        return _cause(label, found, seen)
    return cause


def _later_causes(spike: Spike, steps: np.ndarray, signal: Callable[[str], np.ndarray],
                  update_jumps: list[Growth], weights: dict[str, Any] | None,
                  series: StepSeries, settings: AnalysisSettings,
                  seen: dict[str, Any]) -> SpikeCause:
    """The labels after the logit growths (module docstring, 2 onwards)."""
    if weights is not None:  # a steady growth of a layer's weights, no logit grew
        return _weight_cause(weights, seen)
    v_zero = _share_over(steps, signal("adam_v_zero_share"), settings.adam_v_zero_share)
    if v_zero is not None:
        return _cause("second_moment_underflow", v_zero, seen)
    eps = _share_over(steps, signal("adam_eps_share"), settings.adam_eps_share)
    if eps is not None:
        return _cause("adam_epsilon", eps, seen)
    jumped = [g for g in update_jumps if g.factor >= settings.spike_update_jump]
    if len(jumped) >= 2 and len(jumped) >= settings.spike_layers_share * len(update_jumps):
        first = min(int(g.first_step) for g in jumped if g.first_step is not None)
        return SpikeCause("update_ratio_all", precursor_step=first,
                     evidence={"seen": seen, "layers_jumped": [len(jumped), len(update_jumps)],
                               "factors": [round(g.factor, 3) for g in jumped]})
    if jumped:
        return _cause("update_ratio_spike", max(jumped, key=lambda g: g.factor), seen)
    loss_steps, grad_norm = series.steps, series.column("grad_norm")
    grad_jump = _grad_jump(spike, loss_steps, grad_norm, series.has("grad_norm"),
                           settings.spike_reference_steps)
    if grad_jump is not None:
        seen["grad_norm_jump"] = grad_jump
        settled = spike.length == 1 or _settles(spike, loss_steps, series.column("loss"),
                                                settings.spike_settle_share)
        if settled and grad_jump >= settings.spike_grad_jump:
            return SpikeCause("bad_batch", evidence={"seen": seen, "steps_over": spike.length})
    return SpikeCause("unknown", evidence={"seen": seen})


def jumps(steps: np.ndarray, values: np.ndarray) -> list[Growth]:
    """Each measured layer's latest sample over the median of its previous ones (up to 5)."""
    out = []
    for layer in np.flatnonzero(np.isfinite(values).sum(axis=0) >= MIN_SAMPLES + 1):
        seen = np.isfinite(values[:, layer])
        s, v = steps[seen], values[seen, layer]
        level = float(np.median(v[-1 - 5: -1]))
        if level > 0:
            out.append(Growth(int(layer), level, float(v[-1]), int(s[-1])))
    return out


def _weights_moved(spike: Spike, signals: SpikeWindow, window: Window,
                   settings: AnalysisSettings) -> dict[str, Any] | None:
    """The layer whose weight norm moved first into the spike, and where it began:
    weights.py's rules, with its bound on what the optimizer's own steps move (`reach`),
    on the samples of the lookback up to the spike's first step. The bound, not a
    warm-up, tells a model learning from its initial scale from weights that grow: a
    growth begun at step 0 is seen whole."""
    keep = (signals.steps <= spike.start) & (
        signals.steps >= spike.start - settings.spike_lookback_steps)
    norms = signals.signal("weight_norm")[keep]
    found = []
    for layer in np.flatnonzero(np.isfinite(norms).sum(axis=0) >= MIN_SAMPLES):
        seen = np.isfinite(norms[:, layer])
        steps = signals.steps[keep][seen]
        result = moved(steps, norms[seen, layer], settings, reach(window, steps, int(layer)))
        if result is not None:
            code, first, _, evidence, _ = result
            found.append({"layer": int(layer), "step": first, "shape": code,
                          "weight_factor": evidence["factor"]})
    return min(found, key=lambda f: (f["step"], -abs(np.log(f["weight_factor"]))),
               default=None)


def _weight_cause(weights: dict[str, Any], seen: dict[str, Any]) -> SpikeCause:
    return SpikeCause("weight_jump", layer=int(weights["layer"]),
                 precursor_step=int(weights["step"]), evidence={"seen": seen, **weights})


def _lr_rise(spike: Spike, steps: np.ndarray, lr: np.ndarray,
             settings: AnalysisSettings) -> dict[str, Any] | None:
    """The recorded learning rate's rise into the spike: its last value before the spike
    against its value `spike_lr_steps` steps earlier, if `spike_lr_jump` times or more;
    with the first step it left that value (the change) and both values."""
    known = np.isfinite(lr) & (steps < spike.start)
    s, v = steps[known], lr[known]
    if not s.size:
        return None
    base_at = np.flatnonzero(s <= s[-1] - settings.spike_lr_steps)
    if not base_at.size or v[base_at[-1]] <= 0:
        return None
    base, after = float(v[base_at[-1]]), float(v[-1])
    if after < settings.spike_lr_jump * base:
        return None
    moved = base_at[-1] + 1 + int(np.argmax(v[base_at[-1] + 1:] != base))
    return {"lr_before": base, "lr_after": after, "lr_step": int(s[moved]),
            "lr_reached_step": int(s[-1]), "lr_factor": after / base}


def _settles(spike: Spike, steps: np.ndarray, loss: np.ndarray, share: float) -> bool:
    """A one-step jump: the spike's first step is its peak, and every later step of it
    stays under `share` of the rise over the median (the loss fell back at once; what
    lingers is the bad step's update, not a growing fault)."""
    if spike.peak_step != spike.start:
        return False
    tail = loss[(steps > spike.start) & (steps <= spike.end) & np.isfinite(loss)]
    rise = spike.peak - spike.median
    return bool(rise > 0 and (tail - spike.median < share * rise).all())


def _grad_jump(spike: Spike, steps: np.ndarray, grad_norm: np.ndarray,
               recorded: np.ndarray, reference: int) -> float | None:
    """The grad norm at the spike's first step over the median of the steps before it;
    infinite when that step's gradients overflowed (recorded as inf/NaN: under fp16 a
    bad batch's gradients often do, and the scaler skips the step)."""
    at = np.flatnonzero((steps == spike.start) & recorded)
    earlier = grad_norm[(steps < spike.start) & np.isfinite(grad_norm)][-reference:]
    if not at.size or earlier.size < MIN_SAMPLES:
        return None
    if not np.isfinite(grad_norm[at[0]]):
        return float("inf")
    median = float(np.median(earlier))
    return float(grad_norm[at[0]] / median) if median > 0 else None


def _describe(found: Growth) -> dict[str, Any]:
    return {"layer": found.layer, "level": found.level, "latest": found.latest,
            "factor": found.factor, "first_step": found.first_step}


def _cause(label: str, found: Growth, seen: dict[str, Any]) -> SpikeCause:
    return SpikeCause(label, layer=found.layer, precursor_step=found.first_step,
                 evidence={"seen": seen, "signal": _describe(found)})
