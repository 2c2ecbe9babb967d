"""The step guard (agent/step_guard.py) on real CPU training: a bad step under the guard
leaves the weights and optimizer state bit for bit as a loop that never called that
step's `optimizer.step()`; healthy runs are left alone; `max_skips` stops a failing run.

The truth is the test's own reference loop, never the agent's output."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampwatch.agent.step_guard import GuardSettings, GuardStop
from tests.agent.factories import batches, mlp, spooled_steps
from tests.agent.test_hot_path import sync_calls  # noqa: F401  (a fixture)

STEPS, BAD = 10, 6

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=False),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
}
# (optimizer, mode): every way of leaving a step out, on each optimizer that takes it
CASES = [(o, m) for o in OPTIMIZERS for m in ("auto", "select", "sync")] + [
    ("adam_fused", "found_inf"), ("sgd_fused", "found_inf")]


def poisoned(kind: str, at: set[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches with a NaN input ("nan") or targets 1000x too large ("spike") at `at`."""
    data = batches(STEPS)
    for i in at:
        x, y = data[i]
        if kind == "nan":
            x = x.clone()
            x[0, 0] = float("nan")
        else:
            y = y * 1000.0
        data[i] = (x, y)
    return data


def train(model: nn.Module, optimizer: Any, data: list, leave_out: int | None = None) -> None:
    """bf16 autocast, no scaler, an LR scheduler stepping every step (as GradScaler users
    do when a step is skipped); `leave_out`: the step whose optimizer.step() is not called."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        if i != leave_out:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def assert_same_state(a: nn.Module, oa: Any, b: nn.Module, ob: Any) -> None:
    for (name, ta), tb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.isfinite(ta).all(), name
        assert torch.equal(ta, tb), f"{name} differs"
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].keys() == sb[key].keys()
        for field in sa[key]:
            assert torch.equal(sa[key][field], sb[key][field]), f"state {key}.{field} differs"
    assert [g["lr"] for g in oa.param_groups] == [g["lr"] for g in ob.param_groups]


def guarded_run(attach: Callable[..., Any], optimizer_name: str, guard: Any, data: list
                ) -> tuple[nn.Module, Any, Any]:
    model = mlp()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    attachment = attach(model, guard=guard)
    train(model, optimizer, data)
    attachment.flush()
    return model, optimizer, attachment


@pytest.mark.parametrize(("optimizer_name", "mode"), CASES)
def test_a_nan_batch_is_left_out_bit_for_bit(attach, offline: Path, optimizer_name: str,
                                             mode: str) -> None:
    data = poisoned("nan", {BAD})
    model, optimizer, attachment = guarded_run(attach, optimizer_name, {"mode": mode}, data)
    reference = mlp()
    ref_opt = OPTIMIZERS[optimizer_name](reference.parameters())
    train(reference, ref_opt, data, leave_out=BAD)
    assert_same_state(model, optimizer, reference, ref_opt)
    assert attachment.healthy
    steps = spooled_steps(offline, attachment.run_id)
    assert [(s["step"], s["skipped"], s["guarded"]) for s in steps if s["skipped"]] == [
        (BAD, True, "nonfinite_loss")]


@pytest.mark.parametrize(("optimizer_name", "mode"),
                         [("adam_foreach", "select"), ("adam_fused", "found_inf"),
                          ("sgd_momentum", "sync"), ("adamw_fused", "select")])
def test_a_spike_batch_is_left_out_bit_for_bit(attach, offline: Path, optimizer_name: str,
                                               mode: str) -> None:
    data = poisoned("spike", {BAD})
    guard = {"mode": mode, "skip_spikes": 10, "min_history": 3}
    model, optimizer, attachment = guarded_run(attach, optimizer_name, guard, data)
    reference = mlp()
    ref_opt = OPTIMIZERS[optimizer_name](reference.parameters())
    train(reference, ref_opt, data, leave_out=BAD)
    assert_same_state(model, optimizer, reference, ref_opt)
    steps = spooled_steps(offline, attachment.run_id)
    assert [(s["step"], s["guarded"]) for s in steps if s["skipped"]] == [(BAD, "loss_spike")]


def test_a_bad_first_step_leaves_no_optimizer_state_behind(attach, offline: Path) -> None:
    """The first step would create Adam's state: a skipped one must create none."""
    data = poisoned("nan", {0})
    model, optimizer, attachment = guarded_run(attach, "adam_fused", True, data)
    reference = mlp()
    ref_opt = OPTIMIZERS["adam_fused"](reference.parameters())
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # as GradScaler users see
        train(reference, ref_opt, data, leave_out=0)
    assert_same_state(model, optimizer, reference, ref_opt)


