"""Human output of the command line: aligned tables and short number formats."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime

MIN_WRAP = 40  # narrower than this, the last column wraps under the row instead
# C0 but tab and newline, DEL, C1, and the bidi overrides and isolates: what a terminal
# obeys (ESC starts colours, cursor moves, OSC-8 links, title changes) or reorders
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_LINE_BREAK = re.compile("[\t\n]")


def printable(text: object, *, lines: bool = False) -> str:
    """`text` safe to print to a terminal: every control character written out as its
    escape (ESC as `\\x1b`), so a name, a bundle's field or a server's message cannot
    colour, move, link or retitle anything. Tab and newline too unless `lines` (text of
    several lines this program wrote itself, such as the printed fix)."""
    text = str(text)
    if not lines:
        text = _LINE_BREAK.sub(_escape, text)
    return _CONTROL.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]],
          right: Sequence[int] = (), wrap_width: int | None = None) -> str:
    """Rows as aligned text columns under upper-case headers; columns whose position is in
    `right` are right-aligned (numbers). Cells must already be strings. With `wrap_width`,
    the last column (free text) is wrapped so that lines fit in that many characters,
    never cut; continuation lines are indented to its column. Cells are made `printable`."""
    rows = [[printable(c) for c in row] for row in rows]
    last = len(headers) - 1
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    indent = sum(widths[:last]) + 2 * last
    text_width = None
    if wrap_width is not None:
        text_width = wrap_width - indent
        if text_width < MIN_WRAP:  # no room beside the columns: under them, indented by 4
            indent, text_width = 4, max(wrap_width - 4, MIN_WRAP)

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if i in right else c.ljust(w)
                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        if text_width is None:
            return "  ".join(padded).rstrip()
        head = "  ".join(padded[:last])
        pieces = textwrap.wrap(cells[last], text_width, break_on_hyphens=False) or [""]
        if indent != len(head) + 2:
            return "\n".join([head.rstrip(), *(" " * indent + p for p in pieces)])
        return "\n".join([f"{head}  {pieces[0]}".rstrip(),
                          *(" " * indent + p for p in pieces[1:])])

    header = "  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True))
    return "\n".join([header.rstrip(), *(line(row) for row in rows)])


def terminal_width() -> int | None:
    """Columns to wrap text to: $COLUMNS, else the terminal's; None when the output is not
    a terminal (a pipe or a file gets whole lines, for grep)."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


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
