"""Reads a W&B offline run file (`run-<id>.wandb`) back into W&B's own protobuf records.

wandb 0.31 no longer ships its Python datastore reader (its Go core writes the file), so
this undoes the file's framing, LevelDB's log format behind a 7-byte ":W&B" header, and
hands each record to `wandb.proto.wandb_internal_pb2.Record`: the values are W&B's own.
"""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
RECORD = struct.Struct("<IHB")  # masked crc32c, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    """Every record of the file, in order."""
    data = Path(path).read_bytes()
    ident, _, _ = HEADER.unpack_from(data)
    assert ident == b":W&B", f"not a W&B run file: {path}"
    out, pending, at = [], b"", HEADER.size
    while at + RECORD.size <= len(data):
        left = BLOCK - at % BLOCK
        if left < RECORD.size:  # the block's tail is padding
            at += left
            continue
        _, length, kind = RECORD.unpack_from(data, at)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            at += left
            continue
        body = data[at + RECORD.size: at + RECORD.size + length]
        at += RECORD.size + length
        pending = body if kind in (FULL, FIRST) else pending + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, str]]:
    """Each `run.log` call's items, key -> JSON value as W&B stored it."""
    return [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def alerts(path: Path) -> list[wandb_internal_pb2.AlertRecord]:
    return [r.alert for r in records(path) if r.WhichOneof("record_type") == "alert"]


def summary(path: Path) -> dict[str, str]:
    """The run summary as its updates left it, key -> JSON value."""
    out: dict[str, str] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "summary":
            for item in r.summary.update:
                out[item.key or "/".join(item.nested_key)] = item.value_json
    return out


