"""An incident's fix told by the bisect verdict of its bundle (the pure function): the
replay's own finding replaces a remedy it may refute, on the incident the bundle belongs
to only."""

from __future__ import annotations

from ampwatch.server.findings.bisect_verdicts import with_verdicts
from ampwatch.server.findings.incidents import group_incidents
from tests.server.analysis.test_incidents import finding, overflow_story

RAN = {"trials": 2, "ran_at": "2026-11-29T10:00:00+00:00", "device": "cpu"}


def _story() -> list:
    """boom overflows fp16 from step 145 (its fix: fp32 or bf16), a note at step 0."""
    return group_incidents([*overflow_story(),
                            finding("pitfall", 0, severity="info", code="small_model")])


def _fix(incidents: list, cause: str | None) -> str | None:
    return next(i.fix for i in incidents if i.cause == cause)


def test_a_verdict_that_the_precision_is_not_the_cause_replaces_the_upcast():
    before = _fix(_story(), "forward_overflow")
    assert "fp32" in before and "bf16" in before  # the remedy the replay refutes
    incidents = with_verdicts(_story(), [{"rank": 0, "step": 150, "bisect": {
        "verdict": "not_precision", **RAN}}])
    assert _fix(incidents, "forward_overflow") == (
        "Replaying step 150 with every layer in fp32 still fails (ampwatch replay "
        "--bisect, reported by an unnamed sender without a token, unverified): the cause "
        "is not the precision; check the weights of layer 'boom' and the learning rate, "
        "then the data.")
    assert _fix(incidents, None) is None  # the note's own words stay


def test_a_spike_finite_in_fp32_is_not_told_it_fails():
    incidents = with_verdicts(_story(), [{"rank": 0, "step": 150, "trigger": "loss_spike",
                                          "bisect": {"verdict": "not_precision", **RAN}}])
    assert _fix(incidents, "forward_overflow") == (
        "Replaying step 150 with every layer in fp32 is finite but still spikes: it was "
        "flagged as a loss spike, not an overflow (ampwatch replay --bisect, reported by an "
        "unnamed sender without a token, unverified): the cause is not the precision; check "
        "the weights of layer 'boom' and the learning rate, then the data.")


def test_a_verdict_that_names_the_upcast_says_exactly_that_upcast():
    incidents = with_verdicts(_story(), [{"rank": 0, "step": 145, "bisect": {
        "verdict": "fixed", "modules": ["blocks.3.attn", "inp"], "fp8_modules": ["inp"],
        "source": "ampwatch replay 0.1.0 on gpu-box", "token": "1a2b3c4d", **RAN}}])
    assert _fix(incidents, "forward_overflow") == (
        "Keep 'blocks.3.attn' in fp32 and keep 'inp' out of FP8 "
        "(convert_to_float8_training's module_filter_fn): replaying step 145 so makes it "
        "finite (ampwatch replay --bisect, reported by ampwatch replay 0.1.0 on gpu-box "
        "with the server's token 1a2b3c4d; it prints the code to paste).")


def test_a_verdict_the_incident_does_not_own_changes_nothing():
    before = _fix(_story(), "forward_overflow")
    for bundle in ({"rank": 1, "step": 150},  # another rank's
                   {"rank": 0, "step": 100},  # before the incident began
                   {"rank": 0, "step": 150, "not_reproduced": True}):
        verdict = "not_reproduced" if bundle.pop("not_reproduced", False) else "not_precision"
        incidents = with_verdicts(_story(), [{**bundle, "bisect": {"verdict": verdict,
                                                                   **RAN}}])
        assert _fix(incidents, "forward_overflow") == before, bundle
    assert _fix(with_verdicts(_story(), [{"rank": 0, "step": 150, "bisect": None}]),
                "forward_overflow") == before
