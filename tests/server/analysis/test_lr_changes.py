"""A learning-rate change as a note of its own, on hand-made steps: where it is (the exact
step), what is not one (a warmup ramp, a rise from 0, a fall, a schedule's decay), and how
it tells the weights it set growing (one card)."""

from __future__ import annotations

import pytest

from ampwatch.server.analysis.lr_changes import detect_lr_changes
from ampwatch.server.analysis.settings import AnalysisSettings
from ampwatch.server.analysis.window import Window
from ampwatch.server.findings.incidents import group_incidents
from tests.server.analysis.factories import context, series, step
from tests.server.analysis.test_incidents import finding

SETTINGS = AnalysisSettings()


def _changes(lrs: list[float | None], batch: int = 100) -> list:
    steps = [step(s, lr=lr) for s, lr in enumerate(lrs)]
    return detect_lr_changes(Window(series(steps, batch=batch), context()), SETTINGS).drafts


def test_a_50x_rise_is_a_note_at_its_exact_step():
    lrs = [1e-4] * 101 + [5e-3] * 40
    (draft,) = _changes(lrs)
    assert (draft.kind, draft.code, draft.step, draft.severity, draft.layer) == (
        "lr_change", "lr_change", 101, "info", None)
    assert draft.evidence["lr_before"] == 1e-4 and draft.evidence["lr_after"] == 5e-3
    assert draft.evidence["lr_factor"] == pytest.approx(50.0)
    assert draft.message.startswith("The learning rate rose 50x at step 101, from 0.0001 "
                                    "to 0.005.")
    assert draft.active  # the rate stays up


@pytest.mark.parametrize("batch", [1, 7, 100])
def test_the_change_is_the_same_whatever_the_batches(batch):
    lrs = [1e-4] * 30 + [1e-3] * 30
    assert [(d.step, d.key) for d in _changes(lrs, batch)] == [(30, "lr_change:30")]


@pytest.mark.parametrize(("name", "lrs"), [
    ("linear warmup from 0", [1e-3 * min(s, 100) / 100 for s in range(200)]),
    ("linear warmup from lr/100", [1e-3 * min(s + 1, 100) / 100 for s in range(200)]),
    ("one-cycle", [1e-3 / 25 * (1 + 24 * min(s, 50) / 50) for s in range(100)]),
    ("step decay", [1e-3 * 0.1 ** (s // 30) for s in range(100)]),
    ("constant", [1e-3] * 100),
    ("not recorded", [None] * 100),
])
def test_a_schedule_is_no_change(name, lrs):
    assert _changes(lrs) == [], name


def test_a_rate_that_falls_back_resolves_and_gaps_in_the_record_are_skipped():
    lrs = [1e-4] * 20 + [None] * 5 + [1e-2] * 10 + [1e-4] * 20
    (draft,) = _changes(lrs)
    assert draft.step == 25 and not draft.active  # the first recorded step after the gap


def _growth(layer: str, step: int, rise: int) -> dict:
    return {**finding("weight_jump", step, layer=layer, severity="info", last_step=140,
                      cause="weight_jump", growth_step=step, rise_step=rise, carried=[]),
            "code": "weight_growth"}


def _note(step: int, factor: float = 50.0) -> dict:
    return {**finding("lr_change", step, severity="info", last_step=step, cause="lr_change",
                      lr_step=step, lr_before=1e-4, lr_after=1e-4 * factor, lr_factor=factor,
                      fix="if it was not meant, undo or soften the change"),
            "code": "lr_change"}


def test_a_change_no_spike_followed_is_one_card_with_the_weights_it_grew():
    note = _note(101)
    grown = [_growth(f"model.layers.{i}.mlp.down_proj", 100, 110) for i in range(4)]
    earlier = _growth("model.embed_tokens", 0, 10)  # began before the change: its own
    cards = group_incidents([note, *grown, earlier])
    (card,) = [c for c in cards if note["id"] in c.findings]
    assert sorted(card.findings) == sorted(f["id"] for f in (note, *grown))
    assert (card.cause, card.step, card.severity, card.layer) == ("lr_change", 101, "info",
                                                                  None)
    assert card.headline == ("The learning rate rose 50x at step 101; the weights of "
                             "'model.layers.0.mlp.down_proj', 'model.layers.1.mlp.down_proj', "
                             "'model.layers.2.mlp.down_proj' and 1 more grew from it")
    assert card.fix == "If it was not meant, undo or soften the change."
    assert not card.problem and len(cards) == 2


def test_two_changes_are_two_cards_and_a_spike_named_after_one_takes_it():
    first, second = _note(30), _note(90, 10.0)
    spike = {**finding("loss_spike", 93, cause="loss_spike", label="lr_change", spike_step=93,
                       lr_step=90, lr_before=1e-4, lr_after=1e-3, lr_factor=10.0,
                       last_step=99), "code": "lr_change"}
    cards = group_incidents([first, second, spike])
    assert sorted((c.cause, c.step, sorted(c.findings)) for c in cards) == [
        ("loss_spike", 90, sorted([second["id"], spike["id"]])),
        ("lr_change", 30, [first["id"]])]