@pytest.mark.parametrize("mode", ["select", "sync", "found_inf"])
def test_healthy_runs_are_left_alone(attach, offline: Path, mode: str) -> None:
    data = batches(STEPS)
    guard = {"mode": mode, "skip_spikes": 3, "min_history": 3}
    model, optimizer, attachment = guarded_run(attach, "adam_fused", guard, data)
    reference = mlp()
    ref_opt = OPTIMIZERS["adam_fused"](reference.parameters())
    train(reference, ref_opt, data)
    assert_same_state(model, optimizer, reference, ref_opt)
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == STEPS
    assert not any(s["skipped"] or s["guarded"] for s in steps)


def test_without_the_guard_the_nan_reaches_the_weights_and_healthy_says_so(attach) -> None:
    model = mlp()
    optimizer = OPTIMIZERS["adam_foreach"](model.parameters())
    attachment = attach(model)
    assert attachment.healthy
    train(model, optimizer, poisoned("nan", {BAD}))
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the test's truth
    assert not attachment.healthy


def first_nonfinite_module(model: nn.Module, x: torch.Tensor) -> str:
    """The test's own truth: the first module, in forward order, whose output is
    not finite."""
    seen: list[str] = []
    handles = [m.register_forward_hook(
        lambda mod, a, out, name=name: seen.append(name)
        if not torch.isfinite(out).all() else None)
        for name, m in model.named_modules() if name]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    for h in handles:
        h.remove()
    return seen[0]


def test_max_skips_stops_the_run_naming_step_layer_and_bundle(attach, offline: Path) -> None:
    data = poisoned("nan", set(range(4, STEPS)))
    model = mlp()
    optimizer = OPTIMIZERS["adam_foreach"](model.parameters())
    attachment = attach(model, guard={"max_skips": 3})
    with pytest.raises(GuardStop) as stopped:
        train(model, optimizer, data)
    error = stopped.value
    assert (error.step, error.streak, error.reason) == (6, 3, "nonfinite_loss")
    assert error.layer == first_nonfinite_module(model, data[4][0])
    assert error.bundle is not None and Path(error.bundle).is_file()
    assert "step 6" in str(error) and error.layer in str(error) and error.bundle in str(error)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert attachment.healthy


@pytest.mark.parametrize("bad", [{"skip_spikes": 1}, {"max_skips": 0}, {"mode": "x"},
                                 {"nope": 1}, "yes"])
def test_a_wrong_guard_option_raises(bad: Any) -> None:
    with pytest.raises(ValueError):
        GuardSettings.parse(bad)


@pytest.mark.parametrize(("optimizer_name", "mode"),
                         [("adam_fused", "found_inf"), ("adam_foreach", "select"),
                          ("sgd_momentum", "sync")])
