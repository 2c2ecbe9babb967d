"""Spike causes that need more than the sampled signals, each trained for real on the CPU
(bf16 autocast, the spike suite's tiny transformer on a memorisable task so the loss gets
low and flat), with the truth from the test's own loss, grad norm and learning rate:

- a bad batch whose update leaves the loss elevated for a while after the one-step jump
  (HF Trainer's GPT-2 case, 0.0106 -> 6.57 -> 0.0106 and slightly over for four steps)
  is still a bad batch, not "unknown";
- a learning rate multiplied by 50 at step 120 is named, with its values and step, and the
  loss that never comes back makes the finding critical.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from ampwatch import agent
from tests.conftest import LiveServer, agent_errors_fail, module_server
from tests.spikes.model import SEQ, VOCAB, TinyLM
from tests.spikes.scenarios import observed

LR = 3e-3
MAD_TO_SIGMA = 1.4826


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "spike-causes")


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One of four fixed batches of counting sequences (no noise): the model learns them
    by heart, so the loss falls near zero and a bad step stands far out."""
    gen = torch.Generator().manual_seed(step % 4)
    start = torch.randint(0, VOCAB, (16, 1), generator=gen)
    stride = torch.randint(1, 4, (16, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def _train(server: str, steps: int, lr: float, bad_step: int | None = None,
           lr_jump: tuple[int, float] | None = None) -> tuple[str, dict[str, list[float]]]:
    """bf16 AdamW training under the agent; the truth: per step loss, grad norm and lr."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    run_id = f"spike-causes-{uuid.uuid4().hex[:6]}"
    attachment = agent.attach(model, run=run_id, server=server, flush_interval=0.2)
    assert attachment.enabled
    gen = torch.Generator().manual_seed(3)
    truth: dict[str, list[float]] = {"loss": [], "grad_norm": [], "lr": []}
    for step in range(steps):
        if lr_jump is not None and step == lr_jump[0]:
            for group in optimizer.param_groups:
                group["lr"] *= lr_jump[1]
        x, y = _batch(step)
        if step == bad_step:  # foreign tokens
            x = torch.randint(0, VOCAB, x.shape, generator=gen)
            y = torch.randint(0, VOCAB, y.shape, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        truth["grad_norm"].append(float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        truth["loss"].append(float(loss.detach()))
        truth["lr"].append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=30)
    return run_id, truth


def _median_spread(values: list[float]) -> tuple[float, float]:
    ref = np.asarray(values)
    median = float(np.median(ref))
    return median, MAD_TO_SIGMA * float(np.median(np.abs(ref - median)))


def test_a_bad_batch_whose_loss_settles_over_a_few_steps_is_a_bad_batch(
        server: LiveServer) -> None:
    bad = 150
    run_id, truth = _train(server.url, 190, lr=1e-2, bad_step=bad)
    loss, norms = truth["loss"], truth["grad_norm"]
    median, spread = _median_spread(loss[bad - 50: bad])
    # the truth's shape: one step far out, the next back, then a tail the one-step rule
    # cannot see past (over median + 3 spreads, the spike's own end band) yet far under
    # the jump
    assert loss[bad] > 20 * median
    assert loss[bad + 1] < median + 0.1 * (loss[bad] - median)
    tail = np.asarray(loss[bad + 2: bad + 10])
    assert (tail > median + 3 * max(spread, 0.01 * median)).any()
    assert (tail < median + 0.25 * (loss[bad] - median)).all()
    assert norms[bad] >= 2 * float(np.median(norms[bad - 50: bad]))
    got, items = observed(server.url, run_id)
    assert got == {("loss_spike", "bad_batch", None)}, items
    (spike,) = [f for f in items if f["kind"] == "loss_spike"]
    assert spike["step"] == bad
    assert spike["evidence"]["steps_over"] > 1  # the case the one-step rule called unknown
    assert "settling" in spike["message"]


def test_a_learning_rate_jump_is_named_and_a_loss_that_stays_up_is_critical(
        server: LiveServer) -> None:
    change = 120
    run_id, truth = _train(server.url, 190, lr=LR, lr_jump=(change, 50.0))
    loss, lr = truth["loss"], truth["lr"]
    assert lr[change - 1] == pytest.approx(LR) and lr[change] == pytest.approx(50 * LR)
    median, _ = _median_spread(loss[change - 50: change])
    # the damage: the loss never comes back near where it was
    assert min(loss[change + 10:]) > 5 * median
    got, items = observed(server.url, run_id)
    spikes = [f for f in items if f["kind"] == "loss_spike"]
    assert len(spikes) == 1, items
    (spike,) = spikes
    assert change < spike["step"] <= change + 3
    assert (spike["code"], spike["layer"], spike["severity"]) == ("lr_change", None, "critical")
    evidence = spike["evidence"]
    assert evidence["lr_step"] == change
    assert evidence["lr_before"] == pytest.approx(LR)
    assert evidence["lr_after"] == pytest.approx(50 * LR)
    assert "from 0.003 to 0.15 at step 120" in spike["message"]
    # every layer that owns parameters moved together: said, and no one layer is blamed
    jumped, measured = evidence["update_ratio_jumped"]
    assert measured > 2 and jumped >= measured / 2
