"""The per-step device buffer and the pooled host copies it is read through.

Collectors reserve slots at attach; every per-step statistic is written into its slot on
the device. Once per step `snapshot()` issues one non-blocking copy of the whole buffer
into a pooled (pinned, on CUDA) host tensor; the worker thread reads it a step later,
after waiting for the copy's event there, and gives it back with `release()`.
"""

from __future__ import annotations

import threading

import torch


class StepBuffer:
    """One preallocated float64 tensor on the model's device; collectors own slices."""

    # host copies in flight to the worker before steps are dropped: 64 MiB of them, at
    # least 256 and at most 16,384 (a small model's steps can outrun the worker for a
    # while on a busy CPU; it catches up when the loop slows or ends)
    POOL_BYTES = 64 << 20
    POOL_MIN, POOL_MAX = 256, 16384

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._size = 0
        self.tensor: torch.Tensor | None = None
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._lock = threading.Lock()
        self.pool_max = self.POOL_MIN  # set by allocate()
        self._pinned = device.type == "cuda"
        # float64 keeps loss scales, norms and losses exact; MPS has no float64
        self.dtype = torch.float32 if device.type == "mps" else torch.float64

    def reserve(self, n: int) -> int:
        """Reserve `n` slots before `allocate()`; returns their offset."""
        offset = self._size
        self._size += n
        return offset

    def allocate(self) -> None:
        self.tensor = torch.zeros(max(self._size, 1), dtype=self.dtype, device=self.device)
        per_copy = self.tensor.numel() * self.tensor.element_size()
        self.pool_max = max(self.POOL_MIN, min(self.POOL_MAX, self.POOL_BYTES // per_copy))

    def view(self, offset: int, n: int) -> torch.Tensor:
        assert self.tensor is not None
        return self.tensor.narrow(0, offset, n)

    def snapshot(self) -> tuple[torch.Tensor, object | None] | None:
        """Copy the buffer to a host tensor without synchronising the device.

        Returns the host tensor and, on CUDA, an event the reader must wait for; None
        when every pooled host tensor is still in flight (the step is then dropped).
        """
        assert self.tensor is not None
        with self._lock:
            if self._free:
                host = self._free.pop()
            elif self._allocated < self.pool_max:
                self._allocated += 1
                host = torch.empty(self.tensor.shape, dtype=self.dtype,
                                   pin_memory=self._pinned)
            else:
                return None
        host.copy_(self.tensor, non_blocking=self._pinned)
        event = None
        if self._pinned:
            event = torch.cuda.Event()
            event.record()
        return host, event

    def release(self, host: torch.Tensor) -> None:
        with self._lock:
            self._free.append(host)
