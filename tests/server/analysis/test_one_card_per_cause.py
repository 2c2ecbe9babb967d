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


def _coded(code: str, found: dict) -> dict:
    return {**found, "code": code}


def _growth(layer: str, step: int, rise: int) -> dict:
    return _coded("weight_growth", finding(
        "weight_jump", step, layer=layer, severity="info", last_step=90, cause="weight_jump",
        growth_step=step, rise_step=rise, carried=[]))


def test_sibling_projections_growing_together_are_one_card_with_their_attention():
    """q_proj and k_proj of one attention, scaled together from step 20, and the logits
    of that attention grown at step 60: one card, on the attention, from step 20."""
    q = _growth("model.layers.1.self_attn.q_proj", 20, 30)
    k = _growth("model.layers.1.self_attn.k_proj", 20, 30)
    logits = _coded("attention_logit_growth", finding(
        "spike_precursor", 60, layer="model.layers.1.self_attn", signal="attn_max_logit"))
    other = _growth("model.layers.0.mlp.down_proj", 40, 50)  # another cause, its own card
    order = {"model.layers.0.mlp.down_proj": 1, "model.layers.1.self_attn.q_proj": 2,
             "model.layers.1.self_attn.k_proj": 3, "model.layers.1.self_attn": 4}
    cards = group_incidents([q, k, logits, other], order)
    (attention,) = [c for c in cards if q["id"] in c.findings]
    assert sorted(attention.findings) == sorted(f["id"] for f in (q, k, logits))
    assert (attention.layer, attention.step, attention.severity) == (
        "model.layers.1.self_attn", 20, "warning")
    assert attention.headline == ("Layers 'k_proj', 'q_proj' of 'model.layers.1.self_attn': "
                                  "their weights grew together from step 20")
    assert len(cards) == 2


def test_gradients_overflowing_behind_a_growing_layer_are_its_card():
    """A router's weights grow from step 20; from step 71 the gradients of a layer before
    it overflow (they flow back through it): one card, the router's."""
    router = _growth("model.layers.0.mlp.gate", 20, 30)
    grads = finding("nonfinite", 71, layer="model.layers.0.self_attn.o_proj",
                    cause="grad_overflow")
    order = {"model.layers.0.self_attn.o_proj": 1, "model.layers.0.mlp.gate": 2}
    (card,) = group_incidents([router, grads], order)
    assert (card.layer, card.step) == ("model.layers.0.mlp.gate", 20)


def test_a_learning_rate_change_is_one_card_with_what_it_grew():
    """The learning rate x50 at step 30: every layer's weights grow from the sample
    before it, the logits follow, the loss spikes at 33. One card, the learning rate."""
    spike = _coded("lr_change", finding(
        "loss_spike", 33, cause="loss_spike", label="lr_change", spike_step=33, lr_step=30,
        lr_before=0.003, lr_after=0.15, lr_factor=50.0, last_step=49))
    grown = [_growth(f"model.layers.{i}.mlp.down_proj", 30, 40) for i in range(3)]
    logits = _coded("attention_logit_growth", finding(
        "spike_precursor", 40, layer="model.layers.0.self_attn", signal="attn_max_logit"))
    earlier = _growth("model.embed_tokens", 0, 10)  # began before the change: its own
    cards = group_incidents([spike, *grown, logits, earlier])
    (lr,) = [c for c in cards if spike["id"] in c.findings]
    assert sorted(lr.findings) == sorted(f["id"] for f in (spike, *grown, logits))
    assert lr.step == 30 and lr.cause == "loss_spike"
    assert "the learning rate rose 50x, from 0.003 to 0.15 at step 30" in lr.headline
    assert earlier["id"] not in lr.findings


def test_gradients_overflowing_on_a_grown_input_are_the_growths_card():
    """fc2 grows from step 0 and fc3's output with it; head, just after fc3, takes its
    weights' gradients on that grown output: they overflow at step 113, one card, fc2's.
    A layer after head, on an input that did not grow, is its own."""
    growth = {**_growth("fc2", 0, 10), "last_step": 219}
    growth["evidence"]["carried"] = ["fc3"]
    head = finding("nonfinite", 113, layer="head", cause="grad_overflow", last_step=216)
    tail = finding("nonfinite", 120, layer="tail", cause="grad_overflow", last_step=216)
    order = {"fc1": 0, "fc2": 1, "fc3": 2, "head": 3, "tail": 4}
    cards = group_incidents([growth, head, tail], order)
    (card,) = [c for c in cards if growth["id"] in c.findings]
    assert sorted(card.findings) == sorted([growth["id"], head["id"]])
    assert (card.cause, card.layer, card.step) == ("weight_jump", "fc2", 0)
    assert len(cards) == 2
