"""The base of the client's result types (client/models.py): construction from API v1
JSON and back (`Model`), lists of results with a pandas view (`Records`), and the JSON
encoding of any result (`to_json`). Non-finite floats travel in the wire encoding
(wire/floats.py)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from datetime import datetime
from functools import cache
from typing import Any, Self, TypeVar

from ampwatch.wire import decode_float, decode_tree, encode_tree

T = TypeVar("T")


class Model:
    """Mixin of every result type: construction from JSON and back."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        """Build from one API v1 JSON object (unknown keys are ignored)."""
        hints = _hints(cls)
        kwargs = {f.name: _convert(hints[f.name], data[f.name])
                  for f in dataclasses.fields(cls) if f.name in data}  # type: ignore[arg-type]
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        """As API v1 JSON: non-finite floats as strings, times in ISO 8601."""
        return to_json(self)


class Records(list[T]):
    """A list of results with a `to_pandas()` view (one row per item); `of` is the item
    type, which gives an empty list its columns."""

    def __init__(self, items: Iterable[T] = (), of: type | None = None) -> None:
        super().__init__(items)
        self.of = of

    def to_pandas(self) -> Any:
        """A pandas DataFrame with one column per field, typed by the field's hint:
        floats as float64 (missing becomes NaN, as pandas has no other), optional ints
        and bools as pandas' nullable Int64 and boolean; nested lists and dicts stay
        Python objects. Needs pandas (`pip install pandas`)."""
        pandas = import_pandas()
        kind = self.of or (type(self[0]) if self else None)
        if kind is None or not dataclasses.is_dataclass(kind):
            return pandas.DataFrame.from_records(list(self))
        frame = pandas.DataFrame.from_records([dataclasses.asdict(item) for item in self],
                                              columns=[f.name for f in dataclasses.fields(kind)])
        for name, hint in _hints(kind).items():
            if (dtype := _pandas_dtype(hint)) is not None:
                frame[name] = frame[name].astype(dtype)
        return frame


def to_json(value: Any) -> Any:
    """A result (or list of results) as JSON-ready data in the API v1 encoding."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return encode_tree(value)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(hint: Any, value: Any) -> Any:
    """`value` from JSON as the type `hint` names (dataclasses, lists, optionals,
    datetimes, floats in the wire encoding); anything else is decoded as a tree."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else decode_tree(value)
    if origin in (list, Records):
        items = [_convert(args[0], v) for v in value]
        return Records(items, of=args[0]) if origin is Records else items
    if isinstance(hint, type) and issubclass(hint, Model):
        return hint.from_json(value)
    if hint is datetime:
        return datetime.fromisoformat(value)
    if hint is float:
        return decode_float(value)
    return decode_tree(value)


def _pandas_dtype(hint: Any) -> str | None:
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if base is float:
        return "float64"
    if base is bool:
        return "boolean" if optional else "bool"
    if base is int:
        return "Int64" if optional else "int64"
    return None


def import_pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError("to_pandas() needs pandas: pip install pandas") from None
    return pandas
