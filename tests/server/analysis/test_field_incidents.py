"""One incident for one cause on the growing-layer run issue #35 was found on (a 6-Linear
fp16 MLP whose layer "6" has a gain that grows 2.5% a step): the zero gradients of the
layers at and after it, the overflow risk of the ReLU that carries its output on, and the
gradient overflows its growing output caused first (the scaler skipped and fell for the
gradients of the layer it feeds long before the output itself overflowed) join its
incident instead of standing as problems of their own. The truth (the step its output
first held inf/NaN, the steps whose gradients did before it) comes from the test's own
hooks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import LiveServer
from tests.server.pages.training import GrowingGain, Trainer, mlp
from tests.utils import WAIT

GROWING = "6"
ORDER = [str(i) for i in range(11)]  # nn.Sequential: Linears 0, 2, ..., 10, ReLUs between


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    live = LiveServer(f"sqlite:///{tmp_path / 'field.db'}", tmp_path / "server.log")
    live.start()
    yield live
    live.stop()


def test_the_growing_layer_is_one_incident_with_its_symptoms(server) -> None:
    torch.set_num_threads(1)
    model = mlp(seed=0)
    growth = GrowingGain(model, GROWING, start=8.0)  # overflows fp16 near step 400
    grads_bad: list[int] = []  # truth: the steps whose (unscaled) gradients held inf/NaN

    def after_step() -> None:
        if not all(torch.isfinite(p.grad).all() for p in model.parameters()
                   if p.grad is not None):
            grads_bad.append(growth.step)
        growth()

    Trainer(server.url, "growing-fp16", "growing fp16", model, after_step=after_step).train(
        500).close()
    assert growth.first_nonfinite is not None, "the layer never overflowed"
    grads_first = [step for step in grads_bad if step < growth.first_nonfinite]

    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as api:
        findings = api.get("/runs/growing-fp16/findings", params=WAIT).json()["items"]
        incidents = api.get("/runs/growing-fp16/incidents").json()["items"]
    caused = [i for i in incidents if i["cause"] and i["severity"] != "info"]
    assert len(caused) == 1, [i["headline"] for i in caused]
    (incident,) = caused
    assert (incident["cause"], incident["layer"]) == ("forward_overflow", GROWING)
    assert (incident["step"] is not None and incident["step"] <= growth.first_nonfinite)
    assert any(e["step"] == growth.first_nonfinite and e["what"] == "first non-finite step"
               for e in incident["timeline"])
    # the gradients that overflowed while every output was finite are the ones its
    # incident tells, and they are told in it
    grads = [f for f in findings if (f["evidence"] or {}).get("cause") == "grad_overflow"]
    assert min((f["step"] for f in grads if f["kind"] == "nonfinite"), default=None) == (
        grads_first[0] if grads_first else None), (grads_first, grads)
    assert {f["id"] for f in grads} <= set(incident["findings"])
    at_or_after = {f["id"] for f in findings
                   if f["kind"] in ("underflow_risk", "overflow_risk")
                   and ORDER.index(f["layer"]) >= ORDER.index(GROWING)}
    assert at_or_after and at_or_after <= set(incident["findings"])
    # the open problems left apart are only what the data cannot tie to it: zero
    # gradients upstream of it
    apart = [f for f in findings if f["severity"] != "info" and f["status"] == "open"
             and f["id"] not in incident["findings"]]
    assert all(f["kind"] == "underflow_risk"
               and ORDER.index(f["layer"]) < ORDER.index(GROWING) for f in apart), apart
