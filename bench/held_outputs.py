"""What holding layer outputs until their backward costs in memory: the flagged checks of
an accelerator without a scaler's skip (agent/collectors/flagged_checks.py) keep each
unsampled training forward's hooked outputs alive until its backward begins.

Autograd keeps many of them alive anyway, saved for the backward (the next layer's
input). Per model, on an unsampled bf16 step (the device path forced on the CPU, no
scaler): the bytes of every storage autograd saved (the step's activation memory); what
holding adds to it (held storages autograd did not also save), with every output held and
with `hold_mb=0` (the outputs only the agent kept alive are then checked as produced);
and the share of the held bytes that `hold_mb=0` reads instead.

    .venv/bin/python bench/held_outputs.py
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["AMPWATCH_DEVICE_PATH"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel on the CPU: before triton
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ampwatch import agent  # noqa: E402
from ampwatch.agent.collectors.activations import ActivationCollector  # noqa: E402
from bench.agent_overhead import BATCH, GPT, SEQ, VOCAB  # noqa: E402
from tests.zoo.models import ARCHS, loss_of  # noqa: E402


def storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage under `tensor`."""
    s = tensor.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure(model: nn.Module, batch: Callable[[int], Any], hold_mb: float | None,
            saved_hooks: bool) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """Unsampled step 2 of `model` (step 1 tells the agent which outputs only it kept
    alive): {held layer: (storage address, bytes)}, and with `saved_hooks` {address: bytes}
    of the storages autograd saved (the hooks themselves change what kept_alone() sees: a
    saved tensor is then held through its Python object), else {}."""
    held: dict[int, tuple[int, int]] = {}
    saved: dict[int, int] = {}
    check = ActivationCollector._check_held_outputs

    def seen(self: ActivationCollector, loss: Any) -> None:
        held.update((index, storage(output)) for _, index, output, _ in self._held_outputs)
        check(self, loss)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        address, size = storage(tensor)
        saved[address] = size
        return tensor

    ActivationCollector._check_held_outputs = seen
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    attachment = agent.attach(model, sample_every=100, sample_after_anomaly=0, offline=True,
                              spool_dir=tempfile.mkdtemp(prefix="ampwatch-"), hold_mb=hold_mb)
    try:
        for step in range(3):
            held.clear()
            saved.clear()
            hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                     if saved_hooks else contextlib.nullcontext())
            with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
                loss = batch(step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        ActivationCollector._check_held_outputs = check
        attachment.detach(timeout=10)
    return dict(held), dict(saved)


def added(held: dict[int, tuple[int, int]], unsaved: set[int]) -> int:
    """Bytes of the held storages of `unsaved` layers (each storage once)."""
    return sum(dict(held[i] for i in held if i in unsaved).values())


def models() -> list[tuple[str, Callable[[], tuple[nn.Module, Callable[[int], Any]]]]]:
    """(name, a maker of (a fresh model, its loss for a step))."""
    def zoo(arch: Any) -> tuple[nn.Module, Callable[[int], Any]]:
        torch.manual_seed(0)
        model = arch.build()
        return model, lambda step: loss_of(model(**arch.batch(step)))

    def nanogpt() -> tuple[nn.Module, Callable[[int], Any]]:
        torch.manual_seed(0)
        gpt = GPT()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        return gpt, lambda step: nn.functional.cross_entropy(
            gpt(tokens[:, :-1]).float().view(-1, VOCAB), tokens[:, 1:].reshape(-1))

    return ([(arch.name, lambda a=arch: zoo(a)) for arch in ARCHS]
            + [("nanoGPT (bench/agent_overhead.py)", nanogpt)])


def main() -> None:
    print("| model | saved by autograd | added, all held | added, hold_mb=0 "
          "| held bytes read instead |")
    print("|---|---:|---:|---:|---:|")
    for name, make in models():
        every, saved_storages = measure(*make(), hold_mb=None, saved_hooks=True)
        saved = sum(saved_storages.values())
        unsaved = {i for i, (address, _) in every.items() if address not in saved_storages}
        bounded, _ = measure(*make(), hold_mb=0, saved_hooks=False)
        total = sum(dict(every.values()).values())
        print(f"| {name} | {saved / 1024:,.0f} KiB | {added(every, unsaved) / saved:.1%} | "
              f"{added(bounded, unsaved) / saved:.1%} | "
              f"{1 - sum(dict(bounded.values()).values()) / total:.0%} |")


if __name__ == "__main__":
    main()
