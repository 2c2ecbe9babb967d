"""Between samples on the CPU, the first offender at every position of a chain of layers,
with the truth taken by replaying each batch through the Sequential's children before
the step: every output checked (check_outputs="every_step", finite_checks.py), or only the
forwards of steps whose loss went inf/NaN, replayed (the default, forward_search.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampwatch.agent.collectors import finite_checks
from tests.agent.factories import batches, spooled_steps, train_with_faults
from tests.agent.test_device_path import kernel_on_cpu


def chain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def first_bad_child(model: nn.Sequential, x: torch.Tensor) -> int | None:
    """The truth: the first child whose output holds inf/NaN, replaying the batch."""
    with torch.no_grad():
        for position, child in enumerate(model):
            x = child(x)
            if not bool(x.isfinite().all()):
                return position
    return None


def poison(model: nn.Sequential, step: int) -> None:
    """One fault per step, at every kind of position in the chain."""
    with torch.no_grad():
        if step == 2:
            model[0].bias.fill_(math.inf)  # the first layer
        elif step == 3:
            model[2].weight[0, 0] = math.nan  # a layer in the middle
        elif step == 4:
            model[4].bias.fill_(-math.inf)  # absorbed by the ReLU: the loss stays finite
        elif step == 5:
            model[0].weight.zero_()  # huge finite outputs, whose sums overflow
            model[0].bias.fill_(3e38)
        elif step == 6:
            model[6].bias[0] = math.nan  # the last layer


def run_poisoned(attachment_of, spool: Path, model: nn.Sequential,
                 at: dict[str, int] | None = None, **settings: Any
                 ) -> tuple[dict[int, int | None], dict[int, bool], list[dict]]:
    """Train the chain 9 steps with one fault a step (poison()), `at["i"]` set to each
    step's number; the truth (first bad child, replayed by the test), whether each loss
    was inf/NaN, and the spooled steps."""
    at = {} if at is None else at
    attachment = attachment_of(model, sample_every=100, sample_after_anomaly=0, **settings)
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    truth: dict[int, int | None] = {}
    loss_bad: dict[int, bool] = {}
    for i, (x, y) in enumerate(batches(9)):
        at["i"] = i
        poison(model, i)
        truth[i] = first_bad_child(model, x)
        loss = nn.functional.mse_loss(model(x), y)
        loss_bad[i] = not math.isfinite(loss.item())
        loss.backward()
        optimizer.zero_grad()
        optimizer.step()
        model.load_state_dict(clean)
    attachment.flush(5)
    return truth, loss_bad, spooled_steps(spool, attachment.run_id)


def assert_named_on_bad_losses(truth: dict[int, int | None], loss_bad: dict[int, bool],
                               steps: list[dict]) -> None:
    """The flagged designs: the first offender exactly where the loss went inf/NaN, and
    nothing said of the outputs of a step whose loss was finite (step 4's absorbed
    overflow), but for step 0, sampled: every output read."""
    assert [i for i, bad in loss_bad.items() if bad] == [2, 3, 5, 6]
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == {
        i: truth[i] if loss_bad[i] else None for i in range(9)}
    assert [s["forward_nonfinite"] for s in steps[1:]] == [
        (truth[i] is not None) if loss_bad[i] else None for i in range(1, 9)]
    assert steps[0]["forward_nonfinite"] is False


def test_first_offender_at_every_position_of_a_chain(attach, offline: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Unsampled fp32 CPU steps, one fault per step. On step 7 a pre-hook of layer 2
    writes inf into its input, GELU's output, after GELU's hook ran: GELU was finite when
    it ran, layer 2 is first. Healthy steps take one sum per output, but for the GELU and
    the ReLU applied to outputs just found finite."""
    model = chain_model()
    sums: dict[int, int] = {}
    step = {"i": 0}
    check = finite_checks.finite_check

    def counted(tensor: torch.Tensor) -> tuple[float, float]:
        sums[step["i"]] = sums.get(step["i"], 0) + 1
        return check(tensor)

    def poison_input(module: nn.Module, args: tuple) -> None:
        if step["i"] == 7:
            args[0][0, 0] = math.inf

    monkeypatch.setattr(finite_checks, "finite_check", counted)
    model[2].register_forward_pre_hook(poison_input)
    attachment = attach(model, sample_every=100, sample_after_anomaly=0,
                        check_outputs="every_step")
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    truth: dict[int, int | None] = {}
    for i, (x, y) in enumerate(batches(9)):
        step["i"] = i
        poison(model, i)
        truth[i] = first_bad_child(model, x)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.zero_grad()  # the weights stay as the test sets them: each step alone
        optimizer.step()
        model.load_state_dict(clean)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == truth
    assert {i: f for i, f in truth.items() if f is not None and i != 5} == \
        {2: 0, 3: 2, 4: 4, 6: 6, 7: 2}
    assert truth[5] is not None  # the huge outputs overflow somewhere after layer 0
    assert [s["forward_nonfinite"] for s in steps] == [truth[i] is not None for i in range(9)]
    assert [sums.get(i) for i in (1, 8)] == [5, 5]


