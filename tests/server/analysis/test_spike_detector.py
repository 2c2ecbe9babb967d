"""The spike detector (server/analysis/spikes.py) on hand-made loss series and spike
signals: what a spike is, which label it gets and why, precursors before any spike,
optimizer states, and nothing on a healthy run."""

from __future__ import annotations

import numpy as np
import pytest

from ampwatch.server.analysis.spike_finder import find_spikes
from ampwatch.server.analysis.spikes import detect_spikes
from ampwatch.server.analysis.window import Window
from ampwatch.server.findings.incidents import group_incidents
from ampwatch.server.store.spike_samples import SIGNALS, SpikeWindow
from tests.server.analysis.factories import SETTINGS, context, linear, series, step

N_LAYERS = 4
ATTN, HEAD = 1, 3  # the attention layer and the output layer of these runs


def losses(n: int = 200, seed: int = 0, spikes: dict[int, float] | None = None) -> np.ndarray:
    """A falling noisy loss (2.0 -> 1.5, 3% noise); `spikes`: step -> loss there."""
    rng = np.random.default_rng(seed)
    loss = np.linspace(2.0, 1.5, n) * (1 + 0.03 * rng.standard_normal(n))
    for at, value in (spikes or {}).items():
        loss[at] = value
    return loss


def run_series(loss: np.ndarray, grad_norm: np.ndarray | None = None,
               lr: np.ndarray | None = None):
    grads = np.ones(loss.size) if grad_norm is None else grad_norm
    rates = np.full(loss.size, 1e-3) if lr is None else lr
    return series([step(s, N_LAYERS, loss=float(v), grad_norm=float(g), lr=float(r),
                        scaler=None, loss_scale=None, scale_after=None,
                        autocast_dtype="bfloat16")
                   for s, (v, g, r) in enumerate(zip(loss, grads, rates, strict=True))],
                  N_LAYERS)


def signals(n: int = 200, every: int = 10, **grow: tuple[int, int, float]) -> SpikeWindow:
    """Healthy sampled signals; `grow[name] = (layer, from_step, factor per sample)`."""
    steps = np.arange(0, n, every)
    values = np.full((steps.size, len(SIGNALS), N_LAYERS), np.nan)
    values[:, SIGNALS.index("update_ratio")] = 1e-3
    values[:, SIGNALS.index("adam_eps_share")] = 0.0
    values[:, SIGNALS.index("adam_v_zero_share")] = 0.0
    values[:, SIGNALS.index("attn_max_logit"), ATTN] = 3.0
    values[:, SIGNALS.index("logit_absmax"), HEAD] = 4.0
    values[:, SIGNALS.index("logit_lse"), HEAD] = 3.5
    for name, (layer, start, factor) in grow.items():
        k = SIGNALS.index(name)
        later = steps >= start
        values[later, k, layer] *= factor ** np.arange(1, later.sum() + 1)
    return SpikeWindow(steps, values)


def test_a_noisy_falling_loss_has_no_spike() -> None:
    for seed in range(5):
        loss = losses(seed=seed)
        assert find_spikes(np.arange(loss.size), loss, reference=50, min_history=20,
                           spread_factor=6, min_rise=0.1) == []


def test_a_spike_is_found_with_its_size_and_recovery() -> None:
    loss = losses(spikes={120: 4.0, 121: 3.0})
    (spike,) = find_spikes(np.arange(loss.size), loss, reference=50, min_history=20,
                           spread_factor=6, min_rise=0.1)
    assert (spike.start, spike.end, spike.peak_step, spike.recovered_at) == (120, 121, 120, 122)
    assert spike.ratio == pytest.approx(4.0 / spike.median)
    assert spike.size > 6


def test_a_run_that_breaks_down_is_one_spike_not_recovered() -> None:
    loss = losses()
    loss[150:] = 3.5 + 0.3 * np.sin(np.arange(50))  # wobbles at the broken level
    (spike,) = find_spikes(np.arange(loss.size), loss, reference=50, min_history=20,
                           spread_factor=6, min_rise=0.1)
    assert spike.start == 150 and spike.recovered_at is None


