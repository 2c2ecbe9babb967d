"""The bundle file of one bad step, and the thread that writes it.

A bundle is a zip file (`step-<N>.ampbundle`) of two members: `bundle.json` (what the
server and `ampwatch bundles` read without torch: step, trigger, first offender, settings,
environment) and `state.pt` (`torch.save` of the batch, RNG states, the model's state
dict and the scaler's state; `ampwatch.replay.load` reads it with `weights_only=True`).

Serialising runs on the writer thread, never the training thread; a disk that is full or
a budget that is spent drops the bundle (counted and reported), it never stops training.
"""

from __future__ import annotations

import io
import json
import os
import threading
import zipfile
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ampwatch.agent import errors
from ampwatch.wire import encode_tree
from ampwatch.wire.bundles import META_NAME, STATE_NAME, SUFFIX, bundle_name

UNSUPPORTED = "__ampwatch_unsupported__"  # a batch value that is not data (its repr kept)


def to_host(value: Any, depth: int = 0) -> Any:
    """A forward argument as data `torch.load(weights_only=True)` can read back: tensors
    (detached, on the CPU), numbers, strings, None and lists/tuples/dicts of them. Anything
    else is kept as its repr under UNSUPPORTED (replay says so). Worker/writer thread: the
    copy of a device tensor waits for it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if depth < 16 and isinstance(value, list | tuple):
        items = [to_host(v, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if depth < 16 and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_host(v, depth + 1) for k, v in value.items()}
    return {UNSUPPORTED: repr(value)[:200]}


def encode(meta: dict[str, Any], state: dict[str, Any]) -> bytes:
    """The bundle's bytes (stored, not compressed: weights barely compress)."""
    tensors = io.BytesIO()
    torch.save(state, tensors)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(META_NAME, json.dumps(encode_tree(meta), allow_nan=False, default=str))
        archive.writestr(STATE_NAME, tensors.getvalue())
    return out.getvalue()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob(f"*{SUFFIX}") if p.is_file())


class BundleWriter:
    """One daemon thread that turns captured steps into bundle files in `folder`, within
    `max_bytes` for the folder. `submit()` never blocks; `on_done(meta, path_or_None,
    reason)` is called on the writer thread after each attempt."""

    MAX_QUEUE = 4  # captures hold a batch and a model copy each: few may wait

    def __init__(self, folder: Path, max_bytes: int,
                 on_done: Callable[[dict[str, Any], Path | None, str | None], None]) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.on_done = on_done
        self.dropped = 0
        self.written: list[Path] = []
        self._items: deque = deque()
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._thread: threading.Thread | None = None

    def submit(self, meta: dict[str, Any], state: Callable[[], dict[str, Any]]) -> bool:
        """Queue a capture (`state()` builds the tensors on the writer thread)."""
        if len(self._items) >= self.MAX_QUEUE:
            self.dropped += 1
            return False
        with self._done:
            self._submitted += 1
            self._items.append((meta, state))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ampwatch-recorder",
                                                daemon=True)
                self._thread.start()
        self._wake.set()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every queued bundle to be written."""
        with self._done:
            return self._done.wait_for(lambda: self._finished >= self._submitted, timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            while self._items:
                meta, state = self._items.popleft()
                errors.guarded("recorder.write")(self._write)(meta, state)
                with self._done:
                    self._finished += 1
                    self._done.notify_all()

    def _write(self, meta: dict[str, Any], state: Callable[[], dict[str, Any]]) -> None:
        path, reason = None, None
        try:
            data = encode(meta, state())
            self.folder.mkdir(parents=True, exist_ok=True)
            if folder_bytes(self.folder) + len(data) > self.max_bytes:
                reason = f"the bundle budget ({self.max_bytes} bytes) is spent"
            else:
                path = self.folder / bundle_name(meta["step"])
                tmp = path.with_suffix(".tmp")
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path)
                except OSError as exc:  # a full disk: drop this bundle, keep training
                    tmp.unlink(missing_ok=True)
                    path, reason = None, f"could not write: {exc.strerror or exc}"
            meta["bytes"] = len(data)
        except Exception as exc:  # noqa: BLE001 - the state could not be serialised
            reason = f"could not serialise: {type(exc).__name__}: {exc}"
        if path is None:
            self.dropped += 1
        else:
            self.written.append(path)
        self.on_done(meta, path, reason)
