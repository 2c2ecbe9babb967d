"""The zoo's seeded faults on real architectures (tests/zoo/faults.py), each trained under
the agent and a live server, judged against the test's own truth (tests/zoo/loop.py): the
exact findings (kind, layer, step, severity) by the fault suite's rules
(tests/diagnosis/scenarios.expected), the bundle of the bad step, and `replay --bisect` on
it with its printed fix applied to the same training. Healthy runs of every architecture
raise nothing at warning or worse."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ampwatch.replay import read_meta
from ampwatch.replay.cli import replay_report
from tests.conftest import LiveServer, agent_errors_fail
from tests.diagnosis.scenarios import expected, observed
from tests.zoo import faults
from tests.zoo.loop import Fault, Truth, first_precursor, step_is_finite, train

SKIP_STREAK, SCALE_FLOOR = 20, 1.0  # the recorder's defaults (agent/record_triggers.py)
# the layer types whose fp16 compute the precision map flags (docs/diagnosis.md)
SENSITIVE = re.compile(r"(Norm\w*|Softmax|Softmin|Loss)$")


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield


class Run:
    def __init__(self, fault: Fault, server: LiveServer, folder: Path) -> None:
        self.fault, self.folder = fault, folder
        torch.set_num_threads(1)
        with agent_errors_fail():
            self.run_id, self.truth = train(fault, server.url, record=folder)
        self.serious, self.findings = observed(server.url, self.run_id)

    def bundles(self) -> list[Path]:
        return sorted(self.folder.rglob("*.ampbundle"))


def _run(fault: Fault, server: LiveServer, factory: pytest.TempPathFactory) -> Run:
    return Run(fault, server, factory.mktemp(fault.name))


@pytest.fixture(scope="module")
def gpt2_backward(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(faults.GPT2_BACKWARD, server, tmp_path_factory)


@pytest.fixture(scope="module")
def t5_forward(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(faults.T5_FORWARD, server, tmp_path_factory)


def _streak_step(truth: Truth) -> int | None:
    """The step a bundle keeps for a diverging scaler, from the loop's own numbers: the
    first skipped step whose scale is at or below 1, or the 20th skip in a row."""
    skips = 0
    for i, step in enumerate(truth.steps):
        skips = skips + 1 if step.skipped else 0
        scale = truth.scale_used[i]
        if (step.skipped and scale is not None and scale <= SCALE_FLOOR) or skips >= SKIP_STREAK:
            return i
    return None


def _replayed_and_fixed(run: Run, step: int, layer: str) -> dict[str, Any]:
    """`replay --bisect` on the bundle of `step`: it reproduces, names `layer` (or a module
    inside it), and its printed fix makes that step finite in the same training."""
    (path,) = [p for p in run.bundles() if read_meta(p)["step"] == step]
    report = replay_report(str(path), run.fault.arch.build, "cpu", bisect=True)
    assert report["reproduced"], report
    result = report["bisect"]
    assert result["fixed"] and any(m == layer or m.startswith(f"{layer}.")
                                   for m in result["modules"]), result
    namespace: dict = {}
    exec(result["fix"], namespace)  # the printed fix, as a user pastes it
    _, fixed = train(run.fault, "", fix=namespace, watch=False)
    assert step_is_finite(fixed, step)
    return report


def test_a_backward_born_overflow_in_a_short_run_keeps_a_bundle(gpt2_backward: Run) -> None:
    """Issue 44 case 2: the scaler diverges from step 40 of 70; no healthy streak of 100
    steps came before, and the bundle is kept all the same."""
    truth = gpt2_backward.truth
    first = next(i for i, s in enumerate(truth.steps) if truth.first_bad_grad[i])
    assert first == faults.BACKWARD_AT and all(s.first_bad_layer is None for s in truth.steps)
    step = _streak_step(truth)
    assert step is not None, "the scaler did not diverge"
    assert [read_meta(p)["step"] for p in gpt2_backward.bundles()] == [step]
    assert read_meta(gpt2_backward.bundles()[0])["trigger"] == "scale_collapse"
    _replayed_and_fixed(gpt2_backward, step, "transformer.h.1.mlp.c_fc")
    critical = {(kind, at) for kind, _, at, severity in gpt2_backward.serious
                if severity == "critical"}
    # the cause: the weights the test multiplied by 1e4 at step 40; then the scaler's fall
    assert critical == {("weight_jump", faults.BACKWARD_AT),
                        *(("scaler_divergence", at) for at in _divergence_steps(truth))}
    # nothing at warning: the streak's first skips are the streak's, not a scale in decline
    # told early (whichever step the agent's batches end on)
    assert {(kind, at) for kind, _, at, _ in gpt2_backward.serious} == critical


def _divergence_steps(truth: Truth) -> list[int]:
    """A streak of 20 skips (critical) from its first step, and the scale at or below 1."""
    streak_from = next(i for i in range(len(truth.steps) - SKIP_STREAK)
                       if all(s.skipped for s in truth.steps[i: i + SKIP_STREAK]))
    collapsed = next(i for i, s in enumerate(truth.steps) if s.scale_after <= SCALE_FLOOR)
    return [streak_from, collapsed]


def test_a_backward_born_overflow_is_charged_where_the_gradient_went_bad(
        gpt2_backward: Run) -> None:
    """Issue 44 case 1: the first non-finite gradient of the backward pass is in
    transformer.h.1.mlp.c_fc, not lm_head, whose weight is tied to wte."""
    truth = gpt2_backward.truth
    layer = truth.first_bad_grad[faults.BACKWARD_AT]
    assert layer == "transformer.h.1.mlp.c_fc"
    assert {name for _, name, _, _ in gpt2_backward.serious} == {layer}


def test_an_untied_backward_born_overflow_is_charged_to_its_layer(
        server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without the tied weight, today's attribution already names the layer the truth does."""
    run = _run(faults.GPT2_UNTIED_BACKWARD, server, tmp_path_factory)
    layer = run.truth.first_bad_grad[faults.BACKWARD_AT]
    assert layer == "transformer.h.1.mlp.c_fc"
    critical = {f for f in run.serious if f[3] == "critical"}
    assert critical == {("weight_jump", layer, faults.BACKWARD_AT, "critical"),
                        *(("scaler_divergence", layer, at, "critical")
                          for at in _divergence_steps(run.truth))}
    assert {(kind, name) for kind, name, _, _ in run.serious} == {
        ("weight_jump", layer), ("scaler_divergence", layer)}
    assert [read_meta(p)["step"] for p in run.bundles()] == [_streak_step(run.truth)]