def test_a_spike_starts_where_the_loss_rose_not_where_it_crossed() -> None:
    """A loss that steps up to just under the threshold and crosses it a few steps later
    broke at the step up (the suite's output_divergence run: up 1.5-1.66x from step 77,
    over 6 spreads only at 84): the spike starts there, and its rise is not a reference."""
    loss = losses()
    ref = loss[100:150]
    median = float(np.median(ref))
    spread = 1.4826 * float(np.median(np.abs(ref - median)))
    loss[150:155] = median + 4.5 * spread  # over the end band, under the threshold
    loss[155:160] = median + 10 * spread
    (spike,) = find_spikes(np.arange(loss.size), loss, reference=50, min_history=20,
                           spread_factor=6, min_rise=0.1)
    assert (spike.start, spike.end, spike.recovered_at) == (150, 159, 160)
    assert spike.peak_step == 155 and spike.length == 10
    assert spike.median < median + spread  # five steps of the rise in its reference move it little


def test_a_lone_step_over_the_end_band_before_a_spike_is_not_its_start() -> None:
    """Only the steps right before the crossing belong to it: a step back under the end
    band in between ends the walk back."""
    loss = losses()
    ref = loss[100:150]
    median = float(np.median(ref))
    spread = 1.4826 * float(np.median(np.abs(ref - median)))
    loss[148] = median + 4.5 * spread
    loss[149] = median
    loss[150:153] = median + 10 * spread
    (spike,) = find_spikes(np.arange(loss.size), loss, reference=50, min_history=20,
                           spread_factor=6, min_rise=0.1)
    assert (spike.start, spike.end, spike.recovered_at) == (150, 152, 153)

def starts(loss: np.ndarray) -> list[int]:
    return [s.start for s in find_spikes(np.arange(loss.size), loss, reference=50,
                                         min_history=20, spread_factor=6, min_rise=0.1)]


def test_a_spike_early_in_a_window_shorter_than_the_reference_is_found() -> None:
    """A window that goes on past a spike finds it (batches of any length: the run's
    first batch can hold 45 steps with the spike at 30)."""
    loss = losses(spikes={30: 4.0})
    assert {end: starts(loss[:end]) for end in range(31, 60)} == {
        end: [30] for end in range(31, 60)}


def test_a_window_finds_the_spikes_a_longer_one_finds_up_to_its_end() -> None:
    """Judged as batches arrive or all at once, the same spikes: a loss falling fast that
    jumps 4x and settles above its level before (a learning rate raised for good) is one
    spike in every window that ends after it; the steps that showed it back (under the
    end band, though over 6 spreads around the steep trend) start none of their own."""
    rng = np.random.default_rng(0)
    loss = np.linspace(4.0, 1.0, 160) * (1 + 0.02 * rng.standard_normal(160))
    settle = np.arange(60)
    loss[100:] = 2.2 * (1 + 3 * np.exp(-settle / 6)) * (1 + 0.02 * rng.standard_normal(60))
    assert starts(loss) == [100]
    assert {end: starts(loss[:end]) for end in range(101, 161)} == {
        end: [100] for end in range(101, 161)}


def detect(steps, samples: SpikeWindow):
    return detect_spikes(Window(steps, context(N_LAYERS), spikes=samples), SETTINGS)


def labels(detection) -> dict[str, tuple]:
    return {d.kind: (d.code, d.layer, d.step, d.evidence) for d in detection.drafts}


@pytest.mark.parametrize(("grow", "label", "layer"), [
    ({"attn_max_logit": (ATTN, 100, 2.0)}, "attention_logit_growth", "fc1"),
    ({"logit_lse": (HEAD, 100, 2.0)}, "output_logit_divergence", "fc3"),
    ({"update_ratio": (2, 140, 4.0)}, "update_ratio_spike", "fc2"),
])
def test_a_spike_is_labelled_by_what_grew_before_it(grow, label, layer) -> None:
    loss = losses(spikes={150: 4.0})
    found = detect(run_series(loss), signals(**grow))
    spike = next(d for d in found.drafts if d.kind == "loss_spike")
    assert (spike.code, spike.layer, spike.step, spike.severity) == (label, layer, 150,
                                                                    "warning")
    assert spike.evidence["precursor_step"] < 150
    assert spike.evidence["lead_steps"] == 150 - spike.evidence["precursor_step"]
    assert spike.evidence["fix"] in spike.message


