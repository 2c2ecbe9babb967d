"""Issue 58: the right verdict on families nobody here wrote (tests/zoo/faults.py's
FAMILY_FAULTS and a healthy control of each), judged by incidents, the cards a user
reads: the top card names the truth's step and layer (or the input, or the learning
rate) and cause, one card per cause, and a healthy run shows no warning or critical card.
The truth is the test's own: its input check, the step it changed the learning rate or
began scaling a weight, its own view of the loss."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.conftest import LiveServer, agent_errors_fail
from tests.diagnosis.scenarios import WAIT
from tests.zoo import faults
from tests.zoo.loop import Fault, Truth, train


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield


def cards(fault: Fault, server: LiveServer) -> tuple[Truth, list[dict]]:
    run_id, truth = train(fault, server.url)
    response = httpx.get(f"{server.url}/api/v1/runs/{run_id}/incidents", params=WAIT,
                         timeout=60)
    response.raise_for_status()
    return truth, response.json()["items"]


def problems(items: list[dict]) -> list[dict]:
    return [i for i in items if i["severity"] in ("warning", "critical")]


@pytest.mark.parametrize("fault", [faults.MAMBA_NAN_EMBEDS, faults.CONVNEXT_NAN],
                         ids=lambda f: f.name)
def test_weights_poisoned_by_a_nan_input_are_the_inputs_card(fault: Fault,
                                                             server: LiveServer) -> None:
    truth, items = cards(fault, server)
    at = next(i for i, s in enumerate(truth.steps) if s.input_bad)
    assert at == faults.POISON_AT
    assert truth.steps[at + 1].first_bad_layer is not None  # the weights are NaN after it
    (card,) = problems(items)
    assert (card["cause"], card["step"]) == ("nonfinite_input", at), items


def test_a_learning_rate_jump_in_early_descent_is_its_own_card(server: LiveServer) -> None:
    truth, items = cards(faults.MISTRAL_LR_JUMP, server)
    at = faults.LR_JUMP_AT
    before = truth.losses[at - 5: at]
    assert max(truth.losses[at: at + 5]) > 2 * max(before) and before[-1] < before[0]
    shown = [(i["cause"], i["layer"], i["step"], i["headline"]) for i in problems(items)]
    assert len(shown) == 1, shown
    (card,) = problems(items)
    assert card["cause"] == "loss_spike" and "learning rate rose 50x" in card["headline"]
    assert f"at step {at}" in card["headline"], card["headline"]


@pytest.mark.parametrize(("fault", "layer", "start"), [
    (faults.GEMMA2_LATE_GROWTH, "model.layers.1.mlp.down_proj", faults.LATE_GROWTH_FROM),
    (faults.MIXTRAL_QK, "model.layers.1.self_attn", faults.GROWTH_FROM),
    (faults.BART_QK, "model.encoder.layers.0.self_attn", faults.GROWTH_FROM),
    (faults.MIXTRAL_ROUTER, "model.layers.0.mlp.gate", faults.GROWTH_FROM),
], ids=lambda v: v.name if isinstance(v, Fault) else None)
def test_a_growth_is_one_card_from_where_it_starts(fault: Fault, layer: str, start: int,
                                                   server: LiveServer) -> None:
    _, items = cards(fault, server)
    grown = [i for i in items if i["cause"] == "weight_jump"]
    assert [(i["layer"], i["step"]) for i in grown] == [(layer, start)], items
    assert all(i["cause"] == "weight_jump" for i in problems(items)), problems(items)


@pytest.mark.parametrize("name", sorted(faults.FAMILY_HEALTHY))
def test_healthy_families_show_no_warning_card(name: str, server: LiveServer) -> None:
    _, items = cards(faults.FAMILY_HEALTHY[name], server)
    assert problems(items) == [], problems(items)
