"""Grouping findings into incidents, on hand-made findings (the pure function) and over
the API on a real server (the route, the `incident` field and the run's counts)."""

from __future__ import annotations

import itertools

from ampwatch.server.findings.incidents import group_incidents, incident_of, root_cause
from tests.utils import make_steps, post_batch, register_run

_ids = itertools.count(1)


def finding(kind: str, step: int | None, *, layer: str | None = None, severity="warning",
            status="open", rank=0, run_id="r", last_step=None, **evidence) -> dict:
    return {"id": next(_ids), "run_id": run_id, "kind": kind, "rank": rank, "step": step,
            "last_step": last_step, "layer": layer, "severity": severity, "status": status,
            "evidence": evidence}


def overflow_story(layer: str = "boom", **common) -> list[dict]:
    """The four findings of one layer overflowing fp16, as the detectors write them."""
    return [
        finding("scaler_divergence", 160, layer=layer, severity="critical", last_step=499,
                check="scale_collapse", cause="forward_overflow", **common),
        finding("scaler_divergence", 147, layer=layer, severity="critical", last_step=499,
                check="skip_streak", cause="forward_overflow", **common),
        finding("nonfinite", 145, layer=layer, severity="warning", last_step=499,
                cause="forward_overflow", first_nonfinite_layer=layer, **common),
        finding("overflow_risk", 134, layer=layer, severity="warning", last_step=140,
                **common),
    ]


def test_one_layer_overflowing_is_one_incident_with_its_timeline():
    story = overflow_story()
    small_model = finding("pitfall", 0, severity="info", code="small_model")
    incidents = group_incidents([*story, small_model])
    assert len(incidents) == 2
    boom, note = incidents
    assert (boom.cause, boom.layer, boom.severity, boom.status) == (
        "forward_overflow", "boom", "critical", "open")
    assert (boom.step, boom.last_step) == (134, 499)
    assert boom.headline == "Layer 'boom' overflows fp16 in the forward pass"
    assert boom.fix.startswith("Run it in fp32 (torch.autocast(device_type, enabled=False)")
    assert [(e.step, e.what) for e in boom.timeline] == [
        (134, "outputs close to fp16's maximum"), (145, "first non-finite step"),
        (147, "steps skipped in a row"), (160, "loss scale at or below 1")]
    assert sorted(boom.findings) == sorted(f["id"] for f in story)
    assert boom.id == min(f["id"] for f in story) and boom.problem
    assert note.findings == [small_model["id"]] and note.headline is None
    assert not note.problem  # info: a note, not a problem
    assert incident_of(incidents)[story[2]["id"]] == boom.id


def test_different_layers_causes_and_ranks_are_different_incidents():
    a = overflow_story("a")
    b = overflow_story("b")
    other_rank = overflow_story("a", rank=1)
    loss = finding("nonfinite", 10, cause="nonfinite_loss")
    no_cause = finding("scaler_divergence", 5, check="skip_ratio")
    incidents = group_incidents([*a, *b, *other_rank, loss, no_cause])
    assert len(incidents) == 5
    assert {(i.rank, i.layer) for i in incidents if i.cause == "forward_overflow"} == {
        (0, "a"), (0, "b"), (1, "a")}
    assert root_cause(no_cause) is None
    assert next(i for i in incidents if i.cause == "nonfinite_loss").headline == \
        "The loss is inf/NaN"


def test_an_incident_is_open_while_any_finding_is_and_takes_the_worst_open_severity():
    resolved_critical = finding("scaler_divergence", 50, layer="x", severity="critical",
                                status="resolved", check="skip_streak",
                                cause="forward_overflow")
    open_warning = finding("nonfinite", 40, layer="x", cause="forward_overflow")
    (incident,) = group_incidents([resolved_critical, open_warning])
    assert (incident.status, incident.severity) == ("open", "warning")
    open_warning["status"] = "resolved"
    (incident,) = group_incidents([resolved_critical, open_warning])
    assert (incident.status, incident.severity) == ("resolved", "critical")


def test_misaligned_dimensions_are_one_incident_with_one_fix():
    dims = [finding("misaligned_layer", None, layer=layer, severity=severity,
                    dimension=dim, value=value, padded=104, multiple=8, flops_share=share)
            for layer, dim, value, severity, share in (
                ("embed", "out_features", 100, "info", 0.01),
                ("blocks.0.fc", "in_features", 100, "warning", 0.3),
                ("blocks.0.fc", "out_features", 100, "warning", 0.3))]
    (incident,) = group_incidents(dims)
    assert incident.headline == "3 dimensions of 2 layers misaligned for tensor cores"
    assert incident.severity == "warning" and incident.layer is None
    assert "multiple of 8" in incident.fix
    assert incident.timeline[-1].what == "embed: out features 100 -> 104"  # smallest share


