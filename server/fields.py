"""Field types of the request schemas: the bounds the database columns can hold, and
strict numbers. Anything outside them is a 422 naming the field, never a 5xx from the
database or from numpy (a 5xx makes the agent retry the same batch forever)."""

from __future__ import annotations

import re
import struct
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints, WithJsonSchema
from pydantic.types import Strict

from ampwatch.wire import NONFINITE_STRINGS

NO_NUL = r"^[^\x00]*$"  # Postgres text cannot hold NUL
INT32_MAX = 2**31 - 1  # Integer columns (run_ranks counters, forward_index)
# The largest integer every JSON reader keeps exactly (I-JSON, RFC 7493): beyond it a
# schema validator reads a bound and a value as the same double, and 2**63 + 100 would
# pass for 2**63 - 1. It fits BigInteger columns and numpy int64 too.
JSON_INT_MAX = 2**53 - 1
MAX_COUNT = INT32_MAX  # per-step counters are stored in float64 columns; any count fits

# dtype names by their stored code (0 = none / missing; server/store/series.py codes them);
# the order is the storage format, append only
DTYPES: tuple[str, ...] = (
    "",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "mixed",
)


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
    """A storable string of bounded length. The schema states the NUL rule as a pattern;
    `storable` checks it (with a message that says what is wrong)."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length),
                     AfterValidator(storable),  # type: ignore[return-value]
                     WithJsonSchema({"type": "string", "minLength": min_length,
                                     "maxLength": max_length, "pattern": NO_NUL})]


def integral(value: object) -> object:
    """A JSON number without a fraction (252.0) as the integer it is: JSON and the OpenAPI
    schema's `integer` make no difference between 252 and 252.0. 252.5, "252" and true
    stay refused (Strict)."""
    return int(value) if value.__class__ is float and value.is_integer() else value


def integer(ge: int, le: int) -> type[int]:
    """A strict integer in [ge, le]."""
    return Annotated[int, Strict(), Field(ge=ge, le=le),  # type: ignore[return-value]
                     BeforeValidator(integral)]


ShortText = text(max_length=256)

# What a name shown to people must not hold: control characters (C0, DEL, C1: CR and LF
# reached notification titles) and the invisible formatting ones (soft hyphen, zero-width
# spaces and joiners, bidirectional marks, embeddings, overrides and isolates, word
# joiners, BOM), which make a name read as another. One class, valid in Python and in
# the JSON Schema (ECMA) regex dialect, so the schema states exactly what is checked.
HIDDEN_CHARS = (r"\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                r"\u2060-\u206f\ufeff\ufff9-\ufffb")
NAME_PATTERN = rf"^[^{HIDDEN_CHARS}]*$"
_HIDDEN = re.compile(f"[{HIDDEN_CHARS}]")


def visible(name: str) -> str:
    """`name` when it holds no control or invisible formatting character (HIDDEN_CHARS)."""
    found = _HIDDEN.search(name)
    if found:
        raise ValueError(f"must not contain the control or formatting character "
                         f"U+{ord(found.group()):04X}")
    return name


def name_text(min_length: int = 1, max_length: int = 256) -> type[str]:
    """A name people read (run, project, tag, layer, layer type, event kind): storable,
    bounded, and `visible`."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length),
                     AfterValidator(storable), AfterValidator(visible),  # type: ignore[return-value]
                     WithJsonSchema({"type": "string", "minLength": min_length,
                                     "maxLength": max_length, "pattern": NAME_PATTERN})]


class _KeysMatchTheirPattern:
    """Schema of a dict whose keys are `text`: keys outside the pattern (with a NUL) are
    not allowed (pydantic lists the pattern under patternProperties only, which would let
    any other key pass)."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        schema = handler.resolve_ref_schema(handler(core_schema))
        if "patternProperties" in schema:
            schema["additionalProperties"] = False
        return schema


def keyed_by_text(values: Any) -> Any:
    """A dict from storable strings of at most 256 characters to `values`."""
    return Annotated[dict[ShortText, values], _KeysMatchTheirPattern()]
Count = integer(0, MAX_COUNT)
BigCount = integer(0, JSON_INT_MAX)
JsonInt = integer(-JSON_INT_MAX, JSON_INT_MAX)

_NonFiniteName = Literal["NaN", "Infinity", "-Infinity"]
# A JSON number (an int is fine, a bool or a numeric string is not) or a non-finite name,
# as a float. Strict: lax float parsing took "1_000", " 1.5 " and false. Tried left to
# right: a number (nearly every value) costs one strict check in pydantic's core and no
# Python call; only a name calls Python.
_Number = Annotated[float, Strict()]
_Name = Annotated[_NonFiniteName, AfterValidator(NONFINITE_STRINGS.__getitem__)]
WireFloat = Annotated[_Number | _Name, Field(union_mode="left_to_right")]

# A missing per-layer entry (JSON null) once validated: a NaN whose payload no sender's NaN
# has (JSON "NaN" parses to the canonical one), so a vector is a plain list of floats that
# numpy takes in one call (a batch holds tens of thousands), and its missing entries are
# found there (`missing_entries`).
MISSING_ENTRY_BITS = 0x7FF8_DEAD_BEEF_0001
MISSING_ENTRY: float = struct.unpack("<d", struct.pack("<Q", MISSING_ENTRY_BITS))[0]


def _missing(_value: None) -> float:
    return MISSING_ENTRY


_Entry = Annotated[_Number | _Name | Annotated[None, AfterValidator(_missing)],
                   Field(union_mode="left_to_right")]
# fail_fast: the first bad element ends the list's validation. Without it a vector of
# 100,000 strings made 200,000 error objects: a 1.5 MB body cost about 800 MB.
WireFloats = Annotated[list[_Entry], Field(fail_fast=True)]


def missing_entries(values: np.ndarray) -> np.ndarray:
    """Where a float64 array made from validated `WireFloats` holds a missing entry."""
    return values.view(np.uint64) == MISSING_ENTRY_BITS