def test_optimizer_states_label_a_spike_and_warn_on_their_own() -> None:
    window = signals()
    window.values[10:, SIGNALS.index("adam_v_zero_share"), 2] = 0.4
    window.values[5:, SIGNALS.index("adam_eps_share"), 0] = 0.9
    found = detect(run_series(losses(spikes={150: 4.0})), window)
    spike = next(d for d in found.drafts if d.kind == "loss_spike")
    assert (spike.code, spike.layer, spike.evidence["precursor_step"]) == (
        "second_moment_underflow", "fc2", 100)
    states = {(d.code, d.layer): d for d in found.drafts if d.kind == "optimizer_state"}
    assert set(states) == {("second_moment_underflow", "fc2"), ("adam_epsilon", "fc0")}
    assert states[("second_moment_underflow", "fc2")].evidence["spike_step"] == 150
    assert "spike_step" not in states[("adam_epsilon", "fc0")].evidence


def test_a_one_step_spike_with_the_grad_norm_is_a_bad_batch() -> None:
    loss = losses(spikes={150: 4.0})
    grads = np.ones(loss.size)
    grads[150] = 5.0
    found = detect(run_series(loss, grads), signals())
    assert labels(found)["loss_spike"][:3] == ("bad_batch", None, 150)
    found = detect(run_series(loss), signals())
    assert labels(found)["loss_spike"][:3] == ("unknown", None, 150)
    assert "seen" in labels(found)["loss_spike"][3]


def test_a_spike_that_follows_a_learning_rate_rise_names_it() -> None:
    """The recorded lr x50 at step 145: named with its values and step, ahead of the update
    ratios it made jump; a gradual schedule (x1.5 over the lookback) is not a change."""
    loss = losses(spikes={150: 4.0})
    lr = np.full(loss.size, 2e-3)
    lr[145:] = 0.1
    found = detect(run_series(loss, lr=lr), signals(update_ratio=(0, 140, 40.0)))
    code, layer, at, evidence = labels(found)["loss_spike"]
    assert (code, layer, at) == ("lr_change", None, 150)
    assert (evidence["lr_before"], evidence["lr_after"], evidence["lr_step"]) == (2e-3, 0.1, 145)
    spike = next(d for d in found.drafts if d.kind == "loss_spike")
    assert "the learning rate rose 50x, from 0.002 to 0.1 at step 145" in spike.message
    gentle = np.linspace(2e-3, 3e-3, loss.size)
    found = detect(run_series(loss, lr=gentle), signals())
    assert labels(found)["loss_spike"][0] == "unknown"


def test_an_update_ratio_jump_in_most_layers_is_the_optimizers_not_one_layers() -> None:
    window = signals()
    ratio = window.values[:, SIGNALS.index("update_ratio")]
    ratio[window.steps >= 140, :3] *= [30.0, 50.0, 40.0]
    found = detect(run_series(losses(spikes={150: 4.0})), window)
    code, layer, _, evidence = labels(found)["loss_spike"]
    assert (code, layer, evidence["layers_jumped"]) == ("update_ratio_all", None, [3, 4])


def test_a_spike_that_never_comes_back_is_critical() -> None:
    loss = losses()
    loss[120:] = 3.5  # broken for the last 80 steps
    found = detect(run_series(loss), signals())
    spike = next(d for d in found.drafts if d.kind == "loss_spike")
    assert spike.severity == "critical" and "not back in 79 steps" in spike.message
    loss = losses()
    loss[180:] = 3.5  # broken, but only 20 steps ago: it may still come back
    spike = next(d for d in detect(run_series(loss), signals()).drafts
                 if d.kind == "loss_spike")
    assert spike.severity == "warning"


def test_a_one_step_jump_whose_tail_settles_is_a_bad_batch_a_ramp_is_not() -> None:
    loss = losses(spikes={150: 6.0})
    loss[152:158] = np.median(loss[100:150]) * 1.3  # the bad step's update, settling
    grads = np.ones(loss.size)
    grads[150] = 5.0
    found = detect(run_series(loss, grads), signals())
    code, _, _, evidence = labels(found)["loss_spike"]
    assert (code, evidence["steps_over"]) == ("bad_batch", 8)
    loss[151:158] = 4.0  # the loss stays up: not one step's jump
    assert labels(detect(run_series(loss, grads), signals()))["loss_spike"][0] == "unknown"