def test_sampling_off_still_checks_by_sums(attach, offline: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With sampling off (sample_every=0) no step is ever sampled: the CPU checks every
    output by its sum from the first step, not by aminmax."""
    sums = []
    check = finite_checks.finite_check
    monkeypatch.setattr(finite_checks, "finite_check", lambda t: sums.append(1) or check(t))
    model = chain_model()
    attachment = attach(model, sample_every=0, check_outputs="every_step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in batches(2):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    assert len(sums) == 10  # 5 a step, as in the test above
    assert [s["first_nonfinite_layer"] for s in spooled_steps(offline, attachment.run_id)] \
        == [None, None]


def test_flagged_steps_are_searched_and_healthy_ones_read_no_output(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default: an unsampled step reads no layer output; a step whose loss is inf/NaN
    is replayed and its first offender named exactly. The overflow the ReLU absorbs (step
    4: the loss stays finite) is not looked for: that step says nothing of its outputs."""
    model = chain_model()
    checks: dict[int, int] = {}
    step = {"i": 0}
    check = finite_checks.finite_check

    def counted(tensor: torch.Tensor) -> tuple[float, float]:
        checks[step["i"]] = checks.get(step["i"], 0) + 1
        return check(tensor)

    monkeypatch.setattr(finite_checks, "finite_check", counted)
    truth, loss_bad, steps = run_poisoned(attach, offline, model, at=step)
    assert_named_on_bad_losses(truth, loss_bad, steps)
    assert not any(checks.get(i) for i in (1, 4, 7, 8))  # finite losses: nothing read


def test_the_device_path_forced_on_the_cpu_checks_every_output(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AMPWATCH_DEVICE_PATH=1 with check_outputs="every_step": the accelerator's every-step
    path (one aminmax per layer output, reduced on the device) on CPU tensors. It names
    the first offender on every step, the one whose overflow the ReLU absorbs (step 4,
    finite loss) included."""
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    truth, _, steps = run_poisoned(attach, offline, chain_model(), check_outputs="every_step")
    assert truth[4] is not None
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == truth
    assert [s["forward_nonfinite"] for s in steps] == [truth[i] is not None for i in range(9)]


def test_the_device_path_without_a_scaler_checks_held_outputs_on_a_bad_loss(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default on an accelerator without a GradScaler, forced on the CPU: each
    unsampled step's outputs are held until its backward begins and checked by the flagged
    kernel (in Triton's interpreter here), whose programs read the loss's flag first. A
    step whose loss is inf/NaN names its first offender exactly; a finite loss reads no
    output and says nothing of them (step 4: the overflow the ReLU absorbs)."""
    kernel_on_cpu()
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    truth, loss_bad, steps = run_poisoned(attach, offline, chain_model())
    assert_named_on_bad_losses(truth, loss_bad, steps)


def test_an_output_changed_in_place_is_checked_as_it_was_produced(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A held output that a later op changes in place (an in-place ReLU over a Linear's
    output) is seen changed at its backward; from the next step on that layer is checked
    as its output is produced. On step 3 the first Linear puts out -inf, which the ReLU
    turns to 0, and a NaN weight later makes the loss NaN: the first offender is the
    first Linear, as produced, not the later layer."""
    kernel_on_cpu()
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 32),
                          nn.Linear(32, 4))
    attachment = attach(model, sample_every=100, sample_after_anomaly=0)
    produced: dict[int, bool] = {}  # the test's own hook: the Linear's output as produced
    step = {"i": 0}
    model[0].register_forward_hook(
        lambda m, a, out: produced.__setitem__(step["i"], bool(out.isfinite().all())))

    def fault(i: int) -> None:
        step["i"] = i
        if i == 3:
            model[0].bias[0] = -math.inf
            model[2].weight[0, 0] = math.nan

    train_with_faults(model, 5, fault)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [i for i, finite in produced.items() if not finite] == [3]
    assert [s["first_nonfinite_layer"] for s in steps] == [None, None, None, 0, None]


def test_outputs_only_the_agent_kept_alive_are_checked_as_produced_past_the_budget(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hold_mb=0: no output is held before the agent has judged its layer (the sampled step
    0 holds none: a weak reference to each output's storage tells at the forward's end
    which autograd kept); from then on an output autograd did not save (layer 4's, which
    the ReLU after it does not keep: ReLU saves its own output) is checked as it is
    produced instead of held, and every output autograd saved is held. So step 4's
    overflow, which the ReLU absorbs (finite loss), is now named; the others as before."""
    kernel_on_cpu()
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    truth, loss_bad, steps = run_poisoned(attach, offline, chain_model(), hold_mb=0)
    assert truth[4] == 4 and not loss_bad[4]
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == {
        i: truth[i] if loss_bad[i] or i == 4 else None for i in range(9)}
    assert [s["forward_nonfinite"] for s in steps] == [
        False, None, True, True, True, True, True, None, None]


def test_hold_mb_must_be_a_size(attach) -> None:
    with pytest.raises(ValueError, match="hold_mb must be a number of MiB >= 0, got -1"):
        attach(chain_model(), hold_mb=-1)


def test_forwards_no_backward_follows_are_still_checked(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held outputs wait for a backward; a training-mode forward that none follows (step
    1: a second forward, its loss never backpropagated) has them checked as the step ends,
    and one under no_grad (step 2), which holds nothing, checked as produced. Both get a
    NaN batch: the first layer is named."""
    kernel_on_cpu()
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    model = chain_model()
    attachment = attach(model, sample_every=100, sample_after_anomaly=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(4)):
        nn.functional.mse_loss(model(x), y).backward()
        if i in (1, 2):
            with torch.set_grad_enabled(i == 1):
                model(torch.full_like(x, math.nan))
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["first_nonfinite_layer"] for s in steps] == [None, 0, 0, None]


def test_a_kernel_that_cannot_run_falls_back_to_checking_every_output(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch,
        agent_errors: list[tuple[str, BaseException]]) -> None:
    """A Triton that cannot compile for the GPU fails the first launch: reported once, and
    from the next step on every output is checked as produced (the absorbed overflow of
    step 4 included), so the run keeps its diagnosis."""
    from ampwatch.agent.collectors import flagged_checks

    def fails(*args: Any) -> None:
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    monkeypatch.setattr(flagged_checks.FlaggedChecks, "check", fails)
    truth, _, steps = run_poisoned(attach, offline, chain_model())
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == truth
    assert [site for site, _ in agent_errors] == ["activations.flagged_checks"]
    agent_errors.clear()


def test_a_fused_optimizer_under_a_scaler_takes_the_held_outputs_path(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused AdamW takes GradScaler's found_inf on the device and always "steps": no
    skip to replay on. After its first step its outputs are held and checked by the
    flagged kernel: a NaN weight in layer 2 at step 3 is named, the healthy steps read
    nothing."""
    kernel_on_cpu()
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    model = chain_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=100, sample_after_anomaly=0)
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    truth = {}
    for i, (x, y) in enumerate(batches(5)):
        if i == 3:
            with torch.no_grad():
                model[2].weight[0, 0] = math.nan
        truth[i] = first_bad_child(model, x)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        model.load_state_dict(clean)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert truth == {0: None, 1: None, 2: None, 3: 2, 4: None}
    assert [s["first_nonfinite_layer"] for s in steps] == [None, None, None, 2, None]
    assert [s["forward_nonfinite"] for s in steps[2:]] == [None, True, None]
