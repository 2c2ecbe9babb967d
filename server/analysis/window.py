"""What every detector is given: one `Window` of stored data. All detectors share one
signature, `detect_*(window, settings) -> Detection`; the registry (registry.py) says
which inputs each one reads, and the service fills those in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from ampwatch.server.analysis.context import RunContext
from ampwatch.server.analysis.localize import Localization, localize
from ampwatch.server.store.fp8_samples import Fp8Window
from ampwatch.server.store.series import StepSeries
from ampwatch.server.store.spike_samples import SpikeWindow


@dataclass
class Window:
    """A rank's recent steps and the run around them.

    series: the rank's steps (Inputs.STEPS; for Inputs.SETUP, its steps without layers).
    run: the run's layer table and environment, as that rank sees them.
    peers: every rank's window over the same steps, by rank (Inputs.RANKS only);
        a detector comparing ranks names the rank each draft belongs to (`draft.rank`).
    fp8: the rank's sampled FP8 statistics (Inputs.FP8 only).
    spikes: the rank's sampled spike signals over the steps' span (Inputs.SPIKES only).
    """

    series: StepSeries
    run: RunContext
    peers: Mapping[int, Window] = field(default_factory=dict)
    fp8: Fp8Window | None = None
    spikes: SpikeWindow | None = None

    @cached_property
    def loc(self) -> Localization:
        """Where the window's non-finite steps began; computed once, shared by the
        detectors that need it."""
        return localize(self.series, self.run)

    @property
    def parallelism(self) -> str | None:
        return self.run.environment.get("parallelism")