def test_incidents_order_open_first_then_most_severe():
    late_critical = finding("scaler_divergence", 90, severity="critical", check="skip_streak",
                            cause="nonfinite_loss")
    early_warning = finding("overflow_risk", 10, layer="y")
    resolved = finding("nonfinite", 1, status="resolved", cause="nonfinite_input")
    order = [i.findings for i in group_incidents([resolved, early_warning, late_critical])]
    assert order == [[late_critical["id"]], [early_warning["id"]], [resolved["id"]]]


def test_an_absorbed_overflow_and_the_overflow_that_follows_are_one_incident():
    absorbed = finding("nonfinite", 145, layer="boom", last_step=145, cause="absorbed_overflow")
    reached = finding("nonfinite", 146, layer="boom", severity="critical", last_step=170,
                      cause="forward_overflow")
    streak = finding("scaler_divergence", 147, layer="boom", severity="critical",
                     last_step=170, check="skip_streak", cause="forward_overflow")
    (incident,) = group_incidents([streak, reached, absorbed])
    assert (incident.cause, incident.layer, incident.severity) == (
        "forward_overflow", "boom", "critical")
    assert incident.headline == "Layer 'boom' overflows fp16 in the forward pass"
    assert incident.step == 145 and incident.timeline[0].finding == absorbed["id"]
    # until it reaches the loss, it is told as absorbed
    (early,) = group_incidents([absorbed])
    assert early.cause == "absorbed_overflow" and "silently clipped" in early.headline


ORDER = {"0": 0, "2": 1, "4": 2, "6": 3, "8": 4}


def zeros(layer: str, step: int, **common) -> dict:
    return finding("underflow_risk", step, layer=layer, last_step=step + 100, **common)


def test_zero_gradients_after_an_overflowing_layer_are_its_symptoms():
    story = overflow_story("6")  # first sign at step 134
    downstream, itself = zeros("8", 150), zeros("6", 140)
    # zero gradients show long before the overflow when the scaler fell for it (the
    # growing layer's gradients overflowed first)
    early = zeros("8", 20, rank=0)
    upstream = zeros("2", 150)  # before the overflowing layer: not known to be its symptom
    other_rank = zeros("8", 150, rank=1)
    incidents = group_incidents([*story, downstream, itself, early, upstream, other_rank],
                                ORDER)
    overflow = next(i for i in incidents if i.cause == "forward_overflow")
    assert sorted(overflow.findings) == sorted(
        [f["id"] for f in story] + [downstream["id"], itself["id"], early["id"]])
    assert overflow.layer == "6" and overflow.step == 20
    assert "in layer '8'" in next(e.what for e in overflow.timeline
                                   if e.finding == downstream["id"])
    alone = [i.findings for i in incidents if i.cause is None]
    assert sorted(alone) == sorted([[upstream["id"]], [other_rank["id"]]])
    # without the layer order only the layer's own zero gradients are known to follow it
    unordered = group_incidents([*story, downstream, itself])
    assert len(unordered) == 2


def test_the_risk_of_a_layer_that_carries_an_overflow_on_joins_it():
    story = overflow_story("6")
    carried = finding("overflow_risk", 134, layer="8", last_step=140)
    (incident,) = group_incidents([*story, carried], ORDER)
    assert incident.layer == "6" and carried["id"] in incident.findings
    # a risk that began first, or next to a layer that never went non-finite, is its own
    first = finding("overflow_risk", 100, layer="8", last_step=140)
    assert len(group_incidents([*story, first], ORDER)) == 2
    risk_only = finding("overflow_risk", 134, layer="6", last_step=140)
    assert len(group_incidents([risk_only, carried], ORDER)) == 2


def test_zero_gradients_join_the_nearest_overflowing_layer_before_them():
    first, second = overflow_story("2"), overflow_story("6")
    symptom = zeros("8", 200)
    incidents = group_incidents([*first, *second, symptom], ORDER)
    owner = next(i for i in incidents if symptom["id"] in i.findings)
    assert owner.layer == "6" and len(incidents) == 2


