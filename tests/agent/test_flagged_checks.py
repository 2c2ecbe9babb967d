"""The flagged checks' kernel (agent/collectors/flagged_checks.py): with the flag clear it
leaves the slot alone whatever the output holds; with it set, the slot ends at the first
call whose output held inf/NaN, wherever the element lies in a stride. On the CPU in
Triton's interpreter; the same on a CUDA device (`-m cuda`)."""

from __future__ import annotations

import math

import pytest
import torch

from ampwatch.agent.collectors import flagged_checks
from ampwatch.agent.collectors.activations import NO_CALL

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def checks_on(device_type: str) -> flagged_checks.FlaggedChecks:
    device = torch.device(device_type)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not flagged_checks.available(device):
        pytest.skip(f"the flagged kernel cannot run on {device} here (no triton, or on "
                    "the CPU TRITON_INTERPRET=1 was not set before triton was imported)")
    return flagged_checks.FlaggedChecks(device, NO_CALL, budget=0)


def outputs(device: torch.device) -> list[torch.Tensor]:
    """Outputs in execution order: sizes under one block, between blocks and over one
    stride of the CPU's two programs, in each float dtype."""
    torch.manual_seed(0)
    shapes = [(7,), (3, 1000), (5000,), (2, 3001), (64, 70)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    return [torch.randn(shape, device=device).to(dtype)
            for shape, dtype in zip(shapes, dtypes, strict=True)]


def slot_after(checks: flagged_checks.FlaggedChecks, loss: torch.Tensor | None,
               held: list[torch.Tensor], slot_value: float = NO_CALL) -> float:
    flag = checks.flag(loss)
    for position, output in enumerate(held):
        checks.check(flag, output, position)
    slot = torch.full((1,), float(slot_value), dtype=torch.float64, device=held[0].device)
    checks.take_into(slot)
    return slot.item()


@pytest.mark.parametrize("device_type", DEVICES)
def test_a_clear_flag_reads_no_output(device_type: str) -> None:
    checks = checks_on(device_type)
    held = outputs(checks.first.device)
    for output in held:
        output.view(-1)[-1] = math.nan
    finite = torch.tensor(2.5, device=held[0].device)
    assert slot_after(checks, finite, held) == NO_CALL + 1  # not checked
    # an output checked as it was produced found bad: that verdict stands
    assert slot_after(checks, finite, held, slot_value=3) == 3


@pytest.mark.parametrize("device_type", DEVICES)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_set_flag_names_the_first_bad_output(device_type: str, value: float) -> None:
    checks = checks_on(device_type)
    device = checks.first.device
    bad_loss = torch.tensor(math.nan, device=device)
    held = outputs(device)
    assert slot_after(checks, bad_loss, held) == NO_CALL  # checked, all finite
    for position, index in ((3, -1), (1, 2999), (4, 0)):  # the last element of a stride
        held[position].view(-1)[index] = value
    assert slot_after(checks, bad_loss, held) == 1
    assert slot_after(checks, None, held) == 1  # an unknown loss checks too
    assert slot_after(checks, bad_loss, held[2:]) == 1  # position 1 here is held[3]
    # several backwards in one step: any set flag checks
    checks.check(checks.flag(torch.tensor(1.0, device=device)), held[4], 4)
    assert slot_after(checks, torch.tensor(math.inf, device=device), held[3:4]) == 0
