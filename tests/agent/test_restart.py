"""A job restarted from a checkpoint, end to end against a real server: the second process
attaches with the same run id and the checkpoint's step; its re-done steps take the place
of the first process's copies (ground truth: the losses each process computed)."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from torch import nn

from ampwatch import agent
from tests.agent.factories import batches, mlp, same


def train(model: nn.Module, attachment: agent.Attachment, first_step: int, n: int
          ) -> dict[int, float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = {}
    for step, (x, y) in enumerate(batches(n, seed=first_step), start=first_step):
        attachment.step = step
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    return losses


def test_restart_from_a_checkpoint_supersedes_the_redone_steps(live_server,
                                                                tmp_path: Path) -> None:
    model = mlp()
    with agent.attach(model, run="checkpointed", server=live_server.url,
                      spool_dir=tmp_path / "first") as first:
        truth = train(model, first, 0, 6)  # crashes after step 5
        assert first.flush(10)
    with agent.attach(model, run="checkpointed", server=live_server.url,
                      spool_dir=tmp_path / "second", resume=True, step=3) as second:
        truth.update(train(model, second, 3, 5))  # resumed from the checkpoint at 3
        assert second.flush(10)
    items = httpx.get(f"{live_server.url}/api/v1/runs/checkpointed/steps").json()["items"]
    assert [s["step"] for s in items] == list(range(8))
    assert all(same(s["loss"], truth[s["step"]]) for s in items)
    (rank,) = httpx.get(f"{live_server.url}/api/v1/runs/checkpointed").json()["ranks"]
    assert (rank["steps"], rank["last_step"]) == (8, 7)
