"""Spikes on the pages: the loss chart marks each spike with its label, the layers page
draws the update-ratio and attention-logit heatmaps from the spike samples, and its
twin carries their matrices."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from ampwatch.server.analysis.spikes import CAUSE_WORDS
from tests.client.test_spikes import N_LAYERS, seed_spike
from tests.conftest import LiveServer, module_server
from tests.server.pages.conftest import open_browser
from tests.utils import WAIT, make_steps, post_batch, register_run


def test_the_loss_chart_marks_each_spike_with_its_label(api) -> None:
    seed_spike(api, "spiky")
    loss = api.get("/runs/spiky?format=update").json()["figures"]["loss"]
    lines = [s for s in loss["layout"]["shapes"] if s.get("x0") == 250]
    assert len(lines) == 1 and lines[0]["x1"] == 250
    assert [a["text"] for a in loss["layout"]["annotations"]] == ["bad_batch"]
    assert loss["layout"]["annotations"][0]["hovertext"].startswith("bad_batch")


def test_a_run_without_spikes_has_no_marks(api) -> None:
    register_run(api, "calm", N_LAYERS)
    post_batch(api, "calm", 0, make_steps(0, 300, N_LAYERS))
    loss = api.get("/runs/calm?format=update").json()["figures"]["loss"]
    assert not loss["layout"].get("shapes")


def test_the_layers_page_draws_the_spike_heatmaps(api) -> None:
    seed_spike(api, "spiky-layers")
    answer = api.get("/runs/spiky-layers/layers")
    assert answer.status_code == 200
    assert 'id="fig-update_ratio_heatmap"' in answer.text
    assert 'id="fig-attn_max_logit_heatmap"' in answer.text
    update = api.get("/runs/spiky-layers/layers?format=update").json()["figures"]
    ratio = update["update_ratio_heatmap"]
    heat = next(t for t in ratio["data"] if t["type"] == "heatmap")
    assert len(heat["y"]) == N_LAYERS
    logits = update["attn_max_logit_heatmap"]
    assert "no max attention logit recorded" in str(logits["layout"]["annotations"])
    twin = api.get("/runs/spiky-layers/layers?format=json").json()
    assert twin["update_ratio"]["metric"] == "update_ratio"
    assert len(twin["update_ratio"]["values"]) == N_LAYERS


def plotted(values) -> list[float]:
    """A figure's array as the page receives it: plotly's typed array (dtype, base64)."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), values["dtype"]).tolist()
    return list(values)


def test_the_layer_view_draws_the_evidence_the_run_sent_and_no_empty_panel(api) -> None:
    register_run(api, "evidence", N_LAYERS)
    steps = make_steps(0, 100, N_LAYERS)  # no activation samples: no zero-grad share
    for s in steps:
        if s["step"] % 10 == 0:
            s["spikes"] = {"update_ratio": [1e-3 * (1 + s["step"] // 10), *[None] * 3],
                           "adam_eps_share": [0.25, *[None] * 3],
                           "attn_max_logit": [None, 30.0 + s["step"], None, None]}
    assert post_batch(api, "evidence", 0, steps).status_code == 200
    first = api.get("/runs/evidence/layers/0?format=update").json()["figures"]
    assert set(first) == {"layer_grad", "layer_act", "layer_update", "layer_optimizer"}
    ratio = first["layer_update"]["data"][0]
    # one point per sample, each at the first step of its bucket (the run's 10 samples
    # fall in 10 buckets over steps 0-99)
    xs = plotted(ratio["x"])
    assert len(xs) == 10 and all(abs(x - 10 * i) < 10 for i, x in enumerate(xs)), xs
    assert plotted(ratio["y"]) == pytest.approx([1e-3 * k for k in range(1, 11)], rel=1e-6)
    (eps,) = first["layer_optimizer"]["data"]
    assert eps["name"] == "v under eps" and set(plotted(eps["y"])) == {25.0}
    second = api.get("/runs/evidence/layers/1?format=update").json()["figures"]
    assert set(second) == {"layer_grad", "layer_act", "layer_attn"}  # an attention layer
    assert plotted(second["layer_attn"]["data"][0]["y"]) == pytest.approx([30.0 + s for s in
                                                                  range(0, 100, 10)])
    page = api.get("/runs/evidence/layers/0").text
    assert "Update ratio" in page and "Zero grad elements" not in page


# each drawn spike label's box and its chart's, in page pixels
LABEL_BOXES = """() => Array.from(document.querySelectorAll('#fig-loss .annotation')).map(a => {
    const svg = document.querySelector('#fig-loss .main-svg').getBoundingClientRect();
    const box = a.getBoundingClientRect();
    return {text: a.textContent, box: [box.left, box.top, box.right, box.bottom],
            chart: [svg.left, svg.top, svg.right, svg.bottom]}; })"""


@pytest.fixture(scope="module")
def spike_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "spike-labels")


@pytest.mark.browser
@pytest.mark.parametrize("width", [1366, 800])
def test_every_spike_label_fits_in_its_chart(chromium, spike_server, tmp_path, width) -> None:
    """The rotated label at a spike is drawn whole, at both widths, even the longest label
    a spike can get (issue 50: "ike (model.layers.0.post_..." was clipped)."""
    run_id = f"spiky-label-{width}"
    with httpx.Client(base_url=spike_server.url, timeout=30) as api:
        seed_spike(api, run_id)
        spikes = api.get(f"/api/v1/runs/{run_id}/findings",
                         params={"kind": "loss_spike", **WAIT}).json()["items"]
    assert [f["step"] for f in spikes] == [250]
    browser = open_browser(chromium, spike_server.url, tmp_path, width=width)
    try:
        browser.goto(f"/runs/{run_id}")
        browser.wait_for_plots("loss")
        (drawn,) = browser.page.evaluate(LABEL_BOXES)
        assert drawn["text"] == "bad_batch"
        longest = max(CAUSE_WORDS, key=len)
        browser.page.evaluate("t => Plotly.relayout('fig-loss', {'annotations[0].text': t})",
                              longest)
        for label in browser.page.evaluate(LABEL_BOXES):
            assert label["text"] == longest
            left, top, right, bottom = label["box"]
            c_left, c_top, c_right, c_bottom = label["chart"]
            assert c_left <= left and right <= c_right and c_top <= top and bottom <= c_bottom, (
                width, label)
        browser.page.screenshot(path=str(tmp_path / f"spike-label-{width}.png"))
        assert not browser.errors
    finally:
        browser.page.context.close()
