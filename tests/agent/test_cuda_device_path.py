"""Issue 62 on a CUDA device (`python -m pytest -m cuda`; skipped without one, and
bench/gpu_check.py runs this file first): the flagged kernel on another device than the
current one, `hold_mb` against `torch.cuda.max_memory_allocated` under checkpointing, a
float64 model's 1e300 not named, channels_last held, FP8 outputs, outputs from a side
stream, no sync under variable shapes, nothing device-side during CUDA graph capture.
The CPU twins are in test_device_path.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ampwatch.agent.collectors import absmax_plan, flagged_checks
from tests.agent.factories import spooled_steps
from tests.agent.test_device_path import Fp8Out, Fp64Net, Ragged, Upcast, collector, conv_net

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def slot_after(checks: flagged_checks.FlaggedChecks, loss: torch.Tensor,
               held: list[torch.Tensor]) -> float:
    checks.check(checks.flag(loss), list(enumerate(held)))
    slot = torch.full((1,), float(absmax_plan.NO_CALL), dtype=torch.float64,
                      device=checks.device)
    checks.take_into(slot)
    return slot.item()


def test_the_kernel_launches_on_the_outputs_device_not_the_current_one() -> None:
    """A model on cuda:1 in a process whose current device is cuda:0 (never set_device(1)):
    no illegal address, and the bad output is named."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (the outputs on one, the current device the other)")
    other = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    checks = flagged_checks.FlaggedChecks(other, absmax_plan.NO_CALL)
    held = [torch.randn(4096, device=other) for _ in range(3)]
    held[1][-1] = math.inf
    assert slot_after(checks, torch.tensor(math.nan, device=other), held) == 1
    torch.cuda.synchronize(other)


def test_outputs_made_on_a_side_stream_are_kept_until_the_kernel_read_them() -> None:
    """Outputs made on a side stream, released right after the launch: record_stream keeps
    their memory from being reused before the kernel reads it (the verdict stays right
    while the freed blocks are overwritten at once)."""
    checks = flagged_checks.FlaggedChecks(CUDA, absmax_plan.NO_CALL)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        held = [torch.randn(1 << 20, device=CUDA) for _ in range(4)]
        held[2][7] = math.nan
    torch.cuda.current_stream().wait_stream(side)
    checks.check(checks.flag(torch.tensor(math.nan, device=CUDA)), list(enumerate(held)))
    del held
    with torch.cuda.stream(side):  # would take the freed blocks without record_stream
        filler = [torch.zeros(1 << 20, device=CUDA) for _ in range(4)]
    slot = torch.full((1,), float(absmax_plan.NO_CALL), dtype=torch.float64, device=CUDA)
    checks.take_into(slot)
    assert slot.item() == 2 and filler


def test_float64_is_tested_in_its_own_dtype() -> None:
    checks = flagged_checks.FlaggedChecks(CUDA, absmax_plan.NO_CALL)
    huge = torch.full((5000,), 1e300, dtype=torch.float64, device=CUDA)
    bad = torch.zeros(5000, dtype=torch.float64, device=CUDA)
    bad[4999] = math.nan
    assert slot_after(checks, torch.tensor(math.nan, device=CUDA), [huge, bad]) == 1


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 4096), nn.GELU(),
                                                  nn.Linear(4096, 1024)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return x


def peak_of_steps(model: nn.Module, steps: int) -> int:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, 1024, device=CUDA)
    peak = 0
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated())
    return peak


def test_hold_mb_0_adds_no_memory_under_checkpointing(attach) -> None:
    """Activation checkpointing with hold_mb=0: the peak of the first steps (the sampled
    step 0 and the first unsampled one included) with the agent stays within 2% of the
    peak without it (the agent's own buffers aside); holding every output would bring
    back what checkpointing freed."""
    model = Checkpointed().to(CUDA)
    plain = peak_of_steps(model, 3)
    attach(model, sample_every=100, sample_after_anomaly=0, hold_mb=0)
    watched = peak_of_steps(model, 3)
    assert watched <= plain * 1.02 + (8 << 20), (plain, watched)


def test_a_float64_model_names_only_the_nan(attach, offline: Path) -> None:
    model = Fp64Net().to(CUDA)
    model.shrink.register_forward_hook(
        lambda m, a, out: None if not poisoned["on"] else out.index_fill(1, zero, math.nan))
    poisoned = {"on": False}
    zero = torch.zeros(1, dtype=torch.long, device=CUDA)
    attachment = attach(model, sample_every=5, sample_after_anomaly=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    for i in range(16):
        poisoned["on"] = i == 12
        model(torch.randn(8, 16, dtype=torch.float64, device=CUDA)).square().mean().backward()
        if i == 12:
            optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(10)
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == 16
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps
            if s["first_nonfinite_layer"] is not None} == {12: 2}


def test_channels_last_outputs_are_held_for_the_kernel(attach) -> None:
    model = conv_net().to(CUDA, memory_format=torch.channels_last)
    attachment = attach(model, sample_every=100, sample_after_anomaly=0)
    held_layouts: list[bool] = []
    held = collector(attachment)._held
    hold = held.hold

    def spy(index, tensor, calls, *args, **kwargs):  # noqa: ANN001, ANN202
        taken = hold(index, tensor, calls, *args, **kwargs)
        if taken and tensor.dim() == 4:
            held_layouts.append(tensor.is_contiguous(memory_format=torch.channels_last))
        return taken

    held.hold = spy
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 3, 32, 32, device=CUDA).to(memory_format=torch.channels_last)
    for _ in range(3):
        nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long,
                                                          device=CUDA)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert held_layouts and all(held_layouts)


def test_fp8_outputs_on_cuda(attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Fp8Out(), Upcast(), nn.Linear(16, 4)).to(CUDA)
    attachment = attach(model, sample_every=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 16, device=CUDA) * 0.1).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(10)
    for s in spooled_steps(offline, attachment.run_id):
        assert all(v is not None and math.isfinite(v) for v in s["activations"]["absmax"])


def test_variable_shapes_make_no_sync(attach) -> None:
    """New call patterns every sampled step: the plans' tensors are copied without a sync
    (the sync debug mode raises in the agent's guard, which fails the test)."""
    model = Ragged().to(CUDA)
    attach(model, sample_every=1, sample_after_anomaly=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs = [torch.randn(2, 8 * (1 + n % 12), 8, device=CUDA) for n in range(40)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in inputs:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_nothing_device_side_during_cuda_graph_capture(attach, offline: Path) -> None:
    """A forward captured into a CUDA graph: the agent launches nothing into it (its
    hooks would never run on replay) and says so once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).to(CUDA)
    attachment = attach(model, sample_every=1)
    static = torch.randn(8, 16, device=CUDA)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        model(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model(static)
    graph.replay()
    torch.cuda.synchronize()
    assert out.isfinite().all()
    assert attachment._watch.capturing() is False
