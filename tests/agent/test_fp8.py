"""FP8 end to end: torchao Float8Linear training on the CPU (emulate=True), the real agent and
a real server. The truth comes from the test's own hooks, which cast each tensor with
torchao's own scale and cast functions and count what the cast lost."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Iterator

import httpx
import pytest
import torch
from torch import nn

from ampwatch.agent.fp8 import CastSpec, cast_stats
from tests.agent.factories import spooled, spooled_steps
from tests.conftest import LiveServer
from tests.utils import WAIT

float8 = pytest.importorskip("torchao.float8", reason="torchao (ampwatch[fp8]) is not installed")
from tests.agent.fp8_scenario import (  # noqa: E402
    FAULT_STEP,
    ROWS,
    THRESHOLD,
    Net,
    fp8_report,
    observed_shares,
    severe_findings,
    train,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("fp8")
    live = LiveServer(f"sqlite:///{root / 'fp8.db'}", root / "server.log")
    live.start()
    yield live
    live.stop()


def test_an_outlier_under_tensorwise_scaling_is_fp8_underflow_of_that_input(server):
    run, truth = train(server, "tensorwise", outlier_from=FAULT_STEP)
    report = fp8_report(server, run)
    assert [layer["recipe"] for layer in report["layers"]] == ["dynamic tensorwise"] * 3
    assert report["layers"][0]["formats"] == {"input": "e4m3", "weight": "e4m3", "grad": "e5m2"}
    shares = observed_shares(report, "underflow")
    sampled = sorted({step for step, _, _ in shares})
    assert {0, 10, FAULT_STEP, 30} <= set(sampled)
    # every recorded share is the share the real cast flushed (float32 division apart)
    for key, share in shares.items():
        assert share == pytest.approx(truth.seen[key]["underflow"], rel=1e-6, abs=1e-9), key
    true_fc1 = truth.seen[(FAULT_STEP, "fc1", "input")]["underflow"]
    assert true_fc1 > 0.9  # the scenario: 1e6 sets the scale, the rest flushes
    # the findings are exactly the (layer, tensor) pairs the truth flags, from their first
    # sampled step over the threshold
    expected = set()
    for layer in ("fc1", "fc2", "fc3"):
        for role in ("input", "weight", "grad"):
            over = [s for s in sampled if truth.seen[(s, layer, role)]["underflow"] > THRESHOLD]
            if over:
                expected.add(("fp8_underflow", layer, over[0], role))
    assert ("fp8_underflow", "fc1", FAULT_STEP, "input") in expected
    assert severe_findings(server, run) == expected
    # the latest sample's abs-max per tensor is the tensor's true abs-max
    for layer in report["layers"]:
        for role, latest in layer["latest"].items():
            assert latest["amax"] == pytest.approx(
                truth.seen[(latest["step"], layer["name"], role)]["amax"], rel=1e-6)


def test_the_fp8_tab_shows_for_fp8_runs_only(server):
    run, _ = train(server, "tensorwise", outlier_from=FAULT_STEP)
    server.wait_for_analysis(run)  # the pages tell its findings
    overview = httpx.get(f"{server.url}/runs/{run}", timeout=30)
    assert f'href="/runs/{run}/fp8"' in overview.text
    page = httpx.get(f"{server.url}/runs/{run}/fp8", timeout=30)
    assert page.status_code == 200
    assert 'id="fig-fp8_underflow"' in page.text and "dynamic tensorwise" in page.text
    twin = httpx.get(f"{server.url}/runs/{run}/fp8", params={"format": "json"}, timeout=30)
    assert [f["kind"] for f in twin.json()["findings"]] == ["fp8_underflow"]
    plain = f"plain-{uuid.uuid4().hex[:8]}"
    httpx.put(f"{server.url}/api/v1/runs/{plain}", json={"name": plain}, timeout=30)
    assert "/fp8" not in httpx.get(f"{server.url}/runs/{plain}", timeout=30).text


def test_the_precision_map_names_the_fp8_casts(server):
    run, _ = train(server, "tensorwise", outlier_from=None)
    page = httpx.get(f"{server.url}/runs/{run}/layers", timeout=30)
    assert page.status_code == 200
    rows = dict(re.findall(r'<tr id="layer-(\w+)"[^>]*>(.*?)</tr>', page.text, re.S))
    casts = "input e4m3, weight e4m3, grad e5m2 (dynamic tensorwise)"
    assert {name for name, row in rows.items() if "dtype-fp8" in row} == {"fc1", "fc2", "fc3"}
    assert all(casts in rows[name] for name in ("fc1", "fc2", "fc3"))


def test_rowwise_scaling_contains_the_outlier_to_its_row(server):
    run, truth = train(server, "rowwise", outlier_from=FAULT_STEP)
    report = fp8_report(server, run)
    assert report["layers"][0]["recipe"] == "dynamic rowwise"
    shares = observed_shares(report, "underflow")
    for key, share in shares.items():
        assert share == pytest.approx(truth.seen[key]["underflow"], rel=1e-6, abs=1e-9), key
    # only the outlier's own row flushes: at most 1/ROWS of the elements
    fc1 = shares[(FAULT_STEP, "fc1", "input")]
    assert 0 < fc1 <= 1 / ROWS


def test_one_outlier_weight_is_one_incident_named_on_its_layer(server):
    """One of fc2's weights set to 1e4: its own cast flushes, and what it feeds (fc3's
    input) and what flows back from it (fc1's gradient) flush too; one card, the cause's."""
    run, truth = train(server, "tensorwise", outlier_from=None, weight_outlier_at=FAULT_STEP)
    flushed = {(layer, role) for (step, layer, role), seen in truth.seen.items()
               if step == FAULT_STEP and seen["underflow"] > THRESHOLD}
    assert {("fc2", "weight"), ("fc3", "input"), ("fc1", "grad")} <= flushed
    assert all(seen["underflow"] < THRESHOLD for (step, _, _), seen in truth.seen.items()
               if step < FAULT_STEP)
    severe = severe_findings(server, run)
    assert {(layer, role) for kind, layer, step, role in severe
            if kind == "fp8_underflow" and step == FAULT_STEP} == flushed
    assert ("weight_jump", "fc2", FAULT_STEP, None) in severe
    incidents = [i for i in httpx.get(f"{server.url}/api/v1/runs/{run}/incidents",
                                      params=WAIT, timeout=60).json()["items"]
                 if i["severity"] != "info"]
    assert [(i["cause"], i["layer"], i["step"], i["severity"]) for i in incidents] == [
        ("weight_jump", "fc2", FAULT_STEP, "critical")]
    assert incidents[0]["headline"] == f"The weights of layer 'fc2' jumped at step {FAULT_STEP}"
    assert len(incidents[0]["findings"]) == len(severe)


def test_healthy_fp8_runs_raise_no_finding(server):
    for recipe in ("tensorwise", "rowwise"):
        run, truth = train(server, recipe, outlier_from=None)
        assert max(v["underflow"] for v in truth.seen.values()) < THRESHOLD
        assert severe_findings(server, run) == set()
        assert all(f["kind"] not in ("fp8_underflow", "fp8_saturation", "fp8_stale_scale")
                   for f in fp8_report(server, run)["findings"])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cast_stats_match_a_real_cast_under_a_stale_scale(dtype):
    # delayed scaling: the scale comes from a smaller amax than the tensor now has
    gen = torch.Generator().manual_seed(3)
    tensor = torch.randn(64, 64, generator=gen) * 10
    fmax = torch.finfo(dtype).max
    scale = torch.tensor(fmax / 12.0)  # covers |x| <= 12: the tail saturates
    stats = cast_stats(tensor, CastSpec(dtype), scale)
    scaled = tensor * scale
    cast = scaled.clamp(-fmax, fmax).to(dtype).float()
    # clipped: the cast lost more than rounding in the top binade can (half its ulp)
    top_ulp = torch.finfo(dtype).eps * 2 ** math.floor(math.log2(fmax))
    saturated = ((cast - scaled).abs() > top_ulp / 2).sum().item() / tensor.numel()
    flushed = ((cast == 0) & (tensor != 0)).sum().item() / tensor.numel()
    assert saturated > 0.1
    assert stats[3].item() == pytest.approx(saturated, rel=1e-6)
    assert stats[4].item() == pytest.approx(flushed, abs=1e-9)
    assert stats[0].item() == tensor.abs().max().item()
    assert stats[1].item() == scale.item()


@pytest.mark.parametrize("spec", [CastSpec(torch.float8_e4m3fn),
                                  CastSpec(torch.float8_e5m2),
                                  CastSpec(torch.float8_e4m3fn, dim=-1),
                                  CastSpec(torch.float8_e4m3fn, dim=0, pow2=True)],
                         ids=["e4m3", "e5m2", "rowwise", "axiswise-pow2"])
def test_dynamic_scales_never_saturate(spec):
    """A scale computed from the tensor's own abs-max saturates nothing, which is why
    cast_stats skips that count under dynamic scaling: the real cast with that scale
    clips nothing, and cast_stats counting under the same scale (given) finds 0."""
    gen = torch.Generator().manual_seed(5)
    for tensor in (torch.randn(64, 48, generator=gen) * 1e4,
                   torch.randn(64, 48, generator=gen).pow(9),  # heavy tails
                   torch.rand(64, 48, generator=gen) * 1e-30):  # below EPS: clamped scale
        fmax = torch.finfo(spec.dtype).max
        magnitude = tensor.abs()
        amax = magnitude.amax() if spec.dim is None else magnitude.amax(spec.dim, keepdim=True)
        scale = (fmax / amax.double().clamp(min=1e-12)).float()
        if spec.pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        assert cast_stats(tensor, spec)[1].item() == scale.amin().item()  # the same scale
        assert cast_stats(tensor, spec, scale)[3].item() == 0.0  # counted: nothing clips
        scaled = tensor * scale
        cast = scaled.clamp(-fmax, fmax).to(spec.dtype).float()
        top_ulp = torch.finfo(spec.dtype).eps * 2 ** math.floor(math.log2(fmax))
        assert not ((cast - scaled).abs() > top_ulp / 2).any()


def test_a_lasting_flush_opens_one_anomaly_window_not_endless_sampling(attach, offline):
    """An outlier from step 20 on flushes fc1's input on every step: the first flagged
    sample opens the anomaly window once; later samples that stay flagged do not extend
    it, so sampling goes back to every `sample_every` steps."""
    model = Net("tensorwise")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    watch = attach(model, sample_every=10, sample_after_anomaly=5)
    for step in range(75):
        x, y = torch.randn(ROWS, 64, generator=gen), torch.randn(ROWS, 16, generator=gen)
        if step >= 20:
            x[0, 0] = 1e6
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert watch.flush(timeout=30)  # the worker reads each step before the next one
    steps = spooled_steps(offline, watch.run_id)
    # step 21 was decided as step 20 closed, before the worker read step 20's casts
    assert [s["step"] for s in steps if "fp8" in s] == [0, 10, 20, 22, 23, 24, 25,
                                                        30, 40, 50, 60, 70]


class TeScaling:
    """Transformer Engine's FP8TensorMeta, as far as the agent reads it: one scale per
    GEMM tensor (forward: input 0, weight 1; backward: grad output 0)."""

    def __init__(self, *scales: float) -> None:
        self.scale = torch.tensor(scales)


def te_stand_in(kind: str, features: int) -> nn.Module:
    """A stand-in for a `transformer_engine.pytorch` module (TE needs CUDA): a Linear
    named and placed as TE's, with TE's `fp8` flag and `fp8_meta` as its `__init__` and
    first `fp8_autocast` forward leave them."""
    cls = type(kind, (nn.Linear,), {"__module__": f"transformer_engine.pytorch.module.{kind}"})
    module = cls(features, features)
    module.fp8 = False
    module.fp8_meta = {"recipe": None}  # the default recipe, before any fp8_autocast
    return module


def start_te_fp8(module: nn.Module, history: int, *scales: float) -> None:
    module.fp8 = True
    module.fp8_meta["recipe"] = type("DelayedScaling", (), {"amax_history_len": history})()
    module.fp8_meta["scaling_fwd"] = TeScaling(*scales[:2], 1.0)
    module.fp8_meta["scaling_bwd"] = TeScaling(scales[2], 1.0)


def test_transformer_engine_layers_are_fp8_only_while_they_cast(attach, offline):
    """A TE model trained in bf16 has no FP8 layer; once its modules cast (fp8_autocast),
    they enter the layer table with the recipe in use and their casts are measured with
    the module's own (stale) scale; a LayerNormLinear's input, which it normalises before
    casting, is not."""
    torch.manual_seed(0)
    linear, norm_linear = te_stand_in("Linear", 32), te_stand_in("LayerNormLinear", 32)
    model = nn.Sequential(linear, nn.ReLU(), norm_linear)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = attach(model, sample_every=5, sample_after_anomaly=0)
    gen = torch.Generator().manual_seed(2)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    inputs = []
    for step in range(12):
        if step == 6:  # the scale covers |x| <= 1: an input of N(0, 1) saturates its tail
            assert watch.flush(timeout=30)  # the bf16 steps and their layer table are out
            for module in (linear, norm_linear):
                start_te_fp8(module, 1024, fmax / 1.0, fmax / 4.0, 2.0**10)
        x = torch.randn(16, 32, generator=gen)
        inputs.append(x)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert watch.flush(timeout=30)
    entries = spooled(offline, watch.run_id)
    steps = [s for e in entries for s in e["batch"]["steps"]]
    assert [s["step"] for s in steps if "fp8" in s] == [10]
    layers = {layer["name"]: layer for layer in entries[-1]["run"]["layers"]}
    assert layers["0"]["attrs"]["fp8_recipe"] == "delayed (amax history 1024)"
    assert layers["2"]["attrs"]["fp8_recipe"] == "delayed (amax history 1024)"
    assert "fp8_input_format" not in layers["2"]["attrs"]
    assert not any("fp8_recipe" in layer["attrs"] for layer in entries[0]["run"]["layers"])
    fp8 = steps[10]["fp8"]
    index = {name: layer["index"] for name, layer in layers.items()}
    assert fp8["input"]["scale"][index["0"]] == pytest.approx(fmax)
    assert fp8["input"]["scale"][index["2"]] is None  # LayerNormLinear: not measured
    saturated = (inputs[10].abs() * fmax > fmax + 16).float().mean().item()  # e4m3 top ulp 32
    assert saturated > 0.1
    assert fp8["input"]["saturated"][index["0"]] == pytest.approx(saturated, rel=1e-6)
    assert fp8["weight"]["scale"][index["2"]] == pytest.approx(fmax / 4.0)


def _transformer_engine():
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine needs a CUDA GPU; none here (docs/fp8.md lists what "
                    "waits for one)")
    return pytest.importorskip("transformer_engine.pytorch",
                               reason="transformer_engine is not installed (it needs CUDA)")


@pytest.mark.cuda
def test_transformer_engine_delayed_scaling_end_to_end(attach, offline):
    """On a GPU with TE: te.Linear layers under fp8_autocast with delayed scaling enter
    the layer table as FP8 once they cast; the recorded scale of each tensor is the one
    TE's fp8_meta holds for that step; the abs-max is the tensor's own; nothing
    synchronises the device."""
    te = _transformer_engine()
    from transformer_engine.common.recipe import DelayedScaling, Format

    torch.manual_seed(0)
    model = nn.Sequential(te.Linear(64, 128), nn.ReLU(), te.Linear(128, 16)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # step -> input scale, abs-max
    current = {"step": 0}

    def truth(module, args):  # device tensors, read after the loop: no sync in it
        meta = module.fp8_meta.get("scaling_fwd")
        if meta is not None:
            seen[current["step"]] = (meta.scale[0].clone(), args[0].abs().max())

    model[0].register_forward_pre_hook(truth)
    watch = attach(model, sample_every=5, sample_after_anomaly=0)
    for step in range(12):
        current["step"] = step
        x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 16, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.set_sync_debug_mode("default")
    assert watch.flush(timeout=30)
    entries = spooled(offline, watch.run_id)
    layers = {layer["name"]: layer for layer in entries[-1]["run"]["layers"]}
    assert layers["0"]["attrs"]["fp8_recipe"] == "delayed (amax history 16)"
    assert layers["0"]["attrs"]["fp8_input_format"] == "e4m3"
    assert layers["0"]["attrs"]["fp8_grad_format"] == "e5m2"
    index = layers["0"]["index"]
    for record in (s for e in entries for s in e["batch"]["steps"] if "fp8" in s):
        scale, amax = (t.item() for t in seen[record["step"]])
        assert record["fp8"]["input"]["scale"][index] == pytest.approx(scale, rel=1e-6)
        assert record["fp8"]["input"]["amax"][index] == pytest.approx(amax, rel=1e-6)