def test_growth_before_any_spike_is_a_precursor_warning() -> None:
    found = detect(run_series(losses()), signals(attn_max_logit=(ATTN, 100, 1.5)))
    (draft,) = found.drafts
    assert (draft.kind, draft.code, draft.layer, draft.severity) == (
        "spike_precursor", "attention_logit_growth", "fc1", "warning")
    # 3.0 * 1.5**k reaches 10x its level (30) at the sixth sample from step 100, bf16's
    # floor (64: half an ulp is a quarter nat there) at the eighth
    assert draft.step == 170 and draft.active
    assert "no loss spike yet" in draft.message
    assert (draft.evidence["computed_in"], draft.evidence["dtype_floor"]) == ("bfloat16", 64)


def precursors(samples: SpikeWindow, autocast: str | None = "bfloat16",
               attn: dict | None = None) -> list[tuple]:
    """(code, layer, step, severity) of each precursor of a spike-free run under
    `autocast` (None: no autocast, and none in its environment); `attn`: the attention
    layer's attrs."""
    steps = series([step(s, N_LAYERS, loss=float(v), scaler=None, loss_scale=None,
                         scale_after=None, autocast_dtype=autocast)
                    for s, v in enumerate(losses())], N_LAYERS)
    layers = [linear(i, **(attn or {}) if i == ATTN else {}) for i in range(N_LAYERS)]
    run = context(layers, environment={"autocast_dtype": autocast})
    found = detect_spikes(Window(steps, run, spikes=samples), SETTINGS)
    return [(d.code, d.layer, d.step, d.severity) for d in found.drafts
            if d.kind == "spike_precursor"]


def logit(values: dict[int, float], name: str = "attn_max_logit",
          layer: int = ATTN) -> SpikeWindow:
    """Healthy signals with `name` of `layer` at 1.0 until a sampled step of `values`
    (step -> value) sets it, kept after it."""
    window = signals()
    column = np.ones(window.steps.size)
    for at, value in values.items():
        column[window.steps >= at] = value
    window.values[:, SIGNALS.index(name), layer] = column
    return window


def test_logits_grown_14x_that_bf16_resolves_are_no_precursor() -> None:
    """A healthy encoder-decoder's logits, 1 -> 14 after the warm-up: 14x its level, but
    bf16 holds 14 to within 0.055 nats (softmax weights off by 6% at most)."""
    assert precursors(logit({100: 10.9, 150: 14.0})) == []
    assert precursors(logit({100: 10.9, 150: 14.0}, "logit_lse", HEAD)) == []


@pytest.mark.parametrize(("autocast", "attn", "values", "at"), [
    # bf16: 2 * 0.25 / 2**-7 = 64; 63.9 is under it, 64 is the first step over
    ("bfloat16", None, {100: 30.0, 130: 63.9, 160: 64.0}, 160),
    # fp16 resolves 64 (512 is its floor): the same growth is nothing, 600 is over
    ("float16", None, {100: 30.0, 130: 64.0, 160: 600.0}, 160),
    # fp16 with 4096-wide heads: q.k before its 1/64 scaling is 65504/2 at 511.75
    ("float16", {"head_dim": 4096}, {100: 30.0, 130: 511.0, 160: 511.75}, 160),
    # no autocast: fp32, where no logit a model reaches is lost to rounding
    (None, None, {100: 30.0, 130: 64.0, 160: 600.0}, None),
    # bf16 autocast, but the attention computes its scores from fp32 q and k
    ("bfloat16", {"logits_in": "float32"}, {100: 30.0, 130: 64.0, 160: 600.0}, None),
    # no autocast, a model cast to fp16 whole: the agent saw q and k meet in fp16
    (None, {"logits_in": "float16"}, {100: 30.0, 130: 64.0, 160: 600.0}, 160),
])
def test_a_precursor_starts_where_its_logit_first_matters_to_its_dtype(
        autocast: str | None, attn: dict | None, values: dict, at: int | None) -> None:
    want = [] if at is None else [("attention_logit_growth", "fc1", at, "warning")]
    assert precursors(logit(values), autocast, attn) == want


