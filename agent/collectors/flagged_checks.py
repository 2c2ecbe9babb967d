"""Between samples on an accelerator without a GradScaler's skip to go by (bf16, fp32, a
fused optimizer): layer outputs checked only when the step's loss says so, without a sync.

The loss's finiteness is a device value there: reading it would wait for the device, and
by the time it can be read without waiting, the optimizer has applied the step and a
replay would not see its weights. So each unsampled training forward's hooked outputs are
held (references, no device op) until its backward begins; then the outputs of each
dtype get one launch of a Triton kernel, given a small table of their addresses, sizes
and call positions (one non-blocking copy), whose programs first read the flag (the loss
not finite, two tiny ops on the loss) and exit at once when it is clear. On a healthy
step that is all the kernel reads: one value per program, never an output. When the flag
is set, the programs read every output and lower the step's first-bad slot to the
position of each that held inf/NaN (`atomic_min`), so after the step the slot holds the
position of the first call, in execution order, whose output held inf/NaN, exactly as
checking every output would.

Holding an output keeps it alive until its backward begins. Autograd saves many layer
outputs for backward anyway (the next layer's input); those cost nothing. The others (a
projection feeding a residual add, the logits before their cast to float32) would cost
their memory until the backward: 14 to 38% of the activation memory on the zoo's models
(bench/held_outputs.py). So at each check the agent notes which layers' outputs it alone
kept alive (nothing else referenced their storage), and on later steps holds such outputs
only up to a budget (`hold_mb`, default 1% of the device's memory); past it an output is
checked as it is produced, with the `aminmax` every output had before (read every step).

The grid is persistent (a few programs per SM, each striding over every output), so a
healthy launch is a few hundred programs whatever the outputs' number and size. On the CPU (the
device path under test, `AMPWATCH_DEVICE_PATH=1`) the same kernel runs in Triton's
interpreter, which needs `TRITON_INTERPRET=1` before triton is first imported
(tests/conftest.py sets it on a machine without CUDA). Where Triton cannot run the
kernel, `available()` is False and every output is checked with `aminmax` instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 1024  # elements per program per stride
PROGRAMS_PER_SM = 4
INTERPRETED_PROGRAMS = 2  # on the CPU, in the interpreter: each program is a Python loop
# the profiler label of an interpreted launch: the interpreter copies the kernel's tensors
# to and from numpy with ATen ops, which a count of elements read leaves out
INTERPRETED = "ampwatch::interpreted_flagged_check"


@functools.cache
def _kernel() -> Any:
    """The kernel module (imports triton: only when the path is used)."""
    from ampwatch.agent.collectors import flagged_kernel

    return flagged_kernel


def dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill one block of memory from its first element, in
    some order (contiguous, channels_last, a transposed result): what the kernel reads,
    `numel` elements from `data_ptr`. Host metadata only."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True),
                               key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def readable(dtype: torch.dtype) -> bool:
    """Whether the kernel reads outputs of `dtype` (after available() said it runs)."""
    return dtype in _kernel().TYPES


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_budget(device: torch.device) -> int:
    """Bytes held outputs may keep alive beyond autograd's: 1% of a CUDA device's memory,
    64 MiB elsewhere (the device path forced on the CPU, under test)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 100
    return 64 << 20


