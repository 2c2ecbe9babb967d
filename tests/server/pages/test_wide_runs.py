"""The layers page of a 10,000-layer run: paged in forward order, so the page, its JSON
twin and its live update carry LAYERS_PER_PAGE layers whatever the run's width."""

from __future__ import annotations

import pytest

from ampwatch.server.pages.views import LAYERS_PER_PAGE
from tests.utils import make_layers, make_steps, post_batch

N_LAYERS = 10_000
MiB = 1 << 20


@pytest.fixture
def wide_run(api):
    """10,000 layers run in reverse index order (forward_index = N - 1 - index); step 7
    skipped with layer 0's grad norm inf, so the first offender is the last layer in
    forward order."""
    layers = make_layers(N_LAYERS)
    for layer in layers:
        layer["forward_index"] = N_LAYERS - 1 - layer["index"]
    api.put("/api/v1/runs/wide", json={"name": "wide", "layers": layers}).raise_for_status()
    for seq, first in enumerate((0, 10)):
        response = post_batch(api, "wide", seq, make_steps(first, 10, N_LAYERS, skipped={7},
                                                           sample_every=5))
        assert response.status_code == 200, response.text
    return [layer["name"] for layer in reversed(layers)]  # forward order


def test_a_page_holds_its_layers_only(api, wide_run):
    response = api.get("/runs/wide/layers")
    assert response.status_code == 200
    # 10,000 rows of two heatmaps and a table took 78 MB before paging
    assert len(response.content) < 2 * MiB, len(response.content)
    assert "10,000 layers in forward order · 1–200 · page 1 of 50" in response.text
    assert 'rel="next"' in response.text and 'rel="prev"' not in response.text
    assert response.text.count('<tr id="layer-') == LAYERS_PER_PAGE
    assert f'id="layer-{wide_run[0]}"' in response.text
    assert f'id="layer-{wide_run[LAYERS_PER_PAGE]}"' not in response.text


def test_the_twin_reads_the_pages_layers_in_forward_order(api, wide_run):
    twin = api.get("/runs/wide/layers?format=json&page=2").json()
    assert {k: twin["page"][k] for k in ("page", "pages", "per_page", "total", "first")} == {
        "page": 2, "pages": 50, "per_page": LAYERS_PER_PAGE, "total": N_LAYERS, "first": 200}
    names = wide_run[LAYERS_PER_PAGE:2 * LAYERS_PER_PAGE]
    assert [item["name"] for item in twin["layers"]["items"]] == names
    assert twin["grad_norm"]["layers"] == names == twin["act_absmax"]["layers"]
    assert len(twin["grad_norm"]["values"]) == LAYERS_PER_PAGE
    # the same cells as the API's whole-run matrix, rows picked by name
    whole = api.get("/api/v1/runs/wide/layers/matrix?buckets=1000").json()
    row = {name: values for name, values in zip(whole["layers"], whole["values"],
                                                strict=True)}
    assert twin["grad_norm"]["values"] == [row[name] for name in names]
    assert twin["grad_norm"]["step_start"] == whole["step_start"]


def test_past_the_last_page_is_the_last_and_it_marks_the_runs_first_offender(api, wide_run):
    last = api.get("/runs/wide/layers?format=json&page=999").json()
    assert last["page"]["page"] == 50
    assert last["layers"]["items"][-1]["name"] == "blocks.0.fc"
    update = api.get("/runs/wide/layers?format=update&page=50").json()
    traces = [t["name"] for t in update["figures"]["grad_heatmap"]["data"]]
    assert "first offender" in traces
    first = api.get("/runs/wide/layers?format=update&page=1").json()
    assert "first offender" not in [t["name"] for t in first["figures"]["grad_heatmap"]["data"]]
    assert len(first["figures"]["fwd_time"]["data"][0]["x"]) == LAYERS_PER_PAGE
