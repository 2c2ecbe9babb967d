"""The accelerator path (forced on the CPU, `AMPWATCH_DEVICE_PATH=1`) ready for a real GPU
(issue 62): outputs of another device are never held, `hold_mb` bounds the first held step,
a float64 model is stored end to end, channels_last outputs are held at the contiguous
cost, FP8 outputs lose no other dtype's reduction, a failed launch reports its step
unchecked, and the reduction plans stay few. Their CUDA twins: test_cuda_device_path.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from ampwatch import agent
from ampwatch.agent.collectors import absmax_plan, flagged_checks
from ampwatch.agent.collectors.held_outputs import HeldOutputs
from tests.agent.factories import batches, spooled_steps
from tests.conftest import LiveServer

MiB = 1 << 20


def kernel_on_cpu() -> None:
    """Skip where the flagged kernel cannot run on CPU tensors (a CUDA machine: there
    tests/conftest.py leaves TRITON_INTERPRET unset, and the kernel is compiled for CUDA)."""
    if not flagged_checks.available(torch.device("cpu")):
        pytest.skip("the flagged kernel does not run on the CPU here (TRITON_INTERPRET=1 is "
                    "set only without CUDA); its CUDA twin runs in test_cuda_device_path.py")


def collector(attachment: agent.Attachment) -> Any:
    return next(c for c in attachment._watch.collectors if c.name == "activations")


def test_an_output_on_another_device_is_never_held() -> None:
    """A layer that returns a CPU tensor on a CUDA model: its address would mean nothing
    in the device's table, so it is checked as produced (host metadata only here)."""
    held = HeldOutputs(64 * MiB, torch.device("cuda", 1))
    calls: list = []
    assert not held.hold(0, torch.ones(4), calls, kernel=True)
    assert not held.hold(0, torch.ones(4), calls)
    assert held.outputs == [] and calls == []
    on_cpu = HeldOutputs(64 * MiB, torch.device("cpu"))
    assert on_cpu.hold(0, torch.ones(4), calls, kernel=True)


def test_the_kernel_skips_outputs_of_another_device() -> None:
    kernel_on_cpu()
    checks = flagged_checks.FlaggedChecks(torch.device("cpu"), absmax_plan.NO_CALL)
    meta = torch.empty(4, device="meta")  # no address in this device's memory
    checks.check(checks.flag(torch.tensor(math.nan)), [(0, meta)])
    slot = torch.full((1,), float(absmax_plan.NO_CALL), dtype=torch.float64)
    checks.take_into(slot)
    assert slot.item() == absmax_plan.NO_CALL  # flagged, nothing of this device was bad


def wide_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 4))


