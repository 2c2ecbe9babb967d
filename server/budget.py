"""The read budget: how many bytes the answers being built at once may cost, estimated
before the work starts. Without it, 16 concurrent heatmap matrices of a 100,000-layer
run took the server to +6 GB (a body budget bounds writes only)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ampwatch.server.errors import Busy

# What an answer costs while it is built, measured on a live server (docs/security.md):
# about 4 KiB per layer read (rows, per-layer vectors, names, the JSON), plus each
# value sent (a matrix cell, a step's record)
BYTES_PER_LAYER = 4096
BYTES_PER_CELL = 16
BYTES_PER_STEP_ROW = 1024
# a listed note or bundle at its limits (schemas/notes.py, schemas/bundles.py): its
# text, 4 bytes a character at most, and the row around it
BYTES_PER_NOTE = 4 * 4000 + 1024
BYTES_PER_BUNDLE = 4 * 64_000 + 2048


class ReadBudget:
    """Estimated bytes of reads in flight, capped at `max_bytes`; beyond, `Busy` (503 +
    Retry-After). One read estimated above the whole budget still runs when it is the
    only one (it holds the whole budget meanwhile). Thread-safe: read routes run on
    the thread pool."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.in_use = 0
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, estimate: int) -> Iterator[None]:
        take = min(max(estimate, 0), self.max_bytes)
        with self._lock:
            if self.in_use + take > self.max_bytes:
                raise Busy("the server is busy building other large answers "
                           "(AMPWATCH_MAX_INFLIGHT_READ_BYTES); retry")
            self.in_use += take
        try:
            yield
        finally:
            with self._lock:
                self.in_use -= take


def layers_estimate(n_layers: int, columns: int = 0) -> int:
    """The cost of an answer over `n_layers` layers with `columns` values each."""
    return n_layers * (BYTES_PER_LAYER + columns * BYTES_PER_CELL)
