"""How one step's (min, max) pairs reduce on the device into the activations collector's
slots: the first call with inf/NaN, and each layer's abs-max. Built once per call pattern,
on the host (its index tensors copied from pinned memory without waiting for the device),
kept in a bounded least-recently-used cache; the reductions are a handful of device
launches, never a read."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ampwatch.agent.collectors.base import device_tensor
from ampwatch.agent.collectors.first_bad_layer import Call, stats_dtype


def largest(*values: float) -> float:
    """max() that propagates NaN (the builtin's result depends on argument order)."""
    return math.nan if any(v != v for v in values) else max(values)


NO_CALL = 1 << 40  # the first-non-finite slot when every output was finite


class AbsMaxPlan:
    """How the calls of one step pattern reduce on the device: the (min, max) pairs are
    stacked per output dtype (a stack of mixed dtypes is ~5x slower); the first call
    with inf/NaN is the smallest call position among the non-finite pairs (four ops per
    dtype and three more); for the abs-max, one gather through a (layer x call) index
    matrix padded with a zero lets `amax` keep each layer's largest call. NaN propagates
    through every op. Built once per pattern, on the host."""

    def __init__(self, pattern: tuple[tuple[int, torch.dtype | None], ...], n_layers: int,
                 device: torch.device) -> None:
        groups: dict[torch.dtype, list[int]] = {}
        for position, (_, dtype) in enumerate(pattern):
            if dtype is not None:  # None: a call without statistics
                groups.setdefault(dtype, []).append(position)
        self.groups = list(groups.values())  # call positions per dtype, in concat order
        order = [p for positions in self.groups for p in positions]
        self.empty = not order
        if self.empty:
            return
        self.positions = [device_tensor(positions, torch.float64, device)
                          for positions in self.groups]
        self.no_call = torch.full((1,), float(NO_CALL), dtype=torch.float64, device=device)
        rows: dict[int, list[int]] = {}
        for row, position in enumerate(order):
            rows.setdefault(pattern[position][0], []).append(row)
        width = max(len(r) for r in rows.values())
        pad = len(order)  # index of the appended zero
        matrix = [rows.get(layer, []) + [pad] * (width - len(rows.get(layer, [])))
                  for layer in range(n_layers)]
        self.index = device_tensor(matrix, torch.long, device)
        self.single = width == 1  # each layer called once: a plain gather
        if self.single:
            self.index = self.index.reshape(-1)
        self.zero = torch.zeros(1, dtype=stats_dtype(pattern[order[0]][1]), device=device)

    def stack(self, calls: list[Call]) -> list[torch.Tensor]:
        """The (min, max) pairs of each dtype group, as (calls, 2) tensors."""
        return [torch.stack([x for p in positions for x in calls[p][2]]).view(-1, 2)
                for positions in self.groups]

    def first_nonfinite(self, pairs: list[torch.Tensor], out: torch.Tensor) -> None:
        """The position of the first call with inf/NaN into `out` (NO_CALL if none)."""
        if self.empty:
            out.fill_(float(NO_CALL))
            return
        firsts = [torch.where(group.isfinite().all(dim=1), NO_CALL, positions)
                  for group, positions in zip(pairs, self.positions, strict=True)]
        torch.amin(torch.cat([*firsts, self.no_call]), dim=0, keepdim=True, out=out)

    def reduce(self, pairs: list[torch.Tensor], out: torch.Tensor) -> None:
        if self.empty:
            return
        parts = [group.abs().amax(dim=1) for group in pairs]
        values = torch.cat([*parts, self.zero])  # cat promotes to the widest dtype
        values = values[self.index] if self.single else values[self.index].amax(dim=1)
        out.copy_(values)


Pattern = tuple[tuple[int, torch.dtype | None], ...]


class AbsMaxPlans:
    """The plans of the call patterns seen last: at most MAX_PLANS, least recently used
    dropped first (variable sequence lengths or routed layers can make a new pattern
    every step; each costs one build and its small host-to-device copies)."""

    MAX_PLANS = 32

    def __init__(self, n_layers: int, device: torch.device) -> None:
        self.n_layers = n_layers
        self.device = device
        self._plans: OrderedDict[Pattern, AbsMaxPlan] = OrderedDict()
        self.built = 0  # plans built so far (each a cache miss)

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, pattern: Pattern) -> AbsMaxPlan:
        plan = self._plans.get(pattern)
        if plan is not None:
            self._plans.move_to_end(pattern)
            return plan
        plan = self._plans[pattern] = AbsMaxPlan(pattern, self.n_layers, self.device)
        self.built += 1
        if len(self._plans) > self.MAX_PLANS:
            self._plans.popitem(last=False)
        return plan