@pytest.mark.parametrize("hold_mb", [0, 0.01])
def test_hold_mb_bounds_the_first_held_steps(attach, offline: Path, hold_mb: float,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """From the first step on (the sampled step 0 and the first unsampled step 1, before
    any check judged a layer), the outputs counted against hold_mb stay within it: the
    bytes the agent records and the storage of the outputs only it keeps alive."""
    kernel_on_cpu()
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    model = wide_model()
    attachment = attach(model, sample_every=100, sample_after_anomaly=0, hold_mb=hold_mb)
    held = collector(attachment)._held
    budget = int(hold_mb * MiB)
    seen: list[tuple[int, int]] = []  # per check: (recorded bytes, bytes only the agent kept)
    take = held.take

    def measured_take() -> list:
        alone = sum(o.untyped_storage().nbytes() for _, _, o, _ in held.outputs
                    if flagged_checks.kept_alone(o))
        seen.append((held.held_bytes, alone))
        return take()

    monkeypatch.setattr(held, "take", measured_take)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(3):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    assert len(seen) >= 3  # each step's check (step 0's at its forward's end)
    assert all(recorded <= budget and alone <= budget for recorded, alone in seen), seen
    assert len(spooled_steps(offline, attachment.run_id)) == 3


class Fp64Net(nn.Module):
    """A float64 model whose middle layer puts out a finite 1e300."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32).double()
        self.huge = nn.Linear(32, 32).double()
        self.shrink = nn.Linear(32, 32).double()
        self.out = nn.Linear(32, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.huge(self.inp(x)) * 0 + 1e300  # finite in float64, inf in float32
        return self.out(self.shrink(h * 1e-300))


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_float64_model_is_stored_end_to_end(live_server: LiveServer, spool_dir: Path,
                                              path: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """16 of 16 steps stored; the 1e300 layer is never named; the NaN at step 12 names
    the first layer whose output held it, by the test's own hooks; the sampled abs-max of
    1e300 is kept (stored as float32's largest, with an event giving the value sent)."""
    if path == "device":
        kernel_on_cpu()
        monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    model = Fp64Net()
    truth: dict[int, int | None] = {}
    names = ["inp", "huge", "shrink", "out"]
    step = {"i": 0}

    def first_bad(position: int) -> Any:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if truth.get(step["i"]) is None and not bool(out.isfinite().all()):
                truth[step["i"]] = position
        return hook

    def poison(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if step["i"] != 12:
            return None
        out = out.clone()
        out[0, 0] = math.nan  # a NaN written into a later layer's output at step 12
        return out

    model.shrink.register_forward_hook(poison)  # before the truth's and the agent's hooks
    for position, name in enumerate(names):
        getattr(model, name).register_forward_hook(first_bad(position))
    attachment = agent.attach(model, server=live_server.url, sample_every=5,
                              sample_after_anomaly=0, flush_interval=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    for i in range(16):
        step["i"] = i
        x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
        loss = model(x).square().mean()
        loss.backward()
        if i == 12:  # NaN grads would carry the NaN into every later step's weights
            optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    assert attachment.flush(timeout=20) is True
    assert attachment.detach(timeout=10) is True
    run = httpx.get(f"{live_server.url}/api/v1/runs/{attachment.run_id}", timeout=10).json()
    assert run["steps"] == 16
    layer_of = {layer.module: layer.index for layer in attachment._watch.layers}
    items = httpx.get(f"{live_server.url}/api/v1/runs/{attachment.run_id}/steps",
                      params={"limit": 100}, timeout=10).json()["items"]
    named = {s["step"]: s["first_nonfinite_layer"] for s in items
             if s.get("first_nonfinite_layer") is not None}
    assert truth.get(12) == 2 and all(truth.get(i) is None for i in range(16) if i != 12)
    assert named == {12: layer_of[model.shrink]}
    weights = next(c for c in attachment._watch.collectors if c.name == "weights")
    assert weights  # float64 params: no agent error (the agent_errors fixture checks)


def conv_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_channels_last_outputs_are_held_at_the_contiguous_cost(
        layout: torch.memory_format, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """bench/elements_read.py's count on a conv net without a scaler: a healthy unsampled
    step reads under 2% more elements in channels_last, as contiguous does (each conv
    output held and checked by the flagged kernel, not read by its own aminmax)."""
    kernel_on_cpu()
    from bench.elements_read import elements_read

    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    model = conv_net().to(memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 3, 32, 32).to(memory_format=layout)
    y = torch.randint(0, 10, (4,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    plain = elements_read(step)
    attachment = agent.attach(model, sample_every=100, sample_after_anomaly=0,
                              offline=True, spool_dir=str(tmp_path / "spool"))
    try:
        for _ in range(2):
            step()
        watched = elements_read(step)
    finally:
        attachment.detach(timeout=10)
    assert (watched - plain) / plain < 0.02, (plain, watched)


class Fp8Out(nn.Module):
    """A layer whose output is float8_e4m3fn (what an FP8 matmul without an output cast
    gives), then read back in float32 by the next layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn)


class Upcast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


@pytest.mark.parametrize("reduction", ["device"], indirect=True)
def test_fp8_outputs_lose_no_other_dtype_group(attach, offline: Path, reduction: str) -> None:
    """A sampled step with a float8_e4m3fn output between float32 and bfloat16 ones: every
    layer gets its abs-max (the FP8 one read through float32), none is lost."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Fp8Out(), Upcast(), nn.Linear(16, 16),
                          nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(0.1)
    attachment = attach(model, sample_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    for s in steps:
        absmax = s["activations"]["absmax"]
        assert all(v is not None and math.isfinite(v) and v > 0 for v in absmax), absmax
        assert "float8_e4m3fn" in s["activations"]["dtype"]


def test_a_failed_first_launch_reports_its_step_unchecked(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch,
        agent_errors: list[tuple[str, BaseException]]) -> None:
    """No C compiler (a slim image): the first launch raises. That step's loss was NaN and
    its held outputs were never read: it says `unchecked` (null), never "finite"; from the
    next step on every output is checked as produced (step 2's NaN batch is named)."""
    kernel_on_cpu()
    from tests.agent.test_finite_checks import chain_model

    def no_compiler(*args: Any) -> None:
        raise RuntimeError("Failed to find C compiler. Please specify via CC")

    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    monkeypatch.setattr(flagged_checks.FlaggedChecks, "_launch", no_compiler)
    model = chain_model()
    attachment = attach(model, sample_every=100, sample_after_anomaly=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(3)):
        if i >= 1:
            x = torch.full_like(x, math.nan)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["forward_nonfinite"] for s in steps] == [False, None, True]
    assert [s["first_nonfinite_layer"] for s in steps] == [None, None, 0]
    assert [site for site, _ in agent_errors] == ["activations.flagged_checks"]
    agent_errors.clear()


class Ragged(nn.Module):
    """Variable sequence lengths: a block per 8 tokens, so the call pattern changes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for chunk in x.split(8, dim=1):
            x = self.block(chunk)
        return self.head(x)


def test_reduction_plans_are_bounded_and_copied_without_a_sync(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sampled step a new call pattern (40 lengths, then the first 40 again): each
    plan's tensors go through `device_tensor` (pinned, non-blocking: a pageable
    `torch.tensor(..., device=)` copy waits for a CUDA device; the CUDA twin runs it under
    the sync debug mode), and the cache holds at most MAX_PLANS: the second round rebuilds
    what the LRU dropped."""
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    copies: list[torch.device] = []
    made = absmax_plan.device_tensor

    def counted(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        copies.append(device)
        return made(values, dtype, device)

    monkeypatch.setattr(absmax_plan, "device_tensor", counted)
    model = Ragged()
    attachment = attach(model, sample_every=1, sample_after_anomaly=0)
    plans = collector(attachment)._plans
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lengths = [8 * (1 + n) for n in range(40)] * 2
    for length in lengths:
        model(torch.randn(2, length, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    assert len(plans) == plans.MAX_PLANS < 40
    assert plans.built == 80  # 40 new, then each dropped by the LRU before it came back
    assert len(copies) == 2 * plans.built  # a plan's positions (one dtype) and index
    assert set(copies) == {torch.device("cpu")}


def test_a_refused_batch_is_said_once_with_what_the_server_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    from ampwatch.agent.settings import AgentSettings
    from ampwatch.agent.transport.outage import OutageWatch
    from ampwatch.agent.transport.sender import Outcome, Response

    settings = AgentSettings(run_id="r1", run_id_generated=False, server="http://127.0.0.1:9")
    watch = OutageWatch(settings, lambda event: None, lambda: 0)
    reply = Response(Outcome.REJECT, {"detail": "step 3: layer_grad_norm[1] = -1.0 is "
                                      "negative"}, 422)
    watch.refused_batch("000003.json.gz", reply)
    watch.refused_batch("000004.json.gz", reply)
    err = capsys.readouterr().err
    assert err.count("ampwatch: the server") == 1
    assert "HTTP 422" in err and "layer_grad_norm[1] = -1.0 is negative" in err
