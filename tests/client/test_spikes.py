"""Loss spikes through the client: `Client.spikes` reads them as `Spike`s with their cause,
`ampwatch show` lists them, and the layer matrix takes the spike signals as metrics."""

from __future__ import annotations

import json

import pytest

from ampwatch.client import Client, Spike
from tests.utils import ANALYSIS_WAIT_S, make_steps, post_batch, register_run

N_LAYERS = 4


def seed_spike(api, run_id: str) -> None:
    """300 steps whose loss jumps 2.5x at step 250 with the grad norm (a bad batch), and
    an update ratio per layer every 10 steps."""
    register_run(api, run_id, N_LAYERS)
    steps = make_steps(0, 300, N_LAYERS)
    for s in steps:
        s["loss"] = 2.0 + 0.02 * ((s["step"] * 7) % 5)
        s["grad_norm"] = 1.0 + 0.05 * ((s["step"] * 3) % 4)
        if s["step"] % 10 == 0:
            s["spikes"] = {"update_ratio": [1e-3] * N_LAYERS}
    steps[250]["loss"], steps[250]["grad_norm"] = 5.0, 6.0
    assert post_batch(api, run_id, 0, steps).status_code == 200


def test_spikes_are_read_with_their_cause(ampwatch, server_api, server) -> None:
    seed_spike(server_api, "spiky")
    with Client(server.url) as client:
        (spike,) = client.spikes("spiky", wait=ANALYSIS_WAIT_S)
        assert not client.spikes("spiky", rank=1)
        matrix = client.layer_matrix("spiky", metric="update_ratio", buckets=3)
    assert isinstance(spike, Spike)
    assert (spike.step, spike.label, spike.recovered_at, spike.peak) == (250, "bad_batch",
                                                                        251, 5.0)
    assert spike.ratio > 2 and spike.fix
    assert matrix.values[0] == pytest.approx([1e-3] * 3)  # stored as float32
    shown = ampwatch("show", "spiky")
    assert shown.code == 0, shown.err
    assert "Loss spikes (1):" in shown.out
    row = shown.out.split("Loss spikes (1):")[1]
    assert "250" in row and "bad_batch" in row and "251" in row
    as_json = json.loads(ampwatch("show", "spiky", "--json").out)
    assert [s["label"] for s in as_json["spikes"]] == ["bad_batch"]


def test_a_run_without_spikes_lists_none(ampwatch) -> None:
    assert "Loss spikes" not in ampwatch("show", "healthy").out
