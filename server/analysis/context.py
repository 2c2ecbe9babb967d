"""What detectors know about a run besides its steps: the layer table, the environment,
the rank and where its stream began. Built once per analysis pass."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from server.series import DTYPE_CODE, DTYPES, StepSeries

FP16 = DTYPE_CODE["float16"]
BF16 = DTYPE_CODE["bfloat16"]
MIXED = DTYPE_CODE["mixed"]
LOW_PRECISION = (FP16, BF16)


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


@dataclass(frozen=True)
class RunContext:
    """The run-level inputs of the detectors.

    first_step: the first step this rank ever sent (calibration counts from there);
    None when unknown, e.g. at registration.
    """

    layers: tuple[LayerInfo, ...] = ()
    environment: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    first_step: int | None = None

    @classmethod
    def build(cls, layers: Iterable[Any], environment: dict[str, Any] | None = None,
              rank: int = 0, first_step: int | None = None) -> RunContext:
        infos = tuple(sorted((x if isinstance(x, LayerInfo) else LayerInfo.from_row(x)
                              for x in layers), key=lambda x: x.index))
        return cls(layers=infos, environment=dict(environment or {}), rank=rank,
                   first_step=first_step)

    def layer(self, index: int) -> LayerInfo | None:
        """The layer at table position `index` (None when the table lacks it)."""
        if 0 <= index < len(self.layers) and self.layers[index].index == index:
            return self.layers[index]
        return next((x for x in self.layers if x.index == index), None)

    def layer_name(self, index: int) -> str:
        layer = self.layer(index)
        return layer.name if layer else f"layer[{index}]"

    def forward_position(self, n_layers: int) -> np.ndarray:
        """Per layer index, its position in forward execution order (layers never seen
        in forward come after all seen ones, in table order)."""
        keys = np.full(n_layers, np.iinfo(np.int64).max // 2, dtype=np.int64)
        for x in self.layers:
            if x.index < n_layers:
                seen = x.forward_index is not None
                keys[x.index] = (x.forward_index if seen else 1 << 40) * (1 << 20) + x.index
        position = np.empty(n_layers, dtype=np.int64)
        position[np.argsort(keys, kind="stable")] = np.arange(n_layers)
        return position

    @property
    def total_params(self) -> int:
        """Parameters of the model: the environment's count when the agent sent one,
        else the sum over the layer table."""
        total = self.environment.get("param_count")
        if isinstance(total, int) and total > 0:
            return total
        return sum(x.param_count for x in self.layers)

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
    codes = series.column("autocast_dtype")
    return np.nan_to_num(codes, nan=0.0).astype(np.int64)


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