def _base_storage_refs() -> int:
    """A lone tensor's storage count as kept_alone() reads it (untyped_storage() adds one)."""
    lone = torch.empty(1)  # alive while counted, as kept_alone()'s tensor is
    try:
        return torch._C._storage_Use_Count(lone.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return 0  # kept_alone() is then always False


_BASE_STORAGE_REFS = _base_storage_refs()


def kept_alone(tensor: torch.Tensor) -> bool:
    """Whether nothing but `tensor` itself (and, for a view, its base) keeps its storage
    alive: autograd saved neither it nor another view of it (host counters, no device
    work; private APIs, so False where they are missing: the output then counts as kept
    anyway, and is always held). A GEMM's 3-D output is often a view of its 2-D result."""
    try:
        own = _BASE_STORAGE_REFS + (1 if tensor._is_view() else 0)
        return (tensor._use_count() == 1
                and torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= own)
    except (AttributeError, RuntimeError):
        return False


def storage_weak_ref(tensor: torch.Tensor) -> Any:
    """A weak reference to `tensor`'s storage (`expired()` once nothing keeps it alive),
    or None where the private API is missing. Host only."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(tensor.untyped_storage())
    except (AttributeError, ImportError, RuntimeError):
        return None


def available(device: torch.device) -> bool:
    """Whether the kernel runs for tensors on `device`: CUDA (or ROCm) with Triton, or the
    CPU in Triton's interpreter (tests of the device path)."""
    if device.type not in ("cuda", "cpu"):
        return False
    try:
        kernel = _kernel().check
    except Exception:  # noqa: BLE001 (no triton, or one that cannot load here)
        return False
    # a CPU tensor needs the interpreter: TRITON_INTERPRET=1 before triton was imported
    return device.type == "cuda" or type(kernel).__name__ == "InterpretedFunction"


class FlaggedChecks:
    """One step's first-bad slot and the launches that lower it (training thread)."""

    def __init__(self, device: torch.device, no_call: int) -> None:
        self.no_call = no_call  # the slot's value when every output checked was finite
        # the slot's value when the outputs were not checked (the step buffer is float64)
        self.unchecked = torch.full((1,), no_call + 1, dtype=torch.float64, device=device)
        self.first = torch.full((1,), no_call, dtype=torch.int64, device=device)
        self.unknown = torch.ones(1, dtype=torch.bool, device=device)  # the loss unknown
        self._flags: list[torch.Tensor] = []  # this step's, one per checked backward
        self._lost = False  # a launch of this step failed (its outputs went unchecked)
        self.device = device
        self._interpreted = device.type == "cpu"
        self._programs = (INTERPRETED_PROGRAMS if self._interpreted
                          else PROGRAMS_PER_SM * _sm_count(device))

    def flag(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The device flag of a backward's loss: set when it holds inf/NaN, or is unknown."""
        flag = (self.unknown if loss is None
                else torch.isfinite(loss.detach()).logical_not_().any().reshape(1))
        self._flags.append(flag)
        return flag

    def check(self, flag: torch.Tensor, held: list[tuple[int, torch.Tensor]]) -> None:
        """Launch the checks of held (`dense`, `readable`) outputs on this device: (call
        position, output) pairs. One launch per dtype, on this device whichever is
        current (an output elsewhere is skipped: its address means nothing here). The
        outputs stay referenced until it is queued; each is recorded on the launch stream
        (`record_stream`), so the allocator hands its memory on only after the kernel,
        also when it was made on another stream."""
        groups: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for position, output in held:
            if output.device == self.device:
                groups.setdefault(output.dtype, []).append((position, output))
        if not groups:
            return
        if self._interpreted:
            with torch.profiler.record_function(INTERPRETED):
                self._launch(flag, groups)
        else:
            with torch.cuda.device(self.device):  # Triton launches on the current device
                stream = torch.cuda.current_stream(self.device)
                for items in groups.values():
                    for _, output in items:
                        output.record_stream(stream)
                self._launch(flag, groups)

    def _launch(self, flag: torch.Tensor,
                groups: dict[torch.dtype, list[tuple[int, torch.Tensor]]]) -> None:
        kernel = _kernel()
        for dtype, items in groups.items():
            table = torch.tensor([[o.data_ptr() for _, o in items],
                                  [o.numel() for _, o in items],
                                  [p for p, _ in items]], dtype=torch.int64)
            if not self._interpreted:  # a pinned staging copy: non-blocking, no sync
                table = table.pin_memory().to(self.device, non_blocking=True)
            largest = max(o.numel() for _, o in items)
            grid = (max(1, min(self._programs, -(-largest // BLOCK))),)
            kernel.check[grid](flag, table, len(items), self.first,
                               DTYPE=kernel.TYPES[dtype], COMPUTE=kernel.COMPUTE[dtype],
                               BLOCK=BLOCK)

    def lost(self) -> None:
        """A launch failed: this step's held outputs were not checked (`take_into` says
        so rather than calling them finite)."""
        self._lost = True

    def take_into(self, slot: torch.Tensor) -> None:
        """Write this step's result into its float64 first-call `slot` (which holds what
        the outputs checked as produced gave): the first bad call of either when a flag
        was set or an output checked as produced was bad, else `unchecked` (also when a
        launch failed and nothing checked as produced was bad); reset."""
        if self._lost:
            self._flags, self._lost = [], False
            torch.where(slot < self.no_call, slot, self.unchecked, out=slot)
            self.first.fill_(self.no_call)
            return
        if not self._flags:
            return
        flags, self._flags = self._flags, []
        flagged = flags[0] if len(flags) == 1 else torch.cat(flags).any().reshape(1)
        observed = flagged | (slot < self.no_call)
        torch.where(observed, torch.minimum(slot, self.first.to(slot.dtype)),
                    self.unchecked, out=slot)
        self.first.fill_(self.no_call)
