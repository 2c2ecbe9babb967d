"""Spikes on the pages: the loss chart marks each spike with its label, the layers page
draws the update-ratio and attention-logit heatmaps from the spike samples, and its
twin carries their matrices."""

from __future__ import annotations

from tests.client.test_spikes import N_LAYERS, seed_spike
from tests.utils import make_steps, post_batch, register_run


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
