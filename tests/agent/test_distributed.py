"""How much each rank's squared grad norm counts in the server's sum over ranks, for the
DTensor placements (one process posing as rank 0 of 4 through torch's fake process group)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampwatch.agent import distributed

WORLD = 4


@pytest.fixture
def mesh() -> Iterator:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, 2))
    finally:
        dist.destroy_process_group()


def _param(mesh, placements) -> nn.Parameter:
    from torch.distributed.tensor import DTensor

    return nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, placements,
                                           run_check=False))


def test_each_placement_counts_once_over_the_ranks(mesh) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    # sharded on both mesh dimensions: each rank holds its own part
    assert distributed.shard_weight(_param(mesh, [Shard(0), Shard(1)]), "fsdp2", WORLD) == 1.0
    # HSDP: replicated over the first dimension (2 replicas), sharded over the second
    assert distributed.shard_weight(_param(mesh, [Replicate(), Shard(0)]), "fsdp2",
                                    WORLD) == 0.5
    assert distributed.shard_weight(_param(mesh, [Replicate(), Replicate()]), "dtensor",
                                    WORLD) == 0.25
    # an unreduced sum: no rank can take its norm
    assert distributed.shard_weight(_param(mesh, [Partial(), Shard(0)]), "dtensor",
                                    WORLD) is None
    # a plain parameter beside DTensors is whole on every rank under tensor parallelism
    plain = nn.Parameter(torch.ones(3))
    assert distributed.shard_weight(plain, "dtensor", WORLD) == 0.25
    assert distributed.shard_weight(plain, "fsdp1", WORLD) == 1.0


def test_the_grad_placement_decides_over_the_parameter_one(mesh) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    param = _param(mesh, [Replicate(), Replicate()])
    param.grad = DTensor.from_local(torch.ones(2, 2), mesh, [Partial(), Replicate()],
                                    run_check=False)
    assert distributed.shard_weight(param, "dtensor", WORLD) is None
    assert distributed.local(param.grad).shape == (2, 2)


def test_layouts() -> None:
    assert distributed.grad_layout("ddp", 8) == distributed.REPLICATED
    assert distributed.grad_layout("fsdp2", 8) == distributed.SHARDED
    assert distributed.grad_layout(None, 8) == distributed.LOCAL
    assert distributed.grad_layout("fsdp2", 1) == distributed.LOCAL
