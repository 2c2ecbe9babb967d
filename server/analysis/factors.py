"""Which settings break training: every config and environment key of a project's runs,
ranked by how well that key alone separates the unhealthy runs (warning or critical) from
the healthy ones.

Each key is a decision stump: a numeric key is split at its best threshold ("lr >= 0.3"),
a categorical key by its values. A split is scored by its information gain over the
entropy of the outcomes (1: it separates exactly; 0: it tells nothing) and checked
against chance: the same stump search on the outcomes shuffled among the runs, so a key
with a value per run (a seed, a name) that "separates" a dozen runs by luck says so. Keys
that move together (the same partition of the runs, or numeric keys one a monotone
function of the other) are confounded: the first ranked is credited, the others follow
it. Pure functions of hand-made or stored runs: no database. docs/projects.md explains
the method.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

UNHEALTHY = ("warning", "critical")
SHUFFLES = 199  # chance is resolved to 1/200: enough to tell 0.05 apart
CHANCE_LEVEL = 0.05  # a split at least this likely in shuffled outcomes does not separate
SHUFFLE_SEED = 0  # the same runs rank the same way on every read
NOT_SET = "not set"


@dataclass(frozen=True)
class RunSettings:
    """One run as the ranking sees it: its outcome (healthy, warning or critical) and its
    settings, flattened to dotted keys (`flatten`)."""

    id: str
    outcome: str
    settings: Mapping[str, Any]


@dataclass(frozen=True)
class Side:
    """The runs on one side of a split: how many, and how many went bad."""

    label: str
    runs: int
    warning: int
    critical: int

    @property
    def unhealthy(self) -> int:
        return self.warning + self.critical

    def describe(self) -> str:
        """'lr >= 0.3: 4 of 4 unhealthy (4 critical)'"""
        bad = [f"{n} {word}" for n, word in ((self.critical, "critical"),
                                              (self.warning, "warning")) if n]
        detail = f" ({', '.join(bad)})" if bad else ""
        return f"{self.label}: {self.unhealthy} of {self.runs} unhealthy{detail}"


@dataclass
class Factor:
    """One key's best stump. `kind`: numeric (split at `threshold`: `key >= threshold`
    against below), categorical (one side per value, in `values`) or constant (one value
    in every run). `score`: information gain over the outcomes' entropy, 0 to 1.
    `chance`: the share of shuffles of the outcomes whose best stump on this key scored
    as well (None when there is nothing to separate)."""

    key: str
    kind: str
    sides: list[Side]
    score: float
    chance: float | None
    threshold: float | None = None
    values: list[Any] = field(default_factory=list)
    confounded_with: list[str] = field(default_factory=list)
    credited: bool = True  # False: it moves with a key ranked above it

    @property
    def separates(self) -> bool:
        return self.chance is not None and self.chance < CHANCE_LEVEL and self.score > 0

    @property
    def summary(self) -> str:
        return "; ".join(side.describe() for side in self.sides)

    @property
    def verdict(self) -> str:
        """What the split means, in a few words."""
        if self.kind == "constant":
            return "one value in every run: cannot tell"
        if self.chance is None:
            return "every run has the same outcome: nothing to separate"
        if not self.credited:
            return (f"moves with {', '.join(self.confounded_with)}: the same split, "
                    "not counted again")
        if not self.separates:
            words = (f"does not separate: shuffled outcomes split as well "
                     f"{self.chance:.0%} of the time")
        elif self.score >= 1 - 1e-9:
            words = "separates exactly"
        else:
            words = f"separates partly ({self.score:.0%} of the uncertainty)"
        if self.confounded_with:
            words += (f"; moves with {', '.join(self.confounded_with)}: "
                      "either may be the cause")
        return words


def flatten(tree: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """Nested keys dotted ("optimizer.lr"); lists become their JSON text (a value, not a
    key each); None is left out (not set)."""
    flat: dict[str, Any] = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{name}.")
        elif isinstance(value, list | tuple):
            flat[name] = json.dumps(value, separators=(",", ":"))
        elif value is not None:
            flat[name] = value
    return flat


def rank_factors(runs: Sequence[RunSettings], shuffles: int = SHUFFLES) -> list[Factor]:
    """Every key any run has, best separating first: credited keys that separate (by
    score, then chance, then fewer sides), then those that do not, then keys confounded
    with one ranked above them, then keys with one value. Costs about `shuffles` stump
    searches a key, vectorised: a few milliseconds a key at 1,000 runs."""
    if not runs:
        return []
    bad = np.array([run.outcome in UNHEALTHY for run in runs])
    critical = np.array([run.outcome == "critical" for run in runs])
    rng = np.random.default_rng(SHUFFLE_SEED)
    labels = np.vstack([bad, *(rng.permutation(bad) for _ in range(shuffles))]).astype(np.int32)
    keys = sorted({key for run in runs for key in run.settings})
    factors, groups = [], {}
    for key in keys:
        values = [run.settings.get(key) for run in runs]
        factor, partition = _factor(key, values, labels, critical)
        factors.append(factor)
        groups[key] = (values, partition)
    _mark_confounded(factors, groups)
    return _ranked(factors)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _factor(key: str, values: list[Any], labels: np.ndarray,
            critical: np.ndarray) -> tuple[Factor, tuple[int, ...]]:
    """`key`'s stump and its partition of the runs (group numbers by first appearance)."""
    present = np.array([value is not None for value in values])
    numeric = present.any() and all(_is_number(v) for v in values if v is not None)
    text = [_text(v) for v in values]
    codes: dict[str, int] = {}
    partition = tuple(codes.setdefault(t, len(codes)) for t in text)
    if len(codes) < 2:
        side = _side(f"{key} = {text[0]}" if present.all() else f"{key} {NOT_SET}",
                     labels[0].astype(bool), critical)
        return Factor(key, "constant", [side], 0.0, None, values=[values[0]]), partition
    if numeric and len(codes) - (not present.all()) >= 2:
        return _numeric(key, values, present, labels, critical), partition
    return _categorical(key, text, np.array(partition), labels, critical), partition


