"""The per-layer search of a flagged step: replay its forward and name the first layer whose
output held inf/NaN, in execution order (`ReplaySearch`, one way of first_bad_layer.py).

A healthy step reads no layer output (docs/agent.md, "Cheap by design"). As each
unsampled training forward begins, the agent keeps references to its inputs and a copy
of the RNG states (host values: the CPU generator's state, and a CUDA generator's seed and
offset, which live on the host). The search runs only when the step is known bad without
waiting for the device:

- on the CPU, when the step's loss comes back inf/NaN (read as the backward begins: on the
  CPU the loss is a host value, reading it waits for nothing);
- on an accelerator under a GradScaler, when the scaler skipped the optimizer step: its
  `step()` has already read found_inf (its own sync), and a skip leaves the weights as the
  forward saw them.

The forward then runs again under no_grad with the same weights (no update has run),
inputs, RNG state and autocast, through the eager module (a compiled model's `_orig_mod`:
its layers are named, and nothing is traced, so no graph break), with a forward hook on
each layer, for the replay only, that checks its output as it is produced, before a later
in-place op can change it. CPU kernels are deterministic, so there the replay computes the
step's own values; on a GPU a kernel whose reduction order varies can differ in the last
bits, which does not change where an inf/NaN first appears. The buffers the replay
wrote to (BatchNorm statistics) are put back as they were.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampwatch.agent.collectors import finite_checks
from ampwatch.agent.collectors.finite_checks import FINITE, Call, first_float_tensor
from ampwatch.agent.collectors.first_bad_layer import FirstBadLayer
from ampwatch.agent.compiled import unwrap

if TYPE_CHECKING:
    from ampwatch.agent.loop_watch import LoopWatch


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The RNG states a forward on `device` draws from (host tensors; no device sync:
    a CUDA generator's state is its seed and offset, kept on the host)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


@dataclass
class HeldForward:
    """One training forward's inputs as it began (references, and the RNG states copied),
    and the module the loop called (the model, or a submodule it called itself)."""

    module: nn.Module
    args: tuple
    kwargs: dict
    device: torch.device  # the model's, whose autocast and generator are kept
    rng: dict[str, torch.Tensor]  # rng_states(device)
    autocast: torch.dtype | None  # that device's autocast dtype in effect as it began


def hold(module: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> HeldForward:
    """Training thread: a few KB of host copy, no tensor read, no wait for a device."""
    kind = device.type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    return HeldForward(module, args, dict(kwargs), device, rng_states(device), autocast)


def loss_is_bad(loss: torch.Tensor | None) -> bool:
    """Whether the step's loss says the search must run (unknown counts as bad). Host
    tensors only: reads the loss."""
    if loss is None:
        return True
    loss = loss.detach()
    if loss.numel() == 1:
        return not math.isfinite(loss.item())
    return not bool(torch.isfinite(loss).all())


def first_bad_output(module: nn.Module, held: HeldForward,
                     layers: list[tuple[int, nn.Module]], on_device: bool = False
                     ) -> Call | None:
    """Replay `held` through `module.forward` (its own hooks bypassed: the agent's root
    hooks must not count it as a training forward); the first output of `layers` (index,
    module) with inf/NaN as a call (layer index, dtype, (min, max)), or None when every
    output is finite. Each layer's check is its last forward hook, as the agent's own
    are: it sees the output the user's hooks returned. On the host each output is read as
    it is checked (the replay stops checking at the first bad one); `on_device` (the
    accelerator path), each (min, max) stays on the device and all of them are read at the
    end, at once: one wait."""
    found: list[Call] = []
    pending: list[tuple[int, torch.dtype, torch.Tensor]] = []  # device (min, max) pairs

    def check(index: int, output: Any) -> None:
        if found:
            return
        tensor = first_float_tensor(output)
        if tensor is None or not tensor.numel():
            return
        if on_device:
            pending.append((index, tensor.dtype, torch.stack(torch.aminmax(tensor.detach()))))
            return
        stats = finite_checks.finite_check(tensor.detach())
        # a sum of finite values can overflow: then the exact (min, max) decides
        if stats is not FINITE and not (math.isfinite(stats[0]) and math.isfinite(stats[1])):
            found.append((index, tensor.dtype, stats, None, None))

    # (the copy, the version): only a buffer the replay wrote to is put back (BatchNorm's
    # statistics); writing to the others would bump the version of a buffer autograd saved
    # for the step's backward (BERT's token_type_ids) and break that backward
    buffers = {name: (b.detach().clone(), b._version) for name, b in module.named_buffers()}
    handles = [layer.register_forward_hook(
        lambda m, a, out, index=index: check(index, out)) for index, layer in layers]
    autocast = (torch.autocast(held.device.type, dtype=held.autocast)
                if held.autocast is not None else contextlib.nullcontext())
    cuda = "cuda" in held.rng
    try:
        with torch.random.fork_rng(devices=[held.device] if cuda else []), torch.no_grad(), \
                autocast:
            torch.set_rng_state(held.rng["cpu"])
            if cuda:
                torch.cuda.set_rng_state(held.rng["cuda"], held.device)
            module.forward(*held.args, **held.kwargs)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, value in module.named_buffers():
                kept = buffers.get(name)
                if kept is not None and value._version != kept[1] \
                        and value.shape == kept[0].shape:
                    value.copy_(kept[0])
    if pending:  # the one read of the search on a device
        pairs = torch.stack([pair.float() for _, _, pair in pending]).tolist()
        for (index, dtype, _), (low, high) in zip(pending, pairs, strict=True):
            if not (math.isfinite(low) and math.isfinite(high)):
                return index, dtype, (low, high), None, None
    return found[0] if found else None



class ReplaySearch(FirstBadLayer):
    """Holds each unsampled training forward's inputs; replays them, in order, up to the
    first with a bad output, when the step is known bad: on the CPU its loss (a host
    value, read as backward begins), on an accelerator its GradScaler's skip. Not over
    several ranks: replaying one rank's forward alone could enter a collective (DDP's
    buffer broadcast, FSDP's all-gather) the other ranks never join.

    A fused optimizer under a scaler takes found_inf on the device and always "steps": no
    host fact to go by, so after its first step `no_skip()` moves the collector to
    another way."""

    hooks_every_step = False  # a healthy step runs no layer hook

    def __init__(self, watch: LoopWatch, layers: list[tuple[int, nn.Module]],
                 no_skip: Callable[[], None]) -> None:
        super().__init__(watch)
        self.layers = layers  # (layer index, module) of every layer
        self.no_skip = no_skip
        self.held: list[HeldForward] = []  # this step's training forwards, not yet judged
        self.searched = False  # this step's forwards were searched (replayed)

    def forward_begin(self, sampled: bool, training: bool, args: tuple, kwargs: dict) -> None:
        if training and not sampled:
            owner = self.watch.forward_owner
            module = self.watch.inner if owner is None else unwrap(owner)
            self.held.append(hold(module, args, kwargs, self.watch.device))

    def backward_begin(self, loss: torch.Tensor | None, calls: list[Call]) -> None:
        # the CPU's flag: the loss, a host value (an accelerator's would need a sync)
        if self.watch.host_reduce:
            held, self.held = self.held, []
            if held and loss_is_bad(loss):
                self._search(held, calls)

    def step_end(self, stepped: bool, calls: list[Call]) -> None:
        # an accelerator's flag: the GradScaler skipped the step (it read found_inf itself),
        # so the weights are still those the held forwards ran with
        held, self.held = self.held, []
        if held and not self.watch.host_reduce:
            if getattr(self.watch.optimizer, "_step_supports_amp_scaling", False):
                self.no_skip()
            elif not stepped:
                self._search(held, calls)

    def _search(self, held: list[HeldForward], calls: list[Call]) -> None:
        """Replay the step's held forwards, in order, up to the first with a bad output."""
        self.searched = True
        watch = self.watch
        suspended, watch.suspended = watch.suspended, True  # the replay is no forward
        try:
            for forward in held:
                call = first_bad_output(forward.module, forward, self.layers,
                                        on_device=not watch.host_reduce)
                if call is not None:
                    calls.append(call)
                    break
        finally:
            watch.suspended = suspended

    def seal(self) -> tuple[bool, bool]:
        searched, self.searched = self.searched, False
        self.held = []
        return searched, searched

    def unbind(self) -> None:
        self.held = []
