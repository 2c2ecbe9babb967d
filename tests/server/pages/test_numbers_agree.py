"""Issue #35 point 4: one definition per number. A layer's "non-finite output steps"
counts steps, as its "non-finite grad steps" and the skipped-steps KPI do: the sampled
steps whose output held inf/NaN and the unsampled ones whose every-step forward check
named the layer first (the step an overflow begins is unsampled: sampling turns on after
it, and the column used to read one less than the grad column beside it)."""

from __future__ import annotations

import re

import httpx
import numpy as np

from tests.server.pages.conftest import GROWING_LAYER, FieldRuns
from tests.utils import make_steps, post_batch, register_run


def _cells(html: str, row_id: str) -> list[str]:
    """The text of each numeric cell of the table row `row_id`."""
    row = re.search(rf'<tr id="{re.escape(row_id)}"[^>]*>(.*?)</tr>', html, re.S)
    assert row, f"no row {row_id}"
    return [re.sub(r"<[^>]+>|,", "", cell).strip()
            for cell in re.findall(r'<td class="num[^"]*">(.*?)</td>', row.group(1), re.S)]


def test_overflow_counts_agree(field_runs: FieldRuns) -> None:
    html = httpx.get(f"{field_runs.server.url}/runs/growing-fp16/layers", timeout=30).text
    skipped = re.search(r'<dd id="stat-skipped"[^>]*>([\d,]+)', html)
    assert skipped, "no Skipped KPI"
    kpi = int(skipped.group(1).replace(",", ""))
    # ground truth from the test's own state: the scaler skipped exactly the steps after
    # which it lowered its scale; the hook saw the layer's output hold inf/NaN
    skipped_truth = int((np.diff(field_runs.scales) < 0).sum())
    assert kpi in (skipped_truth, skipped_truth + 1)  # the last step's update is unseen
    _params, grad_steps, output_steps = (int(c) for c in _cells(html, f"layer-{GROWING_LAYER}"))
    assert output_steps == field_runs.output_nonfinite_steps
    # an inf/NaN output makes that step's gradients inf/NaN, which makes the scaler skip
    assert output_steps <= grad_steps <= kpi
    assert "Non-finite output steps" in html


def test_unsampled_first_overflow_counts(api) -> None:
    """A hand-made run through the real API: layer 0's output overflows from step 23 (not
    a sampled step; the agent samples every step after it), layer 1 downstream of it."""
    bad = set(range(23, 33))
    steps = make_steps(0, 60, 3, skipped=bad, sample_every=5)
    for step in steps:
        s = step["step"]
        step["forward_nonfinite"] = s in bad
        step["first_nonfinite_layer"] = 0 if s in bad else None
        if s in bad and s > min(bad):  # sampled through the anomaly window
            step["activations"] = {"absmax": ["Infinity", "NaN", 2.0],
                                   "dtype": ["float16"] * 3, "time_ms": [0.1] * 3}
    register_run(api, "hand", n_layers=3)
    assert post_batch(api, "hand", 0, steps).status_code == 200
    html = api.get("/runs/hand/layers").text
    kpi = int(re.search(r'<dd id="stat-skipped"[^>]*>([\d,]+)', html).group(1))
    first = [int(c) for c in _cells(html, "layer-blocks.0.fc")][1:]
    downstream = [int(c) for c in _cells(html, "layer-blocks.1.fc")][1:]
    assert kpi == len(bad)
    assert first == [len(bad), len(bad)]  # grad steps, output steps: the same steps
    # a later layer's unsampled step is not known: only its sampled ones count
    assert downstream == [0, len(bad) - 1]


def test_scheduler_card_counts_what_the_kpi_counts(api) -> None:
    """A scheduler stepped every step while GradScaler skipped some: the card names the
    steps it judged, counts the skips as the KPI does, and its percentage is the ratio
    its words name."""
    skipped = {40, 41, 42, 90, 150, 199}  # 199: the last step, its scheduler call unseen
    steps = make_steps(0, 200, 3, skipped=skipped)
    for step in steps:
        step["scheduler_steps"] = 1
    register_run(api, "sched", n_layers=3)
    assert post_batch(api, "sched", 0, steps).status_code == 200
    html = api.get("/runs/sched").text
    kpi = int(re.search(r'<dd id="stat-skipped"[^>]*>([\d,]+)', html).group(1))
    [chunk] = [c for c in html.split('<li class="finding')[1:] if "LR scheduler" in c]
    card = re.search(r"LR scheduler stepped on a step GradScaler skipped: ([^;]*);", chunk)
    assert card, "no scheduler card"
    ahead = len(skipped) - 1  # every skip but the last was followed by a scheduler step
    applied = 200 - len(skipped)
    assert kpi == len(skipped)
    assert card.group(1) == (
        f"in steps 0-199 it stepped on {ahead} of the {kpi} skipped steps, so the LR "
        f"schedule ran {ahead} steps ahead of the optimizer, which stepped {applied} "
        f"times ({ahead / applied:.1%} ahead)")
    times = re.search(r'<span class="times"[^>]*>at ([\d,]+) steps</span>', chunk)
    assert times and int(times.group(1)) == ahead


def test_scheduler_card_names_its_window(api) -> None:
    """On a run longer than the analysis window the card's words count the steps they
    name, while its "times" and the KPI count the whole run."""
    skipped = set(range(10, 1100, 7)) | {1099}
    steps = make_steps(0, 1100, 3, skipped=skipped)
    for step in steps:
        step["scheduler_steps"] = 1
    register_run(api, "long", n_layers=3)
    for seq, first in enumerate(range(0, 1100, 250)):
        assert post_batch(api, "long", seq, steps[first:first + 250]).status_code == 200
    html = api.get("/runs/long").text
    kpi = int(re.search(r'<dd id="stat-skipped"[^>]*>([\d,]+)', html).group(1))
    [chunk] = [c for c in html.split('<li class="finding')[1:] if "LR scheduler" in c]
    words = re.search(r"in steps (\d+)-(\d+) it stepped on (\d+) of the (\d+) skipped steps, "
                      r"so the LR schedule ran (\d+) steps ahead of the optimizer, which "
                      r"stepped (\d+) times \(([\d.]+)% ahead\)", chunk)
    assert words, chunk
    first, last, ahead, of, lead, applied, share = (float(g) for g in words.groups())
    window = {s for s in skipped if first <= s <= last}
    assert last == 1099 and first > 0  # a window, not the run, and the words say so
    assert (ahead, of, lead) == (len(window - {1099}), len(window), len(window - {1099}))
    assert applied == last - first + 1 - len(window)
    assert share == round(100 * ahead / applied, 1)
    times = re.search(r'<span class="times"[^>]*>at ([\d,]+) steps</span>', chunk)
    assert kpi == len(skipped)
    assert times and int(times.group(1)) == len(skipped - {1099})
