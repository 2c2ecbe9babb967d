"""One rank of a multi-rank training job on the CPU (gloo), for tests/agent/test_ranks.py.

`main` runs under `torch.multiprocessing.spawn`: it trains tiny models with the agent
attached, one run per scenario, and writes what the test needs as ground truth to
`<out>/rank-<r>.json`: the grads' norms taken here from the full gradients (DTensors
gathered with `full_tensor()`, a collective the test adds, not the agent), the loss scale
before each step, whether the optimizer stepped, and what the agent reported about itself.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 6
CLIP = 0.05  # max_norm: below the tiny model's grad norms
OVERFLOW_STEP = 3  # the last rank's input overflows fp16 in the first layer here
STRAGGLER_SLEEP_S = 0.03


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))


def _full(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def layer_norms(model: nn.Module) -> dict[str, float]:
    """Per module that owns parameters: the 2-norm of its full grads, in float64."""
    norms = {}
    for name, module in model.named_modules():
        grads = [_full(p.grad).double() for p in module.parameters(recurse=False)
                 if p.grad is not None]
        if grads:
            norms[name] = math.sqrt(sum(float(g.square().sum()) for g in grads))
    return norms


def wrap(scenario: str, model: nn.Module, world: int) -> nn.Module:
    if scenario.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if scenario == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    if scenario == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True,
                                        device_id=torch.device("cpu"))
    if scenario == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        return parallelize_module(model, mesh, {"2": ColwiseParallel(), "3": RowwiseParallel()})
    raise ValueError(scenario)


def make_scaler(scenario: str, rank: int) -> Any:
    if scenario == "tp":
        return None
    init_scale = 2.0 ** 10
    if scenario == "ddp_scalers" and rank == 1:
        init_scale = 2.0 ** 11  # the loop bug: this rank's GradScaler starts elsewhere
    if scenario.startswith("fsdp"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device="cpu", init_scale=init_scale, growth_interval=2)
    return torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)


def clip_per_mesh(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip as accelerate does for DTensor grads (a TP model mixes them with plain ones):
    `get_total_norm` per device mesh, then `clip_grads_with_norm_` with the whole norm."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    total = torch.linalg.vector_norm(torch.stack(
        [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def train(scenario: str, rank: int, world: int, server: str, run_id: str) -> dict:
    from ampwatch import agent
    from ampwatch.agent import errors

    errors_before = errors.error_counts()  # a forked rank inherits the parent's counts
    model = wrap(scenario, tiny_model(), world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make_scaler(scenario, rank)
    stepped: list[bool] = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    # ddp_scalers leaves the run id to the agent: every rank must still write into one run
    run = agent.attach(model, scaler, run=None if scenario == "ddp_scalers" else run_id,
                       server=server, sample_every=1, flush_interval=0.2)
    truth: list[dict] = []
    # tensor parallel ranks compute one batch together; data parallel ranks read their own
    gen = torch.Generator().manual_seed(100 if scenario == "tp" else 100 + rank)
    straggler = scenario == "ddp" and rank == world - 1
    for step in range(STEPS):
        if straggler:
            time.sleep(STRAGGLER_SLEEP_S)  # a slow data loader on one rank
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        if step == OVERFLOW_STEP and rank == world - 1 and scenario != "tp":
            x = x * 1e6  # a bad data shard: fp16 overflows in the first layer
        before = len(stepped)
        if scaler is None:
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            norms = layer_norms(model)
            scale = None
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ((model(x).float() - y) ** 2).mean()
            scale = float(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norms = layer_norms(model)
        # a clip that acts on most steps: the stored norms must be those before it
        if scenario == "fsdp1":  # FSDP1's own clip all-reduces the shards' norms
            total = float(model.clip_grad_norm_(CLIP))
        elif scenario in ("fsdp2", "tp"):  # DTensor grads: the newer pair, per mesh
            total = float(clip_per_mesh(list(model.parameters()), CLIP))
        else:
            total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        truth.append({"step": step, "layers": norms, "total": total, "loss_scale": scale,
                      "skipped": len(stepped) == before})
    delivered = run.flush(timeout=30)
    run.detach(timeout=30)
    errors = {site: n - errors_before.get(site, 0) for site, n in errors.error_counts().items()
              if n != errors_before.get(site, 0)}
    return {"run_id": run.run_id, "steps": truth, "delivered": delivered, "errors": errors}


def main(rank: int, world: int, port: int, server: str, out: str, scenarios: list[str],
         prefix: str) -> None:
    warnings.simplefilter("ignore")  # torch's own DTensor and FSDP notices
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {s: train(s, rank, world, server, f"{prefix}-{s}") for s in scenarios}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