def test_api_groups_a_runs_findings_and_counts_incidents(api):
    register_run(api, "grouped", n_layers=3)
    steps = make_steps(0, 400, 3, sample_every=1)
    for step in steps[200:]:  # layer 1's output and the loss go inf from step 200 on
        step.update(skipped=True, loss="Infinity", grad_norm="Infinity",
                    loss_scale=2.0 ** max(16 - (step["step"] - 199), -10),
                    layer_grad_norm=["Infinity"] * 3)
        step["activations"]["absmax"] = [1.0, "Infinity", "Infinity"]
    for seq, first in enumerate(range(0, 400, 100)):
        assert post_batch(api, "grouped", seq, steps[first:first + 100]).status_code == 200
    findings = api.get("/api/v1/runs/grouped/findings?status=open").json()["items"]
    incidents = api.get("/api/v1/runs/grouped/incidents?status=open").json()["items"]
    assert len(findings) > len(incidents) >= 1
    assert {f["incident"] for f in findings} == {i["id"] for i in incidents}
    head = incidents[0]
    assert head["cause"] == "forward_overflow" and head["severity"] == "critical"
    assert head["headline"].startswith("Layer ") and head["problem"] is True
    assert [e["step"] for e in head["timeline"]] == sorted(e["step"] for e in head["timeline"])
    run = api.get("/api/v1/runs/grouped").json()
    assert run["open_problems"] == sum(i["problem"] for i in incidents)
    assert run["open_findings"] == len(findings)
    listed = next(r for r in api.get("/api/v1/runs").json()["items"] if r["id"] == "grouped")
    assert listed["open_problems"] == run["open_problems"]
    assert api.get("/api/v1/runs/nope/incidents").status_code == 404
    # the detach's batch holds no steps: it ends the run, not the problems
    finished = [{"step": None, "kind": "finished", "detail": {}}]
    assert post_batch(api, "grouped", 4, [], events=finished).status_code == 200
    after = api.get("/api/v1/runs/grouped/findings?status=open").json()["items"]
    assert [f["id"] for f in after] == [f["id"] for f in findings]


def grad_overflow(layer: str, step: int, last_step: int, **common) -> list[dict]:
    """A gradient overflow the scaler skipped, and the scale decline it caused."""
    return [finding("nonfinite", step, layer=layer, severity="info", status="resolved",
                    last_step=last_step, cause="grad_overflow", **common),
            finding("scaler_divergence", step + 40, layer=layer, status="resolved",
                    last_step=last_step + 100, check="scale_decline", cause="grad_overflow",
                    **common)]


def test_gradient_overflows_the_overflowing_layer_fed_join_it():
    story = overflow_story("6")  # first non-finite at 145, last at 499
    # the scaler fell for the gradients of the layer fed by "6" long before "6" overflowed
    fed = grad_overflow("8", 20, 60)
    (incident,) = group_incidents([*story, *fed], ORDER)
    assert (incident.cause, incident.layer, incident.step) == ("forward_overflow", "6", 20)
    assert sorted(incident.findings) == sorted(f["id"] for f in [*story, *fed])
    what = {e.finding: e.what for e in incident.timeline}
    assert what[fed[0]["id"]] == "gradients inf/NaN in layer '8'"
    assert what[story[2]["id"]] == "first non-finite step"
    # its own gradients too, also without the order
    (itself,) = group_incidents([*story, *grad_overflow("6", 20, 60)])
    assert itself.layer == "6"


def test_gradient_overflows_the_data_cannot_tie_to_an_overflow_stay_apart():
    story = overflow_story("6")
    upstream = grad_overflow("2", 20, 60)  # before the overflowing layer in forward order
    other_rank = grad_overflow("8", 20, 60, rank=1)
    after = grad_overflow("8", 600, 620)  # began after the overflow's last non-finite step
    incidents = group_incidents([*story, *upstream, *other_rank, *after], ORDER)
    assert len(incidents) == 4
    grads = [i for i in incidents if i.cause == "grad_overflow"]
    assert sorted(i.findings for i in grads) == sorted(
        [f["id"] for f in g] for g in (upstream, other_rank, after))
    # next to a layer that only came close to fp16's maximum, nothing is known to follow it
    risk_only = finding("overflow_risk", 10, layer="6", last_step=140)
    assert len(group_incidents([risk_only, *grad_overflow("8", 20, 60)], ORDER)) == 2
    # without the layer order, another layer's gradients are not known to be fed by it
    assert len(group_incidents([*story, *grad_overflow("8", 20, 60)])) == 2


