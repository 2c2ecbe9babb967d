"""The grad norm is the one backward left, whoever clips and however.

Each loop clips in its own way (torch's `clip_grad_norm_`, the newer `get_total_norm` +
`clip_grads_with_norm_` pair that accelerate uses, a hand-written `_foreach_mul_`, or
not at all), under a GradScaler or without one, with gradient accumulation, and with a
threshold that clips most steps. The truth is the test's own: after each step's last
backward the loop reads its grads (divided by the scale it used), and after its clip it
reads them again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.agent.factories import batches, mlp, same, spooled_steps

MAX_NORM = 0.3  # below most steps' norm: the clip acts on most steps


def _norm(params: list[nn.Parameter], divisor: float = 1.0) -> float:
    grads = [p.grad.detach().double() / divisor for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _clip(kind: str, params: list[nn.Parameter]) -> None:
    if kind == "clip_grad_norm_":
        nn.utils.clip_grad_norm_(params, MAX_NORM)
    elif kind == "total_norm_pair":  # accelerate >= 1.16
        total = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    elif kind == "by_hand":
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        torch._foreach_mul_(grads, torch.clamp(MAX_NORM / (total + 1e-6), max=1.0))


def _train(kind: str, scaled: bool, accumulate: int, attach) -> tuple[list, list, str]:
    model = mlp()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.05)
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    attachment = attach(model, scaler)
    dtype = torch.float16 if scaled else torch.bfloat16
    pre, post = [], []
    for i, (x, y) in enumerate(batches(6 * accumulate)):
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y) / accumulate
        (scaler.scale(loss) if scaler else loss).backward()
        if (i + 1) % accumulate:
            continue
        pre.append(_norm(params, scaler.get_scale() if scaler else 1.0))
        if scaler:
            scaler.unscale_(optimizer)
        _clip(kind, params)
        post.append(_norm(params))
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    return pre, post, attachment.run_id


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("scaled", [True, False], ids=["fp16-scaler", "bf16"])
@pytest.mark.parametrize("kind", ["clip_grad_norm_", "total_norm_pair", "by_hand", "none"])
def test_the_grad_norm_is_taken_before_any_clip(kind: str, scaled: bool, accumulate: int,
                                                 attach, offline: Path) -> None:
    pre, post, run_id = _train(kind, scaled, accumulate, attach)
    steps = spooled_steps(offline, run_id)
    assert [s["step"] for s in steps] == list(range(len(pre)))
    clipped_steps = sum(b < a * (1 - 1e-6) for a, b in zip(pre, post, strict=True))
    if kind != "none":
        assert clipped_steps >= len(pre) - 1  # the clip acted on most steps
    for record, before, after in zip(steps, pre, post, strict=True):
        assert same(record["grad_norm"], before, rel=1e-4), (record["step"], kind)
        if kind == "none":
            assert record["grad_norm_clipped"] is None
        else:
            assert same(record["grad_norm_clipped"], after, rel=1e-4), (record["step"], kind)


def test_a_clip_before_unscale_through_the_new_pair_is_flagged(attach, offline: Path) -> None:
    """The pitfall reads the same whichever clip function the loop calls."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler)
    for x, y in batches(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        _clip("total_norm_pair", list(model.parameters()))  # before unscale_: the pitfall
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["clip_before_unscale"] for s in steps] == [True, True, True]


@pytest.mark.parametrize("scaled", [True, False], ids=["fp16-scaler", "bf16"])
def test_a_shared_clip_clips_as_torch_does(scaled: bool, attach, offline: Path) -> None:
    """`clip_grad_norm_` of the grads the agent read takes its total from the agent's
    per-parameter norms (no second pass): the returned totals and the trained weights
    equal an unwatched run's, to float32's precision."""
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor]]:
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu") if scaled else None
        attachment = attach(model, scaler) if watched else None
        totals = []
        for x, y in batches(6):
            with torch.autocast("cpu", dtype=torch.float16 if scaled else torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.unscale_(optimizer)
            totals.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
            (scaler.step(optimizer), scaler.update()) if scaler else optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if attachment is not None:
            attachment.detach()
        return totals, [p.detach().clone() for p in model.parameters()]

    plain_totals, plain_weights = run(False)
    totals, weights = run(True)
    assert totals == pytest.approx(plain_totals, rel=1e-6)
    for a, b in zip(weights, plain_weights, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
