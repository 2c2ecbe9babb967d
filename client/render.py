"""Human output of the command line: aligned tables and short number formats."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          right: Sequence[int] = ()) -> str:
    """Rows as aligned text columns under upper-case headers; columns whose position is in
    `right` are right-aligned (numbers). Cells must already be strings."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if i in right else c.ljust(w)
                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(padded).rstrip()

    return "\n".join([line([h.upper() for h in headers]), *(line(row) for row in rows)])


def number(x: float | int | None, digits: int = 4) -> str:
    """A number in few characters: '-' when missing, 'NaN'/'inf' spelled out."""
    if x is None:
        return "-"
    if isinstance(x, bool | int):
        return str(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def scale(x: float | None) -> str:
    """A loss scale: powers of two as 2^k (65536 -> '65536 (2^16)')."""
    if x is None or not math.isfinite(x) or x <= 0:
        return number(x)
    exponent = math.log2(x)
    if exponent.is_integer():
        return f"{x:g} (2^{int(exponent)})" if x >= 1 else f"2^{int(exponent)}"
    return number(x)


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def step_range(first: int | None, last: int | None) -> str:
    if first is None:
        return "-"
    if last is None or last == first:
        return str(first)
    return f"{first}-{last}"


def moment(when: datetime | None) -> str:
    """A time in UTC to the second."""
    return "-" if when is None else when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def shorten(text: str, width: int) -> str:
    """One line of at most `width` characters (newlines become spaces)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