def test_an_overflowing_layer_absorbs_the_output_logits_it_pushed_up():
    """A layer overflowing fp16 pushes the logits after it up: the head's log-partition
    precursor (begun no earlier) is part of its story; one begun before it is not."""
    story = overflow_story("fc2")
    pushed = finding("spike_precursor", 150, layer="head", code="output_logit_divergence")
    earlier = finding("spike_precursor", 100, layer="head", code="attention_logit_growth")
    order = {"fc1": 0, "fc2": 1, "head": 2}
    incidents = group_incidents([*story, pushed, earlier], order)
    boom = next(i for i in incidents if i.cause == "forward_overflow")
    assert pushed["id"] in boom.findings and earlier["id"] not in boom.findings
    assert len(incidents) == 2


def test_a_risk_alone_reads_approaching_in_the_headline_every_surface_shows():
    """The incident's headline is the one wording the API, the card and `ampwatch show`
    print: a layer close to fp16's maximum is approaching it, not overflowing."""
    risk = finding("overflow_risk", 134, layer="fc2", absmax=40000.0, limit=65504.0)
    (incident,) = group_incidents([risk])
    assert incident.headline == "Layer 'fc2' is approaching fp16's maximum: 4.0e4 of 65504"
    story = overflow_story("fc2")
    (incident,) = group_incidents(story)
    assert incident.headline == "Layer 'fc2' overflows fp16 in the forward pass"


def test_what_follows_a_weight_jump_joins_it_as_kinds_py_declares():
    """fc2's weights x1e4 at step 40 (sampled at 30 and 40): the head's overflow and the
    loss spike after it join fc2's incident, titled by the step the weights moved; a bad
    input (a cause weights cannot set off) and a pitfall (a kind that declares no
    `follows`) stay apart, and so does what began before the jump."""
    jump = {**finding("weight_jump", 40, layer="fc2", severity="critical", last_step=90,
                      cause="weight_jump", before_step=30, jump_step=40), "code": "weight_jump"}
    overflow = finding("nonfinite", 41, layer="head", cause="forward_overflow")
    spike = finding("loss_spike", 40, cause="loss_spike", spike_step=40)
    bad_input = finding("nonfinite", 50, cause="nonfinite_input")
    pitfall = {**finding("pitfall", 45), "code": "clip_before_unscale"}
    before = finding("nonfinite", 20, layer="fc1", cause="grad_overflow")
    order = {"fc1": 0, "fc2": 1, "fc3": 2, "head": 3}
    incidents = group_incidents([jump, overflow, spike, bad_input, pitfall, before], order)
    weights = next(i for i in incidents if i.cause == "weight_jump")
    assert sorted(weights.findings) == sorted(f["id"] for f in (jump, overflow, spike))
    assert weights.headline == "The weights of layer 'fc2' jumped at step 40"
    assert len(incidents) == 4


def test_a_growth_takes_in_only_what_broke_where_outputs_grew_with_it():
    """A slow growth of the embedding's weights (info) whose outputs grew downstream in
    h.0 only: h.0's overflow joins it, and its incident takes the overflow's severity;
    h.5's attention-logit precursor (h.5's outputs did not grow with it) and a spike that
    names no layer stay incidents of their own, so the card does not blame the embedding."""
    growth = {**finding("weight_jump", 0, layer="wte", severity="info", last_step=900,
                        cause="weight_jump", growth_step=0, carried=["h.0"]),
              "code": "weight_growth"}
    overflow = finding("nonfinite", 400, layer="h.0", cause="forward_overflow")
    precursor = {**finding("spike_precursor", 500, layer="h.5", cause="loss_spike",
                           spike_step=510), "code": "attention_logit_growth"}
    spike = finding("loss_spike", 700, cause="loss_spike", spike_step=700)
    order = {"wte": 0, "h.0": 1, "h.5": 2}
    incidents = group_incidents([growth, overflow, precursor, spike], order)
    grown = next(i for i in incidents if i.cause == "weight_jump")
    assert sorted(grown.findings) == sorted(f["id"] for f in (growth, overflow))
    assert (grown.severity, grown.headline) == (
        "warning", "The weights of layer 'wte' grew from step 0")
    assert len(incidents) == 3


def test_a_timeline_names_one_step_first():
    """An overflow that resolved and came back is one incident whose timeline says
    "first non-finite step" once, then "non-finite again" (issue #59)."""
    first = finding("nonfinite", 145, layer="boom", status="resolved", last_step=150,
                    cause="forward_overflow")
    again = finding("nonfinite", 300, layer="boom", cause="forward_overflow")
    [incident] = group_incidents([again, first])
    assert [(e.step, e.what) for e in incident.timeline] == [
        (145, "first non-finite step"), (300, "non-finite again")]