def test_an_output_log_partition_is_judged_by_the_same_floor() -> None:
    window = logit({100: 30.0, 130: 63.0, 170: 70.0}, "logit_lse", HEAD)
    assert precursors(window) == [("output_logit_divergence", "fc3", 170, "warning")]
    assert precursors(window, "float16") == []


def test_a_healthy_run_raises_nothing() -> None:
    found = detect(run_series(losses()), signals())
    assert found.drafts == []
    assert "spike_precursor:" in found.covers and "optimizer_state:" in found.covers


def test_the_findings_of_one_spike_are_one_incident() -> None:
    found = detect(run_series(losses(spikes={150: 4.0})),
                          signals(logit_lse=(HEAD, 100, 2.0)))
    rows = [{"id": i, "run_id": "r", "rank": 0, "kind": d.kind, "layer": d.layer,
             "evidence": d.evidence, "status": "open", "severity": d.severity,
             "step": d.step, "last_step": d.last_step} for i, d in enumerate(found.drafts)]
    assert len(rows) == 2
    (incident,) = group_incidents(rows)
    assert incident.cause == "loss_spike" and incident.layer == "fc3"
    assert incident.headline.startswith("Loss spike at step 150")
    assert "z-loss" in incident.fix


def test_logits_and_weights_growing_from_their_init_are_learning_not_a_precursor() -> None:
    """The zoo's GPT-2 bad batch: over the first steps the untrained model's output logits
    (0.6 -> 10) and embedding norm (11x, rising on every sample) grow as it learns; a
    level read there is not one a spike at step 60 is measured against."""
    window = signals(n=90)
    learnt = np.array([0.6, 2.5, 5.3, 7.3, 9.0, 10.2, 10.5, 10.6, 10.6])
    window.values[:, SIGNALS.index("logit_absmax"), HEAD] = learnt
    window.values[:, SIGNALS.index("weight_norm"), 0] = learnt + 0.4
    loss = losses(n=90, spikes={60: 6.0})
    grads = np.ones(loss.size)
    grads[60] = 5.0
    # at Adam's pace: lr 5e-3 moves a 4,160-parameter layer's norm up to 6.5 in ten steps
    rate = np.full(loss.size, 5e-3)
    assert labels(detect(run_series(loss, grads, rate), window))["loss_spike"][:3] == (
        "bad_batch", None, 60)
    # faster than Adam's steps move it (lr 1e-3: 1.3 in ten steps), the weights grew
    assert labels(detect(run_series(loss, grads), window))["loss_spike"][:3] == (
        "weight_jump", "fc0", 60)
    # the same growth after the warm-up (spike_min_history steps), to where fp16 rounds
    # the logits by 0.25 nats or more (512), names the cause
    window.values[:, SIGNALS.index("logit_absmax"), HEAD] = 10.0 * 2.0 ** np.r_[0, 0, :7]
    code, layer, at, evidence = labels(detect(run_series(loss, grads, rate), window))[
        "loss_spike"]
    assert (code, layer, at, evidence["precursor_step"]) == (
        "output_logit_divergence", "fc3", 60, 50)


def test_a_logit_growth_that_does_not_matter_to_its_dtype_names_a_spike_last() -> None:
    """Logits grown 16x after the warm-up, but to 64, which fp16 holds to 0.03 nats: with
    the grad norm jumping with the loss the spike is a bad batch; with nothing else to go
    by, the growth is still the best guess."""
    window = signals(n=90)
    window.values[:, SIGNALS.index("logit_absmax"), HEAD] = 4.0 * 2.0 ** np.r_[0, 0, :7] / 4
    loss = losses(n=90, spikes={60: 6.0})
    grads = np.ones(loss.size)
    grads[60] = 5.0
    assert labels(detect(run_series(loss, grads), window))["loss_spike"][:3] == (
        "bad_batch", None, 60)
    code, layer, at, _ = labels(detect(run_series(loss, np.ones(loss.size)), window))[
        "loss_spike"]
    assert (code, layer, at) == ("output_logit_divergence", "fc3", 60)
    # under fp16 the bad batch's gradients overflowed: the step's grad norm is inf (the
    # scaler skipped it), the largest jump there is
    grads[60] = np.inf
    assert labels(detect(run_series(loss, grads), window))["loss_spike"][:3] == (
        "bad_batch", None, 60)
