"""Field types of the request schemas: the bounds the database columns can hold, and
strict numbers. Anything outside them is a 422 naming the field, never a 5xx from the
database or from numpy (a 5xx makes the agent retry the same batch forever)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints
from pydantic.types import Strict

from ampwatch.client.wire import NONFINITE_STRINGS

INT32_MAX = 2**31 - 1  # Integer columns (run_ranks counters, forward_index)
INT64_MAX = 2**63 - 1  # BigInteger columns (param_count) and JSON ints read with numpy
MAX_COUNT = INT32_MAX  # per-step counters are stored in float64 columns; any count fits


def storable(text: str) -> str:
    """Text every backend can store: no NUL (Postgres text refuses it) and valid UTF-8
    (a lone surrogate cannot be encoded for SQLite or Postgres)."""
    if "\x00" in text:
        raise ValueError("must not contain a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (a lone surrogate is not)") from None
    return text


def text(min_length: int = 0, max_length: int = 256) -> type[str]:
    """A storable string of bounded length."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length),
                     AfterValidator(storable)]  # type: ignore[return-value]


ShortText = text(max_length=256)
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
BigCount = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
JsonInt = Annotated[int, Strict(), Field(ge=-INT64_MAX - 1, le=INT64_MAX)]

_NonFiniteName = Literal["NaN", "Infinity", "-Infinity"]
# A JSON number (an int is fine, a bool or a numeric string is not) or a non-finite name.
# Strict: lax float parsing took "1_000", " 1.5 " and false.
_WireNumber = Annotated[float, Strict()] | _NonFiniteName


def _as_float(value: float | str) -> float:
    return NONFINITE_STRINGS[value] if value.__class__ is str else value


def _as_floats(values: list) -> list:
    """One pass per vector, not one Python call per element (vectors have L entries)."""
    for v in values:
        if v.__class__ is str:
            return [NONFINITE_STRINGS[v] if v.__class__ is str else v for v in values]
    return values


WireFloat = Annotated[_WireNumber, AfterValidator(_as_float)]
WireFloats = Annotated[list[_WireNumber | None], AfterValidator(_as_floats)]
