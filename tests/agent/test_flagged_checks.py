"""The flagged checks' kernel (agent/collectors/flagged_checks.py): with the flag clear it
leaves the slot alone whatever the outputs hold; with it set, the slot ends at the first
call whose output held inf/NaN, wherever the element lies in a stride, whatever the order
and dtype of the outputs (one launch per dtype). On the CPU in Triton's interpreter; the
same on a CUDA device (`-m cuda`)."""

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
    return flagged_checks.FlaggedChecks(device, NO_CALL)


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
    checks.check(checks.flag(loss), list(enumerate(held)))
    slot = torch.full((1,), float(slot_value), dtype=torch.float64, device=held[0].device)
    checks.take_into(slot)
    return slot.item()


@pytest.mark.parametrize("device_type", DEVICES)
def test_a_clear_flag_leaves_the_slot_alone_whatever_the_outputs_hold(device_type: str
                                                                     ) -> None:
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
    for position, index in ((3, -1), (1, 2999), (4, 0)):  # last elements, a first one
        held[position].view(-1)[index] = value
    assert slot_after(checks, bad_loss, held) == 1
    assert slot_after(checks, None, held) == 1  # an unknown loss checks too
    assert slot_after(checks, bad_loss, held[2:]) == 1  # position 1 here is held[3]
    # several backwards in one step: any set flag checks
    checks.check(checks.flag(torch.tensor(1.0, device=device)), [(4, held[4])])
    assert slot_after(checks, torch.tensor(math.inf, device=device), held[3:4]) == 0


@pytest.mark.parametrize("device_type", DEVICES)
def test_the_sampled_abs_max_keeps_minus_inf_and_nan(device_type: str) -> None:
    """The sampled step's reduction (activations.py): _foreach_norm(ord=inf) per dtype keeps
    a -inf (as inf) and a NaN, on the CPU and in CUDA's multi-tensor kernel."""
    device = torch.device(device_type)
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    held = outputs(device)
    held[1].view(-1)[5] = -math.inf
    held[4].view(-1)[-1] = math.nan
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        group = [t for t in held if t.dtype == dtype]
        norms = [n.item() for n in torch._foreach_norm(group, math.inf)]
        expected = [float(t.float().abs().max()) for t in group]  # NaN in, NaN out
        assert math.inf in expected or dtype is not torch.bfloat16
        assert [math.isnan(n) for n in norms] == [math.isnan(e) for e in expected]
        assert [n for n in norms if not math.isnan(n)] == [
            e for e in expected if not math.isnan(e)]


def test_kept_alone_tells_the_outputs_autograd_does_not_keep() -> None:
    """The budget's test (no device work): an output the next op saves is kept by autograd,
    one only an add reads is not (a Linear's 3-D output, a view of its 2-D result: the
    base counts as its own), and one a saved view of it keeps is kept too."""
    weight, bias = torch.randn(8, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    x = torch.randn(2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        saved = torch.nn.functional.linear(x, weight, bias)
        activated = torch.nn.functional.gelu(saved)  # saves its input
        alone = torch.nn.functional.linear(activated, weight, bias)
        summed = alone + 1  # saves nothing
        kept_by_view = torch.nn.functional.linear(summed, weight, bias)
        graph = torch.nn.functional.gelu(kept_by_view.view(8, 8))  # saves its input, a view
    assert alone._is_view()  # addmm's 2-D result, viewed as 3-D
    assert not flagged_checks.kept_alone(saved)
    assert flagged_checks.kept_alone(alone)
    assert not flagged_checks.kept_alone(kept_by_view)
    assert graph.grad_fn is not None and summed.grad_fn is not None  # graphs alive to here
