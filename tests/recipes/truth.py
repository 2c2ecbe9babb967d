"""The test's own record of a watched model's steps, and the check of what the server
stored against it.

Truth comes from the loop, never from the agent: the losses the loop says it
backpropagated into the watched model (`backprop`), the scaler's own scale as those
losses were scaled, and the model's grads read by an optimizer step pre-hook the test
registers (inside `scaler.step` the grads are unscaled by then; a skipped step never
reaches the optimizer, so its pre-hook does not run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampwatch.client import Client
from tests.utils import ANALYSIS_WAIT_S

Expected = tuple[str, str | None, int | None, str]  # (kind or pitfall:code, layer, step, severity)


@dataclass
class StepTruth:
    losses: list[float] = field(default_factory=list)
    loss_scale: float | None = None
    skipped: bool = True  # until the optimizer's pre-hook says it stepped
    grad_norm: float | None = None
    backward_ms: float | None = None  # the loop's own timing of those backward calls


class Truth:
    """One watched model's steps, as the loop knows them: the model's grads are read
    when `optimizer` steps (None: the loop calls `stepped()` itself)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.params = list(dict.fromkeys(model.parameters()))
        self.scaler = scaler
        self.steps: list[StepTruth] = []
        self.current = StepTruth()
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._stepping)

    def _stepping(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.stepped()

    def stepped(self) -> None:
        """The optimizer steps now, with the model's grads as they are (unscaled)."""
        grads = [p.grad.detach().double().flatten() for p in self.params if p.grad is not None]
        self.current.grad_norm = torch.cat(grads).norm().item()
        self.current.skipped = False

    def backprop(self, loss: torch.Tensor, took_ms: float | None = None) -> None:
        """The loop backpropagated `loss` (unscaled) into the watched model (in
        `took_ms`, when the loop timed the call)."""
        self.current.losses.append(float(loss.detach()))
        if took_ms is not None:
            self.current.backward_ms = (self.current.backward_ms or 0.0) + took_ms
        if self.scaler is not None and self.scaler.is_enabled():
            self.current.loss_scale = self.scaler.get_scale()

    def forget(self) -> None:
        """The loop zeroed the watched model's grads: what it backpropagated so far is gone."""
        self.current.losses.clear()
        self.current.backward_ms = None

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = StepTruth()



def close(a: float | None, b: float | None, rel: float) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


DECLINE_HALVINGS = 3  # the server's default: a warning at 3 more halvings than doublings


def scale_decline(truth: Truth) -> set[Expected]:
    """A loss scale that halved 3 times more than it doubled (a shared scaler halves for
    any of its optimizers' overflows: the watched model trains at the lowered scale)."""
    scales = [s.loss_scale for s in truth.steps]
    net = 0
    for i, (before, after) in enumerate(zip(scales[:-1], scales[1:], strict=True)):
        if before is not None and after is not None:
            net += (after < before) - (after > before)
            if net >= DECLINE_HALVINGS:
                return {("scaler_divergence", None, i, "warning")}
    return set()


def check(client: Client, run_id: str, truth: Truth,
          findings: set[Expected] | frozenset[Expected] = frozenset()) -> None:
    """The stored steps match the truth (loss to 1e-4, grad norm to 1e-3, loss scale and
    skips exactly) and the run's warning and critical findings are exactly `findings`
    and a decline of the scale, when the truth has one."""
    stored = list(client.steps(run_id))
    assert [s.step for s in stored] == list(range(len(truth.steps)))
    for got, want in zip(stored, truth.steps, strict=True):
        where = f"step {got.step}: stored {got}, truth {want}"
        assert got.skipped is want.skipped, where
        assert close(got.loss, sum(want.losses) if want.losses else None, 1e-4), where
        assert got.loss_scale == want.loss_scale, where
        if want.backward_ms is not None:  # the agent times inside the loop's own window
            assert got.t_backward_ms is not None and got.t_backward_ms <= want.backward_ms, where
        if want.skipped:
            assert got.grad_norm is not None and not math.isfinite(got.grad_norm), where
        else:
            assert close(got.grad_norm, want.grad_norm, 1e-3), where
    items = list(client.findings(run_id, wait=ANALYSIS_WAIT_S))
    serious = {(f.kind if f.kind != "pitfall" else f"pitfall:{f.code}", f.layer, f.step,
                f.severity) for f in items if f.severity != "info"}
    assert serious == set(findings) | scale_decline(truth), "\n".join(
        f"{f.severity} {f.kind} {f.step} {f.message}" for f in items)