def _text(value: Any) -> str:
    if value is None or isinstance(value, str):
        return NOT_SET if value is None else value
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, int | float) else json.dumps(value)


def _k_log_k(n: int) -> np.ndarray:
    """k·log2(k) for k = 0..n (0 for 0): a group of c runs, u of them bad, holds
    c·H(u/c) = c·log c - u·log u - (c-u)·log(c-u) bits of outcome entropy."""
    table = np.zeros(n + 1)
    table[1:] = np.arange(1, n + 1) * np.log2(np.arange(1, n + 1))
    return table


def _gain_share(groups_bad: np.ndarray, groups_runs: np.ndarray, n: int,
                total_bad: int) -> np.ndarray:
    """Information gain over the outcomes' entropy, summed over the last axis's groups
    (integer counts)."""
    table = _k_log_k(n)
    whole = table[n] - table[total_bad] - table[n - total_bad]
    if whole <= 0:
        return np.zeros(groups_bad.shape[:-1])
    bits = table[groups_runs] - table[groups_bad] - table[groups_runs - groups_bad]
    return (whole - bits.sum(axis=-1)) / whole


def _chance(scores: np.ndarray, total_bad: int, n: int) -> float | None:
    """The share of shuffles (rows 1..) that scored at least as well as row 0."""
    if total_bad in (0, n):
        return None
    beaten = int((scores[1:] >= scores[0] - 1e-12).sum())
    return (beaten + 1) / len(scores)


def _numeric(key: str, values: list[Any], present: np.ndarray, labels: np.ndarray,
             critical: np.ndarray) -> Factor:
    """The best threshold: every cut between two distinct sorted values, for the observed
    outcomes and every shuffle at once (cumulative sums); runs without the key are a
    group of their own."""
    n, total_bad = len(values), int(labels[0].sum())
    x = np.array([v if v is not None else 0.0 for v in values], dtype=float)[present]
    order = np.argsort(x, kind="stable")
    xs = x[order]
    cuts = np.flatnonzero(xs[1:] > xs[:-1]) + 1  # runs below the cut: xs[:cut]
    ordered = labels[:, present][:, order]
    below_bad = np.cumsum(ordered, axis=1)[:, cuts - 1]
    above_bad = ordered.sum(axis=1)[:, None] - below_bad
    m, table = len(xs), _k_log_k(n)
    missing_bad = labels[:, ~present].sum(axis=1)
    whole = table[n] - table[total_bad] - table[n - total_bad]
    # the bits left in each group after the cut; a group's own size is the same in every row
    sizes = table[cuts] + table[m - cuts] + table[n - m]
    bits = (sizes - table[below_bad] - table[cuts - below_bad] - table[above_bad]
            - table[(m - cuts) - above_bad]
            - (table[missing_bad] + table[(n - m) - missing_bad])[:, None])
    scores = (whole - bits) / whole if whole > 0 else np.zeros_like(bits)
    best = int(np.argmax(scores[0]))
    threshold = float(xs[cuts[best]])
    if all(isinstance(v, int) for v in values if v is not None):
        threshold = int(threshold)
    shown = f"{threshold:.4g}" if isinstance(threshold, float) else str(threshold)
    bad = labels[0].astype(bool)
    values_arr = np.array([math.nan if v is None else v for v in values], dtype=float)
    with np.errstate(invalid="ignore"):
        above = present & (values_arr >= threshold)
    sides = [_side(f"{key} >= {shown}", bad & above, critical & above, int(above.sum())),
             _side(f"{key} < {shown}", bad & present & ~above, critical & present & ~above,
                   int((present & ~above).sum()))]
    sides.sort(key=lambda s: -s.unhealthy / s.runs)
    if not present.all():
        sides.append(_side(f"{key} {NOT_SET}", bad & ~present, critical & ~present,
                           int((~present).sum())))
    return Factor(key, "numeric", sides, round(float(scores[0, best]), 9),
                  _chance(scores.max(axis=1), total_bad, n), threshold=threshold)


