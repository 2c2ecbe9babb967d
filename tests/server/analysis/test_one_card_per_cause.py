"""Issue 58, on hand-made findings (the pure grouping): a consequence folds into the step
or the change that caused it, and one cause seen on several layers is one card."""

from __future__ import annotations

from ampwatch.server.findings.incidents import group_incidents
from tests.server.analysis.test_incidents import finding


def test_weights_poisoned_by_an_applied_nan_step_are_that_steps_incident():
    """A NaN input at step 70 of a bf16 run was applied: every weight is NaN from step 71,
    so the first layer goes non-finite there. One card: the input."""
    bad_input = finding("nonfinite", 70, severity="critical", cause="nonfinite_input",
                        first_applied_step=70)
    poisoned = finding("nonfinite", 71, layer="backbone.layers.0.norm", severity="critical",
                       last_step=99, cause="forward_overflow", first_applied_step=71)
    scaler = finding("scaler_divergence", 72, layer="backbone.layers.0.norm",
                     check="skip_streak", cause="forward_overflow")
    incidents = [i for i in group_incidents([bad_input, poisoned, scaler]) if i.problem]
    assert len(incidents) == 1
    (card,) = incidents
    assert (card.cause, card.step, card.severity) == ("nonfinite_input", 70, "critical")
    assert card.headline == "The input batch holds inf/NaN"
    assert sorted(card.findings) == sorted(f["id"] for f in (bad_input, poisoned, scaler))
    assert "step 70's update" in card.timeline[-1].what


def test_what_came_before_the_applied_step_or_was_skipped_stays_its_own():
    """Only a step whose update was applied poisons the weights; an overflow before it,
    or a NaN the scaler skipped, explains nothing after it."""
    earlier = finding("nonfinite", 5, layer="fc1", cause="forward_overflow")
    skipped = finding("nonfinite", 20, severity="warning", cause="nonfinite_input")
    later = finding("nonfinite", 30, layer="fc2", cause="forward_overflow")
    incidents = group_incidents([earlier, skipped, later])
    assert len(incidents) == 3