def test_a_closure_step_is_guarded_too(attach, offline: Path, optimizer_name: str,
                                       mode: str) -> None:
    """`optimizer.step(closure)` (Lightning's path without a scaler): the grads come
    inside step(), and the guard still decides before the optimizer reads them."""
    data = poisoned("nan", {BAD})

    def run(model: nn.Module, optimizer: Any, leave_out: int | None = None) -> None:
        for i, (x, y) in enumerate(data):
            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                loss.backward()
                return loss
            if i == leave_out:
                closure()
            else:
                optimizer.step(closure)
            optimizer.zero_grad(set_to_none=True)

    model = mlp()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    attachment = attach(model, guard={"mode": mode})
    run(model, optimizer)
    attachment.flush()
    reference = mlp()
    ref_opt = OPTIMIZERS[optimizer_name](reference.parameters())
    run(reference, ref_opt, leave_out=BAD)
    assert_same_state(model, optimizer, reference, ref_opt)
    steps = spooled_steps(offline, attachment.run_id)
    assert [(s["step"], s["guarded"]) for s in steps if s["skipped"]] == [
        (BAD, "nonfinite_loss")]


@pytest.mark.parametrize(("mode", "reads"), [("found_inf", 0), ("select", 0), ("sync", 1)])
def test_the_guard_reads_the_host_only_in_sync_mode(attach, offline: Path, sync_calls,  # noqa: F811
                                                    mode: str, reads: int) -> None:
    """After the first step (which creates Adam's state, so is decided on the host), the
    guard adds no syncing call to the agent's own on the training thread (on the CPU the
    agent reads host tensors there, which waits for nothing), but one read a step in sync
    mode. (A bad step would change what the agent itself reads, so the runs are healthy:
    the guard's decision takes the same device ops either way.)"""
    from collections import Counter

    def counted(guard: Any) -> Counter[str]:
        model = mlp()
        optimizer = OPTIMIZERS["adam_fused"](model.parameters())
        attach(model, guard=guard)
        data = batches(STEPS)  # the guard's device work has no branch on the data
        train(model, optimizer, data[:2])
        sync_calls.clear()
        train(model, optimizer, data[2:])
        return Counter(sync_calls)

    plain = counted(False)
    watched = counted({"mode": mode, "skip_spikes": 10, "min_history": 3})
    steps = STEPS - 2
    assert watched == plain + Counter({"__bool__": reads * steps})


def test_with_a_grad_scaler_the_guard_leaves_skipping_to_it(attach, offline: Path) -> None:
    from tests.agent.factories import fp16_loop

    def run(guard: Any) -> tuple[nn.Module, Any, Any]:
        model = mlp()
        optimizer = OPTIMIZERS["adam_foreach"](model.parameters())
        scaler = torch.amp.GradScaler("cpu")
        attachment = attach(model, scaler, guard=guard)
        fp16_loop(model, optimizer, scaler, poisoned("nan", {BAD}))
        attachment.flush()
        return model, optimizer, attachment

    model, optimizer, attachment = run(True)
    reference, ref_opt, _ = run(False)
    assert_same_state(model, optimizer, reference, ref_opt)
    steps = spooled_steps(offline, attachment.run_id)
    assert any(s["skipped"] for s in steps)  # the scaler's skips
    assert all(s["guarded"] is None for s in steps)


GUARDED_SCRIPT = """
import torch
from torch import nn
from ampwatch import agent
from tests.agent.factories import mlp
from tests.agent.test_step_guard import poisoned, train

model = mlp()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
attachment = agent.attach(model, guard=True)
train(model, optimizer, poisoned("nan", {3, 6}))
attachment.detach(timeout=10)
"""


def test_each_step_left_out_is_logged_once_at_warning(offline: Path) -> None:
    """What a script without any logging setup shows its user: one WARNING line (through
    the `ampwatch` logger) for each step the guard left out, none for the others."""
    done = subprocess.run([sys.executable, "-c", GUARDED_SCRIPT], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": ""},
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    told = [line for line in done.stderr.splitlines() if "guard" in line]
    assert told == [
        f"ampwatch guard: left out step {step} (nonfinite_loss): the optimizer did not "
        "apply it; the LR scheduler steps as usual" for step in (3, 6)], done.stderr