def _categorical(key: str, text: list[str], partition: np.ndarray, labels: np.ndarray,
                 critical: np.ndarray) -> Factor:
    """One group per value: the gain of the whole partition, for the observed outcomes
    and every shuffle."""
    n, total_bad = len(text), int(labels[0].sum())
    groups = int(partition.max()) + 1
    runs = np.bincount(partition, minlength=groups)
    groups_bad = np.stack([np.bincount(partition, weights=row, minlength=groups)
                           for row in labels]).astype(np.int64)
    scores = _gain_share(groups_bad, np.broadcast_to(runs, groups_bad.shape), n, total_bad)
    names = {code: value for value, code in zip(text, partition, strict=True)}
    sides = []
    for code in range(groups):
        mine = partition == code
        label = f"{key} {NOT_SET}" if names[code] == NOT_SET else f"{key} = {names[code]}"
        sides.append(_side(label, labels[0].astype(bool) & mine, critical & mine, int(runs[code])))
    sides.sort(key=lambda s: (-s.unhealthy / s.runs, -s.runs, s.label))
    values = [s.label.split(" = ", 1)[1] for s in sides if " = " in s.label]
    return Factor(key, "categorical", sides, round(float(scores[0]), 9),
                  _chance(scores, total_bad, n),
                  values=values)


def _side(label: str, bad: np.ndarray, critical: np.ndarray, runs: int | None = None) -> Side:
    n_bad, n_critical = int(bad.sum()), int(critical.sum())
    return Side(label, len(bad) if runs is None else runs, n_bad - n_critical, n_critical)


def _mark_confounded(factors: list[Factor],
                     groups: Mapping[str, tuple[list[Any], tuple[int, ...]]]) -> None:
    """Fill each factor's `confounded_with`: the keys (with two values or more) that
    split the runs the same way, or numeric keys one a monotone function of the other."""
    varied = [f for f in factors if f.kind != "constant"]
    for i, a in enumerate(varied):
        for b in varied[i + 1:]:
            if _move_together(a, b, groups):
                a.confounded_with.append(b.key)
                b.confounded_with.append(a.key)


def _move_together(a: Factor, b: Factor,
                   groups: Mapping[str, tuple[list[Any], tuple[int, ...]]]) -> bool:
    (values_a, partition_a), (values_b, partition_b) = groups[a.key], groups[b.key]
    if partition_a == partition_b:
        return True
    if a.kind != "numeric" or b.kind != "numeric":
        return False
    if [v is None for v in values_a] != [v is None for v in values_b]:
        return False
    pairs = [(va, vb) for va, vb in zip(values_a, values_b, strict=True) if va is not None]
    return _monotone(pairs) or _monotone([(vb, va) for va, vb in pairs])


def _monotone(pairs: Iterable[tuple[float, float]]) -> bool:
    """Whether the second values are a monotone function of the first (one value of the
    second for each of the first, in the same or the reverse order)."""
    mapped: dict[float, float] = {}
    for x, y in pairs:
        if mapped.setdefault(x, y) != y:
            return False
    ys = [mapped[x] for x in sorted(mapped)]
    steps = [b - a for a, b in zip(ys, ys[1:], strict=False)]
    return len(set(ys)) > 1 and (all(s >= 0 for s in steps) or all(s <= 0 for s in steps))


def _ranked(factors: list[Factor]) -> list[Factor]:
    """Best first; a key confounded with one ranked above it is not credited again: it
    follows the keys that stand on their own."""
    def strength(f: Factor) -> tuple:
        # at equal scores the simpler split first: one threshold before sixteen hostnames
        return (f.kind == "constant", not f.separates, -f.score,
                f.chance if f.chance is not None else 1.0, len(f.sides), f.key)

    ordered = sorted(factors, key=strength)
    placed: set[str] = set()
    credited, followers = [], []
    for factor in ordered:
        if factor.kind != "constant" and placed & set(factor.confounded_with):
            factor.credited = False
            followers.append(factor)
        else:
            credited.append(factor)
        placed.add(factor.key)
    constants = [f for f in credited if f.kind == "constant"]
    return [f for f in credited if f.kind != "constant"] + followers + constants
