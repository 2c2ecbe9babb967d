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


def test_a_learning_rate_rise_no_spike_followed_is_a_note_of_its_own(
        server: LiveServer) -> None:
    fault = faults.CONVNEXT_LR_RISE
    truth, items = cards(fault, server)
    at, factor = fault.lr_jump  # the loop's own change
    assert max(truth.losses[at:]) < 1.5 * max(truth.losses[at - 10: at])  # no spike
    assert problems(items) == [], problems(items)
    (note,) = [i for i in items if i["cause"] == "lr_change"]
    assert (note["step"], note["severity"], note["layer"]) == (at, "info", None)
    assert note["headline"].startswith(f"The learning rate rose {factor:g}x at step {at}")
    # a growth the larger updates began is told on the change's card, not one of its own
    assert not [i for i in items if i["cause"] == "weight_jump"
                and i["step"] is not None and at - 10 <= i["step"] <= at + 10], items


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


PRECISION_ADVICE = "run it in fp32"


def test_a_weight_jump_under_a_scaler_is_told_as_one_story_everywhere(
        server: LiveServer, capsys: pytest.CaptureFixture) -> None:
    """Gemma (norms that upcast inside) in fp16 with a GradScaler, one MLP weight x1e6: the
    scaler skips from that step, and every surface tells the jump's card, never the
    folded findings' own "run it in fp32"."""
    from ampwatch.client.cli import main
    from trackers.incident_notes import IncidentNote

    fault, layer = faults.GEMMA_JUMP, "model.layers.1.mlp.down_proj"
    run_id, truth = train(fault, server.url)
    at = faults.FORWARD_AT
    assert truth.steps[at].first_bad_layer == layer  # the test's own forward hooks
    assert truth.scale_used[at + 1] < truth.scale_used[at]  # the scaler backed off
    response = httpx.get(f"{server.url}/api/v1/runs/{run_id}/incidents", params=WAIT,
                         timeout=60)
    (card,) = problems(response.json()["items"])
    assert (card["cause"], card["layer"], card["step"]) == ("weight_jump", layer, at), card
    assert "precision is not the cause" in card["fix"]
    assert len(card["findings"]) > 1  # the scaler's and the non-finite findings folded
    # the page: the card's findings in its words
    page = httpx.get(f"{server.url}/runs/{run_id}", timeout=60).text
    assert PRECISION_ADVICE not in page and "a consequence of this card&#39;s cause" in page
    # `show` and `check` (the CI gate: exit 1) print the card
    for command, code in ((["show", run_id], 0), (["check", run_id], 1)):
        assert main([*command, "--server", server.url]) == code
        out = capsys.readouterr().out
        assert f"jumped at step {at}" in out and PRECISION_ADVICE not in out, out
    # alerts and the tracker mirrors tell the incident's headline and fix
    note = IncidentNote.from_incident(card, "opened", "link", None)
    assert PRECISION_ADVICE not in f"{note.title()} {note.one_line()} {note.fix}"


def test_norms_that_upcast_inside_raise_no_precision_warning(server: LiveServer) -> None:
    """Gemma's RMSNorm returns fp16 under fp16 autocast but takes its variance in fp32
    (the test's own dispatch trace); the same model with norms that take it in fp16 (and
    return the residual stream's fp32) is warned on each of them."""
    from tests.agent.test_compute_dtype import Fp16RMSNorm, Trace

    class HalfRMSNorm(Fp16RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.half()).to(x.dtype)

    def norms_in(fault: Fault) -> tuple[dict, list[dict]]:
        run_id, _ = train(fault, server.url)
        found = httpx.get(f"{server.url}/api/v1/runs/{run_id}/findings", params=WAIT,
                          timeout=60).json()["items"]
        return {f["layer"] for f in found if f.get("code") == "fp16_sensitive"}, found

    model = faults.GEMMA_HEALTHY.arch.build()
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "GemmaRMSNorm"]
    assert sorted(trace_norms(model, norms, Trace)) == [torch.float32]
    flagged, _ = norms_in(faults.GEMMA_HEALTHY)
    assert flagged == set()
    fp16 = faults.gemma_with(HalfRMSNorm)
    model = fp16.arch.build()
    assert sorted(trace_norms(model, norms, Trace)) == [torch.float16]
    flagged, _ = norms_in(fp16)
    assert flagged == set(norms)


def trace_norms(model: torch.nn.Module, norms: list[str], trace: type) -> set[torch.dtype]:
    """The dtypes the norms' statistics ran in, one fp16-autocast forward traced."""
    seen = trace(torch.nn.Sequential())  # hooks set by hand: the norms are nested
    for name in norms:
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: setattr(seen, "current", name))
    batch = faults.GEMMA_HEALTHY.arch.batch(0)
    with torch.autocast("cpu", dtype=torch.float16), seen:
        model(**batch)
    return {d for name, dtypes in seen.seen.items() if name in norms for d in dtypes}
