"""How the model is spread over ranks, and what one rank's gradients are a part of.

`grad_layout` names how the server must read each rank's grad norms:
- "local": one process; the norms are the model's.
- "replicated" (DDP): after the all-reduce every rank holds the same grads, so only
  rank 0 sends per-layer norms (each rank still sends its total, scale, skips, loss,
  forward flags and timings).
- "sharded" (FSDP2, FSDP1, DTensor parameters): each rank holds a part of each grad and
  sends the norms of its own parts; the layer's norm is the square root of the sum of the
  squares over the ranks, which the server takes. No collective is added to the step.

A DTensor grad is read through its local tensor (`to_local()`, no communication). A part
that every rank of a mesh dimension holds in full (`Replicate`) is weighted by one over
that dimension's size, so the sum over the ranks counts it once. A `Partial` grad (an
unreduced sum) has no norm a rank can compute: its layers are left out and named.
Host-only; runs at attach.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed
from torch import nn

try:  # torch.distributed may be built without DTensor support
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - every supported torch build has it
    DTensor = Partial = Replicate = None  # type: ignore[assignment,misc]

LOCAL, REPLICATED, SHARDED = "local", "replicated", "sharded"


def is_dtensor(tensor: Any) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view, no communication); any other tensor as is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


# parallelisms whose ranks each hold a shard of the weights: the whole model exists only
# through a collective (an all-gather), which one rank alone must never start
SHARDED_PARALLELISMS = ("fsdp1", "fsdp2", "dtensor")


def parallelism(model: nn.Module, params: list[torch.Tensor]) -> str | None:
    """"ddp", "fsdp2", "fsdp1", "dtensor" (tensor parallel or other DTensor params),
    or None (a single process, or a wrapper the agent does not know)."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return "fsdp1"
    if any(is_dtensor(p) for p in params):
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            return "fsdp2"
        return "dtensor"
    return None


def grad_layout(kind: str | None, world_size: int) -> str:
    if world_size <= 1 or kind is None:
        return LOCAL
    return REPLICATED if kind == "ddp" else SHARDED


def shard_weight(param: torch.Tensor, kind: str | None, world_size: int) -> float | None:
    """The factor this rank's squared grad norm of `param` enters the sum over ranks with:
    1 for a sharded DTensor or an FSDP1 flat shard, 1/n per Replicate mesh dimension of
    size n, 1/world_size for a plain tensor beside DTensors (tensor parallel keeps those
    whole on every rank), None for a Partial placement (no rank can take its norm)."""
    if not is_dtensor(param):
        return 1.0 / world_size if kind == "dtensor" else 1.0
    weight = 1.0
    placements = param.placements
    grad = param.grad
    if grad is not None and is_dtensor(grad):
        placements = grad.placements
    for size, placement in zip(param.device_mesh.shape, placements, strict=True):
        if isinstance(placement, Partial):
            return None
        if isinstance(placement, Replicate):
            weight /= size
    return weight


_shared_ids = 0  # attach() calls in this process: the n-th call of every rank shares an id
SHARED_ID_TIMEOUT_S = 30.0


def shared_run_id(own_id: str, rank: int, world_size: int) -> str:
    """The run id every rank uses when none was given: rank 0's, passed through the
    process group's key-value store (no collective on the training process group).
    Waits up to SHARED_ID_TIMEOUT_S for rank 0 to publish it, then keeps `own_id`."""
    global _shared_ids
    if world_size <= 1:
        return own_id
    import datetime

    import torch.distributed as dist

    _shared_ids += 1
    key = f"ampwatch/run_id/{_shared_ids}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, own_id)
        return own_id
    store.wait([key], datetime.timedelta(seconds=SHARED_ID_TIMEOUT_S))
    return store.get(key).decode()
