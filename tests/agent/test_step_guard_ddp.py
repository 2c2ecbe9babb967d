"""The step guard under DDP (gloo, 2 forked CPU processes): a spike in rank 1's batch
alone makes every rank leave that step out (the ranks agree through an all_reduce of the
decision tensor, no host read), and every rank ends bit for bit where a DDP loop that
left out that step's optimizer.step() on every rank ends."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ampwatch import agent
from tests.agent.factories import batches, mlp, spooled
from tests.conftest import free_port

WORLD, STEPS, BAD, SPIKY_RANK = 2, 10, 6, 1


def _train(model: nn.Module, data: list, leave_out: int | None = None) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        if i != leave_out:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        data = batches(STEPS, seed=1 + rank)
        if rank == SPIKY_RANK:
            x, y = data[BAD]
            data[BAD] = (x, y * 1000.0)
        guarded = DDP(mlp())
        attachment = agent.attach(guarded, guard={"skip_spikes": 10, "min_history": 3})
        optimizer = _train(guarded, data)
        attachment.detach(timeout=30)
        reference = DDP(mlp())
        ref_opt = _train(reference, data, leave_out=BAD)
        torch.save({"run_id": attachment.run_id,
                    "guarded": (guarded.module.state_dict(), optimizer.state_dict()),
                    "reference": (reference.module.state_dict(), ref_opt.state_dict())},
                   Path(out, f"rank-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_leaves_out_the_step_one_rank_found_bad(offline: Path,
                                                           tmp_path: Path) -> None:
    # fork: the ranks inherit the imported torch and this test's offline spool settings
    mp.start_processes(_rank, nprocs=WORLD, start_method="fork",
                       args=(free_port(), str(tmp_path)))
    results = [torch.load(tmp_path / f"rank-{r}.pt") for r in range(WORLD)]
    assert len({r["run_id"] for r in results}) == 1
    for rank, result in enumerate(results):
        (weights, state), (ref_weights, ref_state) = result["guarded"], result["reference"]
        for name, tensor in weights.items():
            assert torch.isfinite(tensor).all() and torch.equal(tensor, ref_weights[name]), name
        for key, fields in state["state"].items():
            for field, value in fields.items():
                assert torch.equal(value, ref_state["state"][key][field]), (key, field)
        steps = [s for e in spooled(offline, result["run_id"], rank)
                 for s in e["batch"]["steps"]]
        assert [(s["step"], s["guarded"]) for s in steps if s["skipped"]] == [
            (BAD, "loss_spike")], f"rank {rank}"
    first = results[0]["guarded"][0]
    assert all(torch.equal(first[k], results[1]["guarded"][0][k]) for k in first)