def test_t5_feed_forward_overflow(t5_forward: Run) -> None:
    truth = t5_forward.truth
    layer = truth.steps[faults.FORWARD_AT].first_bad_layer
    assert layer == "encoder.block.1.layer.1.DenseReluDense.wo"
    nonfinite = {f for f in t5_forward.serious if f[0] == "nonfinite"}
    assert nonfinite == {("nonfinite", layer, faults.FORWARD_AT, "warning")}
    # the cause: the test multiplied wo's weights by 2e5 at that step
    jumps = {f for f in t5_forward.serious if f[0] == "weight_jump"}
    assert jumps == {("weight_jump", layer, faults.FORWARD_AT, "critical")}
    # the skips that follow are the same cause's (lowering the scale cannot help)
    assert {(kind, name) for kind, name, at, _ in t5_forward.serious - nonfinite - jumps} <= {
        ("scaler_divergence", layer)}
    bundles = t5_forward.bundles()
    assert [read_meta(p)["step"] for p in bundles] == [faults.FORWARD_AT]
    assert read_meta(bundles[0])["trigger"] == "forward_nonfinite"
    assert read_meta(bundles[0])["first_nonfinite_layer"] == layer
    report = _replayed_and_fixed(t5_forward, faults.FORWARD_AT, layer)
    assert report["replayed"]["first_nonfinite_layer"] == layer


def test_vit_nan_input(server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _run(faults.VIT_NAN, server, tmp_path_factory)
    assert run.truth.steps[faults.NAN_AT].input_bad
    assert run.serious == expected(run.fault.scenario, run.truth)
    assert ("nonfinite", None, faults.NAN_AT, "warning") in run.serious


def _precursor(run: Run, code: str) -> tuple[str, int]:
    (finding,) = [f for f in run.findings if f["kind"] == "spike_precursor"]
    assert finding["code"] == code
    return finding["layer"], finding["step"]


def test_llama_attention_logit_growth(server: LiveServer,
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 44 case 3: Llama's attention names no head count; its growing logits are
    found in the module that ran them, at the first sampled step the truth calls grown."""
    run = _run(faults.LLAMA_ATTENTION, server, tmp_path_factory)
    layer = "model.layers.1.self_attn"
    grown = first_precursor([step[layer] for step in run.truth.attention.steps],
                            run.fault.dtype)
    assert grown is not None, "the logits did not grow"
    assert _precursor(run, "attention_logit_growth") == (layer, grown)


def test_llama_output_logit_growth(server: LiveServer,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _run(faults.LLAMA_OUTPUT, server, tmp_path_factory)
    grown = first_precursor(run.truth.output_lse, run.fault.dtype)
    assert grown is not None, "the log-partition did not grow"
    assert _precursor(run, "output_logit_divergence") == ("lm_head", grown)


def test_gpt2_bad_batch_is_labelled_a_bad_batch(server: LiveServer,
                                                tmp_path_factory: pytest.TempPathFactory
                                                ) -> None:
    """Issue 44 case 4: a one-step loss jump with a grad-norm jump and no precursor is a
    bad batch even when the loss takes a few steps to settle (truth: the loop's own)."""
    run = _run(faults.GPT2_BAD_BATCH, server, tmp_path_factory)
    at = faults.BAD_BATCH_AT
    losses, norms = run.truth.losses, [s.grad_norm for s in run.truth.steps]
    assert losses[at] > 20 * max(losses[at - 5: at]) and losses[at + 1] < losses[at] / 20
    assert norms[at] > 10 * max(norms[at - 5: at]), "the bad batch did not act"
    spikes = [f for f in run.findings if f["kind"] == "loss_spike"]
    assert [(f["step"], f["code"]) for f in spikes] == [(faults.BAD_BATCH_AT, "bad_batch")]


@pytest.mark.parametrize("name", sorted(faults.HEALTHY))
def test_healthy_runs_raise_nothing(name: str, server: LiveServer,
                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Nothing at warning or worse but what is true of a healthy run too: under CPU fp16
    autocast a norm fed an fp16 tensor computes in fp16 (BERT's MLM head LayerNorm, the
    UNet's GroupNorms; CUDA autocast runs them in fp32), the precision map's warning."""
    run = _run(faults.HEALTHY[name], server, tmp_path_factory)
    assert not any(s.first_bad_layer or s.grad_bad_layers for s in run.truth.steps[10:])
    fp16_norms = {("precision_map", layer, 0, "warning")
                  for layer in run.truth.steps[0].fp16_absmax
                  if SENSITIVE.search(type(run.truth.layers[layer]).__name__)
                  and not type(run.truth.layers[layer]).__name__.endswith("BatchNorm2d")}
    assert run.serious == fp16_norms, run.serious
    assert run.bundles() == []
