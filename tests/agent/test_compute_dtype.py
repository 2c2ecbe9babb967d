"""Norms judged by what they compute in, not by what they return: the dtype each layer's
reductions ran in, probed on sampled steps (agent/collectors/compute_dtype.py). The truth
is the test's own dispatch trace of one forward under the same autocast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.agent.factories import spooled

STATISTICS = {torch.ops.aten.mean, torch.ops.aten.native_layer_norm}


class Fp16RMSNorm(nn.Module):
    """An RMSNorm written without the upcast: its variance in fp16, returned in fp32 (the
    fp32 weight promotes it)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def model() -> nn.Sequential:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), GemmaRMSNorm(32), nn.Linear(32, 32),
                         LlamaRMSNorm(32), nn.Linear(32, 32), Fp16RMSNorm(32),
                         nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


class Trace(TorchDispatchMode):
    """Per child of the Sequential: the dtypes its statistics (mean, layer norm) ran in."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.current: str | None = None
        self.seen: dict[str, set[torch.dtype]] = {}
        for name, child in net.named_children():
            child.register_forward_pre_hook(lambda m, a, name=name: setattr(self, "current", name))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func.overloadpacket in STATISTICS:
            self.seen.setdefault(self.current, set()).add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def truth() -> dict[str, set[torch.dtype]]:
    net = model()
    trace = Trace(net)
    with torch.autocast("cpu", dtype=torch.float16), trace:
        net(torch.randn(8, 16))
    return trace.seen


def test_norms_are_judged_by_their_reductions_not_their_output(attach, offline: Path) -> None:
    seen = truth()
    assert seen == {"1": {torch.float32}, "3": {torch.float32}, "5": {torch.float16},
                    "7": {torch.float16}}
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    attachment = attach(net, sample_every=5)
    outputs: dict[str, torch.dtype] = {}
    for name, index in (("gemma", 1), ("fp16", 5)):
        net[index].register_forward_hook(
            lambda m, a, out, name=name: outputs.update({name: out.dtype}) and None)
    for _ in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(torch.randn(8, 16)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    entries = spooled(offline, attachment.run_id)
    table = {layer["name"]: layer["attrs"] for layer in entries[-1]["run"]["layers"]}
    # what each returned is not what it computed in
    assert outputs == {"gemma": torch.float16, "fp16": torch.float32}
    for name, dtypes in seen.items():
        assert table[name]["reduces_in"] == str(min(dtypes, key=lambda d: d.itemsize)
                                                ).removeprefix("torch."), name
    assert "reduces_in" not in table["0"]  # a Linear reduces nothing


def test_the_probe_hooks_only_the_first_sampled_forward(attach, offline: Path) -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    attach(net, sample_every=2)
    hooks: list[int] = []  # the norm's forward pre hooks while it runs, besides this one
    net[1].register_forward_pre_hook(
        lambda m, a: hooks.append(len(m._forward_pre_hooks) - 1))
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(torch.randn(8, 16))
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    # step 0 (sampled, first under fp16 autocast): the probe's besides the sampled ones
    # (the layer's time, the spike signals'); step 2 (sampled again): those only;
    # unsampled steps: none
    assert hooks == [3, 0, 2, 0]
