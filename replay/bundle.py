"""Reading a bundle the agent's flight recorder wrote (agent/bundle.py)."""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampwatch.agent.bundle import UNSUPPORTED
from ampwatch.wire import decode_tree
from ampwatch.wire.bundles import META_NAME, STATE_NAME

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")  # cpu, cuda, xpu, mps, privateuseone...


class BundleError(ValueError):
    """A bundle.json that is not what the agent writes: refused on load, before any of
    its values reaches a run, the terminal or the printed fix."""


def check_meta(meta: Any) -> dict[str, Any]:
    """`meta` if the fields replay reads have the agent's types: the autocast dtype one of
    float16, bfloat16, float32 (it is written into the printed fix), the device type a
    plain name, numbers numbers, names strings. BundleError naming the field otherwise."""
    if not isinstance(meta, dict):
        raise BundleError("bundle.json is not an object")

    def need(key: str, ok: bool, what: str) -> None:
        if not ok:
            raise BundleError(f"bundle.json: {key} must be {what}")

    def number(value: Any) -> bool:
        return value is None or (isinstance(value, int | float) and not isinstance(value, bool))

    for key in ("step", "rank"):
        value = meta.get(key, 0)
        need(key, isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63,
             "a non-negative integer")
    need("trigger", isinstance(meta.get("trigger"), str), "a string")
    for key in ("run_id", "first_nonfinite_layer"):
        need(key, meta.get(key) is None or isinstance(meta[key], str), "a string or null")
    for key in ("loss", "loss_baseline", "loss_spike_factor"):
        need(key, number(meta.get(key)), "a number or null")
    autocast = meta.get("autocast") or {}
    need("autocast", isinstance(autocast, dict), "an object")
    dtype = autocast.get("dtype")
    need("autocast.dtype", dtype is None or (isinstance(dtype, str) and dtype in _DTYPES),
         f"one of {', '.join(_DTYPES)} or null (got {str(dtype)[:40]!r})")
    device_type = autocast.get("device_type")
    need("autocast.device_type",
         device_type is None or (isinstance(device_type, str)
                                 and _DEVICE_TYPE.fullmatch(device_type) is not None),
         "a device type such as cpu or cuda")
    scaler = meta.get("scaler") or {}
    need("scaler", isinstance(scaler, dict), "an object")
    need("scaler.scale", number(scaler.get("scale")), "a number or null")
    need("params", isinstance(meta.get("params") or {}, dict), "an object")
    return meta


@dataclass
class Bundle:
    """One bad step: `batches` (each training forward's `(args, kwargs)`, host tensors),
    `model_state` (the state dict as the step began; see `exact`), `rng` (the RNG states
    the step's first forward drew from) and `meta` (bundle.json: step, trigger, first
    offender, loss, scaler, autocast, optimizer, environment)."""

    meta: dict[str, Any]
    batches: list[tuple[tuple, dict]]
    model_state: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def trigger(self) -> str:
        return str(self.meta["trigger"])

    @property
    def exact(self) -> bool:
        """Whether `model_state` is the model exactly as the step began."""
        return bool((self.meta.get("params") or {}).get("exact"))

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the step's forwards ran under autocast (None: autocast was off)."""
        return _DTYPES.get((self.meta.get("autocast") or {}).get("dtype") or "")

    @property
    def device_type(self) -> str:
        return (self.meta.get("autocast") or {}).get("device_type") or "cpu"

    @property
    def loss_scale(self) -> float | None:
        scaler = self.meta.get("scaler") or {}
        return scaler.get("scale") if scaler.get("enabled", True) else None

    def unsupported(self) -> list[str]:
        """Forward arguments the recorder could not keep as data (their reprs)."""
        found: list[str] = []

        def walk(value: Any) -> None:
            if isinstance(value, dict):
                if UNSUPPORTED in value:
                    found.append(value[UNSUPPORTED])
                else:
                    for v in value.values():
                        walk(v)
            elif isinstance(value, list | tuple):
                for v in value:
                    walk(v)

        walk(self.batches)
        return found


def read_meta(path: str | Path) -> dict[str, Any]:
    """bundle.json of a bundle file (no tensors are read)."""
    with zipfile.ZipFile(path) as archive:
        return check_meta(decode_tree(json.loads(archive.read(META_NAME))))


def load(bundle: str | Path | bytes) -> Bundle:
    """Read a bundle file (or its bytes). Tensors are loaded with `weights_only=True`: a
    bundle from elsewhere cannot run code on this machine (a pickle is refused:
    `pickle.UnpicklingError`). BundleError for a bundle.json `check_meta` refuses."""
    source = io.BytesIO(bundle) if isinstance(bundle, bytes) else bundle
    with zipfile.ZipFile(source) as archive:
        meta = check_meta(decode_tree(json.loads(archive.read(META_NAME))))
        state = torch.load(io.BytesIO(archive.read(STATE_NAME)), weights_only=True,
                           map_location="cpu")
    batches = [(tuple(args), dict(kwargs)) for args, kwargs in state["batches"]]
    return Bundle(meta, batches, state["model"], state["rng"],
                  None if isinstance(bundle, bytes) else Path(bundle))
