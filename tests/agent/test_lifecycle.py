"""attach/detach, the context manager, enabled=False, the guard, fork and exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ampwatch import agent
from ampwatch.agent import errors, patches
from ampwatch.agent.collectors.grads import GradNormCollector
from tests.agent.factories import batches, bf16_loop, fp16_loop, mlp, spooled, spooled_steps

REPO = Path(__file__).resolve().parents[2]


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_detach_removes_everything_and_is_idempotent(attach) -> None:
    model = mlp()
    scaler = torch.amp.GradScaler("cpu")
    clip, backward = nn.utils.clip_grad_norm_, torch.Tensor.backward
    zero_grads = torch.optim.Optimizer.zero_grad, nn.Module.zero_grad
    attachment = attach(model, scaler, sample_every=1)
    # a step on: a sampled step's layer hooks go on as its forward begins
    fp16_loop(model, torch.optim.SGD(model.parameters(), lr=0.01), scaler, batches(1))
    assert _hook_count(model) > 2 and "step" in vars(scaler)
    assert nn.utils.clip_grad_norm_ is not clip
    assert attachment.detach() and attachment.detach()
    assert _hook_count(model) == 0
    assert not {"scale", "unscale_", "step", "update"} & set(vars(scaler))
    assert nn.utils.clip_grad_norm_ is clip and torch.Tensor.backward is backward
    assert (torch.optim.Optimizer.zero_grad, nn.Module.zero_grad) == zero_grads
    assert not any(p._listeners for p in (patches.BACKWARD, patches.CLIP_GRAD_NORM,
                                          patches.SCHEDULER_STEP, patches.ZERO_GRAD))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fp16_loop(model, optimizer, scaler, batches(1))  # still trains


def test_context_manager_flushes_on_exit(offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with agent.attach(model) as attachment:
        bf16_loop(model, optimizer, batches(3))
    assert not attachment.enabled
    assert len(spooled_steps(offline, attachment.run_id)) == 3


def test_detach_tells_the_server_the_run_finished(offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = agent.attach(model)
    bf16_loop(model, optimizer, batches(2))
    attachment.flush(5)
    assert not [ev for e in spooled(offline, attachment.run_id) for ev in e["batch"]["events"]]
    attachment.detach()
    events = [ev for e in spooled(offline, attachment.run_id) for ev in e["batch"]["events"]]
    assert [ev["kind"] for ev in events] == ["finished"]


def test_disabled_attachment_is_a_no_op(offline: Path) -> None:
    model = mlp()
    attachment = agent.attach(model, enabled=False, run="given")
    assert attachment.run_id == "given" and _hook_count(model) == 0
    assert attachment.flush(1) and attachment.detach()
    assert not offline.exists()


def test_optimizer_found_among_several(attach, offline: Path) -> None:
    model, other = mlp(), mlp(1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attachment = attach(model)
    for _ in range(2):
        other(torch.randn(2, 16)).sum().backward()
        other_opt.step()
        model(torch.randn(2, 16)).sum().backward()
        optimizer.step()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["lr"] for s in steps] == [0.1, 0.1]


def test_guard_swallows_collector_errors_in_production(attach, offline: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    errors.set_error_handler(None)  # production: nothing re-raised

    def broken(self, *args):
        raise RuntimeError("collector bug")

    monkeypatch.setattr(GradNormCollector, "on_grads", broken)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler)
    before = errors.error_counts().get("grads.on_grads", 0)
    fp16_loop(model, optimizer, scaler, batches(3))
    attachment.flush(5)
    assert errors.error_counts()["grads.on_grads"] == before + 3
    entries = spooled(offline, attachment.run_id)
    steps = [s for e in entries for s in e["batch"]["steps"]]
    assert len(steps) == 3 and all(s["loss_scale"] == 65536.0 for s in steps)
    if before == 0:
        events = [ev for e in entries for ev in e["batch"]["events"]]
        assert events[0]["kind"] == "agent_error"
        assert "collector bug" in events[0]["detail"]["message"]


def test_check_speedup_sends_an_event(attach, offline: Path) -> None:
    model = mlp()
    attachment = attach(model)
    x, y = batches(1)[0]
    hooks = _hook_count(model)
    speedup = attachment.check_speedup(x, lambda out: nn.functional.mse_loss(out, y), steps=2)
    attachment.flush(5)
    (entry,) = spooled(offline, attachment.run_id)
    (event,) = entry["batch"]["events"]
    assert event["kind"] == "speed_check" and event["detail"]["speedup"] == speedup
    assert event["detail"]["dtype"] == "bfloat16" and event["detail"]["fp32_ms"] > 0
    assert entry["batch"]["steps"] == []  # the private copy's steps are not recorded
    assert _hook_count(model) == hooks


def _run_script(body: str, env: dict[str, str],
                timeout: float = 120) -> subprocess.CompletedProcess:
    script = textwrap.dedent("""
        import os, sys, torch
        torch.set_num_threads(1)
        sys.path.insert(0, {repo!r})
        from ampwatch import agent
        from tests.agent.factories import batches, bf16_loop, mlp
    """).format(repo=str(REPO)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_exit_flushes_the_last_steps(offline: Path) -> None:
    result = _run_script("""
        model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        a = agent.attach(model, run="exit-run", flush_interval=60)
        bf16_loop(model, opt, batches(5))
    """, {"AMPWATCH_MODE": "offline", "AMPWATCH_SPOOL_DIR": str(offline)})
    assert result.returncode == 0, result.stderr
    assert [s["step"] for s in spooled_steps(offline, "exit-run")] == [0, 1, 2, 3, 4]


def test_forked_child_neither_records_nor_flushes(offline: Path) -> None:
    result = _run_script("""
        model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        a = agent.attach(model, run="fork-run")
        bf16_loop(model, opt, batches(2))
        pid = os.fork()
        if pid == 0:
            bf16_loop(model, opt, batches(3))  # the child trains: not recorded
            os._exit(0 if not a.enabled else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        bf16_loop(model, opt, batches(1))
        a.detach()
    """, {"AMPWATCH_MODE": "offline", "AMPWATCH_SPOOL_DIR": str(offline)})
    assert result.returncode == 0, result.stderr
    assert [s["step"] for s in spooled_steps(offline, "fork-run")] == [0, 1, 2]
