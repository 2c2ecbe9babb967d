"""What detectors know about a run besides its steps: the layer table, the environment,
the rank and where its stream began. Built once per analysis pass."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ampwatch.server.store.series import DTYPE_CODE, DTYPES, FIELD_INDEX, StepSeries

FP16 = DTYPE_CODE["float16"]
BF16 = DTYPE_CODE["bfloat16"]
MIXED = DTYPE_CODE["mixed"]


@dataclass(frozen=True)
class LayerInfo:
    """One row of the run's layer table (see `models.Layer`)."""

    index: int
    name: str
    type: str
    param_count: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)
    forward_index: int | None = None

    @classmethod
    def from_row(cls, row: Any) -> LayerInfo:
        """From a `models.Layer` or anything with the same attributes."""
        return cls(index=row.index, name=row.name, type=row.type,
                   param_count=row.param_count or 0, attrs=dict(row.attrs or {}),
                   forward_index=row.forward_index)


@dataclass(frozen=True, eq=False)
class LayerTable:
    """A run's layers in index order, with per-layer arrays derived once (the service
    caches tables between batches, so detectors stay cheap on ingest)."""

    layers: tuple[LayerInfo, ...] = ()
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, layers: Iterable[Any]) -> LayerTable:
        return cls(tuple(sorted((x if isinstance(x, LayerInfo) else LayerInfo.from_row(x)
                                 for x in layers), key=lambda x: x.index)))

    @cached_property
    def by_index(self) -> dict[int, LayerInfo]:
        return {x.index: x for x in self.layers}

    @cached_property
    def names(self) -> list[str]:
        """Layer names by index ("layer[i]" where the table has a gap)."""
        names = [f"layer[{i}]" for i in range(self.size)]
        for x in self.layers:
            names[x.index] = x.name
        return names

    @cached_property
    def size(self) -> int:
        return max((x.index for x in self.layers), default=-1) + 1

    @cached_property
    def param_counts(self) -> np.ndarray:
        counts = np.zeros(self.size)
        for x in self.layers:
            counts[x.index] = x.param_count
        return counts

    @cached_property
    def forward_position(self) -> np.ndarray:
        """Per layer index, its position in forward execution order (layers never seen
        in forward come after all seen ones, in table order)."""
        unseen = 1 << 40
        keys = np.array([(x.forward_index if x.forward_index is not None else unseen)
                         * (1 << 20) + x.index for x in self.layers], dtype=np.int64)
        position = np.full(self.size, 1 << 50, dtype=np.int64)
        position[[x.index for x in self.layers]] = np.argsort(np.argsort(keys, kind="stable"))
        return position

    def derived(self, name: str, compute: Callable[[LayerTable], Any]) -> Any:
        """`compute(self)`, computed once per table under `name` (for detector-specific
        per-layer data such as GEMM dimensions or layer roles)."""
        if name not in self._memo:
            self._memo[name] = compute(self)
        return self._memo[name]

    def mask(self, predicate: Callable[[LayerInfo], bool], n_layers: int) -> np.ndarray:
        """Per layer index below n_layers, whether `predicate` holds."""
        out = np.zeros(n_layers, dtype=bool)
        out[[x.index for x in self.layers if x.index < n_layers and predicate(x)]] = True
        return out


@dataclass(frozen=True)
class RunContext:
    """The run-level inputs of the detectors.

    first_step: the first step this rank ever sent (calibration counts from there);
    None when unknown, e.g. at registration.
    """

    table: LayerTable = field(default_factory=LayerTable)
    environment: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    first_step: int | None = None

    @classmethod
    def build(cls, layers: Iterable[Any] | LayerTable, environment: dict[str, Any] | None = None,
              rank: int = 0, first_step: int | None = None) -> RunContext:
        table = layers if isinstance(layers, LayerTable) else LayerTable.of(layers)
        return cls(table=table, environment=dict(environment or {}), rank=rank,
                   first_step=first_step)

    @property
    def layers(self) -> tuple[LayerInfo, ...]:
        return self.table.layers

    def layer(self, index: int) -> LayerInfo | None:
        """The layer at table position `index` (None when the table lacks it)."""
        return self.table.by_index.get(index)

    def layer_name(self, index: int) -> str:
        names = self.table.names
        return names[index] if 0 <= index < len(names) else f"layer[{index}]"

    def forward_position(self, n_layers: int) -> np.ndarray:
        """Per layer index below n_layers, its position in forward execution order
        (indices the table lacks come last)."""
        position = self.table.forward_position
        if position.size == n_layers:
            return position
        out = np.arange(n_layers, dtype=np.int64) + (1 << 50)
        width = min(n_layers, position.size)
        out[:width] = position[:width]
        return out

    def param_counts(self, n_layers: int) -> np.ndarray:
        counts = self.table.param_counts
        if counts.size == n_layers:
            return counts
        return np.pad(counts, (0, max(n_layers - counts.size, 0)))[:n_layers]

    @property
    def total_params(self) -> int:
        """Parameters of the model: the environment's count when the agent sent one,
        else the sum over the layer table."""
        total = self.environment.get("param_count")
        if isinstance(total, int) and total > 0:
            return total
        return self.table.derived("total_params",
                                  lambda table: sum(x.param_count for x in table.layers))

    @property
    def scaler(self) -> dict[str, Any] | None:
        scaler = self.environment.get("scaler")
        if isinstance(scaler, dict) and scaler.get("enabled", True) is not False:
            return scaler
        return None

    @property
    def growth_interval(self) -> int:
        value = (self.scaler or {}).get("growth_interval")
        return value if isinstance(value, int) and value > 0 else 2000


def autocast_codes(series: StepSeries) -> np.ndarray:
    """Per step, the autocast dtype code (0: none or not reported)."""
    i = FIELD_INDEX["autocast_dtype"]
    codes = series.scalars[:, i]
    return np.where(series.present[:, i] & ~np.isnan(codes), codes, 0.0).astype(np.int64)


def compute_dtype(series: StepSeries, run: RunContext) -> str | None:
    """The dtype the run computes in: the most frequent autocast dtype of its steps,
    else the environment's, else None (unknown: the caller must not judge)."""
    codes = autocast_codes(series)
    codes = codes[(codes > 0) & (codes < len(DTYPES)) & (codes != MIXED)]
    if codes.size:
        return DTYPES[int(np.bincount(codes).argmax())]
    name = run.environment.get("autocast_dtype")
    return name if isinstance(name, str) and name in DTYPE_CODE else None


def is_fp16_run(series: StepSeries, run: RunContext) -> bool:
    return compute_dtype(series, run) == "float16"


def step_rows(series: StepSeries, steps: np.ndarray) -> np.ndarray:
    """Positions in `series` of `steps` (-1 where a step is not in the series)."""
    all_steps = series.steps
    if not all_steps.size:
        return np.full(len(steps), -1, dtype=np.int64)
    rows = np.searchsorted(all_steps, steps).clip(0, all_steps.size - 1)
    return np.where(all_steps[rows] == steps, rows, -1)


def scale_column(series: StepSeries) -> np.ndarray:
    """Per step, the loss scale after its update (`scale_after`, else `loss_scale`);
    NaN without a scaler."""
    after = series.column("scale_after")
    return np.where(np.isnan(after), series.column("loss_scale"), after)
