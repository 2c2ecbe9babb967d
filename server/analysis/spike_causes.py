"""The likely cause of one loss spike, from what the sampled spike signals did before it.

Only samples strictly before the spike's first step count (that step's own forward and
update are the spike, not its warning). A signal "grew" when its latest samples reach
`spike_growth_factor` times its level at the start of the lookback (the median of the
earliest third of the samples there, floored so a level near zero cannot make noise
look like growth). The labels are tried in this order, the first that holds wins:

1. attention_logit_growth or output_logit_divergence: a layer's largest attention logit,
   or the output log-partition (|log Z|) or largest output logit, grew; when both did,
   the one that grew more (a breaking output layer drags the attention logits along);
3. second_moment_underflow: a layer's share of elements with a zero second moment and a
   gradient reached `adam_v_zero_share`;
4. adam_epsilon: a layer's eps-dominated share reached `adam_eps_share`;
5. update_ratio_spike: a layer's update ratio jumped `spike_update_jump` times over the
   median of its previous samples;
6. bad_batch: the spike lasts one step and the grad norm jumped with it;
7. unknown, with the largest growth of each signal in the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.spike_finder import Spike
from ampwatch.server.store.spike_samples import SIGNALS, SpikeWindow

FIXES = {
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
class Cause:
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


def jump(steps: np.ndarray, values: np.ndarray) -> Growth | None:
    """The layer whose latest sample is the most over the median of its previous ones."""
    best = None
    for layer in np.flatnonzero(np.isfinite(values).sum(axis=0) >= MIN_SAMPLES + 1):
        seen = np.isfinite(values[:, layer])
        s, v = steps[seen], values[seen, layer]
        level = float(np.median(v[-1 - 5: -1]))
        found = Growth(int(layer), level, float(v[-1]), int(s[-1]))
        if level > 0 and (best is None or found.factor > best.factor):
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


def label_spike(spike: Spike, signals: SpikeWindow, loss_steps: np.ndarray,
                grad_norm: np.ndarray, settings: AnalysisSettings) -> Cause:
    """The cause of `spike`, from the samples in its lookback and the grad norms."""
    before = (signals.steps < spike.start) & (
        signals.steps >= spike.start - settings.spike_lookback_steps)
    steps, window = signals.steps[before], signals.values[before]
    factor = settings.spike_growth_factor
    seen: dict[str, Any] = {}

    def signal(name: str) -> np.ndarray:
        return window[:, SIGNALS.index(name)]

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
    if grown:
        _, label, found = max(grown, key=lambda item: item[0])
        return _cause(label, found, seen)
    v_zero = _share_over(steps, signal("adam_v_zero_share"), settings.adam_v_zero_share)
    if v_zero is not None:
        return _cause("second_moment_underflow", v_zero, seen)
    eps = _share_over(steps, signal("adam_eps_share"), settings.adam_eps_share)
    if eps is not None:
        return _cause("adam_epsilon", eps, seen)
    update = jump(steps, signal("update_ratio"))
    if update is not None:
        seen["update_ratio"] = _describe(update)
        if update.factor >= settings.spike_update_jump:
            return _cause("update_ratio_spike", update, seen)
    grad_jump = _grad_jump(spike, loss_steps, grad_norm, settings.spike_reference_steps)
    if grad_jump is not None:
        seen["grad_norm_jump"] = grad_jump
        if spike.length == 1 and grad_jump >= settings.spike_grad_jump:
            return Cause("bad_batch", evidence={"seen": seen})
    return Cause("unknown", evidence={"seen": seen})


def _grad_jump(spike: Spike, steps: np.ndarray, grad_norm: np.ndarray,
               reference: int) -> float | None:
    """The grad norm at the spike's first step over the median of the steps before it."""
    at = np.flatnonzero(steps == spike.start)
    earlier = grad_norm[(steps < spike.start) & np.isfinite(grad_norm)][-reference:]
    if not at.size or not np.isfinite(grad_norm[at[0]]) or earlier.size < MIN_SAMPLES:
        return None
    median = float(np.median(earlier))
    return float(grad_norm[at[0]] / median) if median > 0 else None


def _describe(found: Growth) -> dict[str, Any]:
    return {"layer": found.layer, "level": found.level, "latest": found.latest,
            "factor": found.factor, "first_step": found.first_step}


def _cause(label: str, found: Growth, seen: dict[str, Any]) -> Cause:
    return Cause(label, layer=found.layer, precursor_step=found.first_step,
                 evidence={"seen": seen, "signal": _describe(found)})
