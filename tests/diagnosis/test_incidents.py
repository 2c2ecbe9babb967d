"""One cause, one incident, on real training: a layer whose output grows until fp16
overflows, first absorbed by the ReLU after it and then reaching the loss, is one
incident whose timeline begins with the absorbed overflow. The truth (which step's
overflow was absorbed, which reached the loss) comes from the test's own hooks."""

from __future__ import annotations

import httpx

from tests.diagnosis.scenarios import Scenario, growing_until_absorbed, train
from tests.utils import WAIT

GROWING = Scenario("growing_until_absorbed", "gain's output grows 8% a step; -inf first",
                   inject=growing_until_absorbed, stop_after_skips=4, steps=120,
                   check_outputs="every_step")  # absorbed overflows: every output read


def test_a_growing_layer_is_one_incident_from_its_absorbed_overflow(server) -> None:
    run_id, truth = train(GROWING, server.url)
    bad = [(i, s) for i, s in enumerate(truth.steps) if s.first_bad_layer is not None]
    assert {s.first_bad_layer for _, s in bad} == {"gain"}
    absorbed = [i for i, s in bad if not (s.skipped or s.loss_bad or s.grad_bad_layers)]
    reached = [i for i, s in bad if s.loss_bad]
    assert absorbed and reached and absorbed[0] < reached[0], "the scenario did not happen"

    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as api:
        findings = api.get(f"/runs/{run_id}/findings", params=WAIT).json()["items"]
        incidents = api.get(f"/runs/{run_id}/incidents").json()["items"]
    serious = [i for i in incidents if i["severity"] != "info"]
    assert len(serious) == 1, [i["headline"] for i in serious]
    (incident,) = serious
    assert (incident["cause"], incident["layer"]) == ("forward_overflow", "gain")
    assert {f["id"] for f in findings if f["severity"] != "info"} <= set(incident["findings"])
    timeline = [(e["step"], e["what"]) for e in incident["timeline"]]
    nonfinite = [step for step, what in timeline
                 if what in ("first non-finite step", "non-finite again")]
    assert nonfinite[0] == absorbed[0] and reached[0] in nonfinite, timeline
