"""The run registration body (`PUT /api/v1/runs/{run_id}`): environment and layer table.

Built on the training thread at attach and on change (host only, no device work).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import platform
import socket
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from ampwatch.agent.layers import Layer

logger = logging.getLogger("ampwatch.agent")
_DROPPED = object()
MAX_DEPTH = 32


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when initialised, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _ampwatch_version() -> str:
    try:
        return metadata.version("ampwatch")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def scaler_config(scaler: Any) -> dict[str, Any] | None:
    """The scaler's settings from its attributes; `get_scale()` (a sync) is never called."""
    if scaler is None:
        return None
    return {"init_scale": float(getattr(scaler, "_init_scale", 0.0)),
            "growth_factor": float(getattr(scaler, "_growth_factor", 0.0)),
            "backoff_factor": float(getattr(scaler, "_backoff_factor", 0.0)),
            "growth_interval": int(getattr(scaler, "_growth_interval", 0)),
            "enabled": bool(getattr(scaler, "_enabled", True))}


def environment(device: torch.device, scaler: Any, autocast_dtype: str | None,
                world_size: int) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch_version": torch.__version__.split("+")[0],
        "python_version": platform.python_version(),
        "ampwatch_version": _ampwatch_version(),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "compute_capability": None,
        "autocast_dtype": autocast_dtype,
        "world_size": world_size,
        "hostname": socket.gethostname(),
        "scaler": scaler_config(scaler),
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        env["device_name"] = torch.cuda.get_device_name(index)
        env["compute_capability"] = f"{major}.{minor}"
    return env


def run_body(*, name: str | None, project: str | None, tags: list[str] | None,
             config: dict[str, Any] | None, env: dict[str, Any],
             layers: list[Layer]) -> dict[str, Any]:
    """The full registration body; every PUT sends all of it. `name` ... `config` are
    those `describe_run` made plain."""
    body: dict[str, Any] = {"environment": env, "layers": [layer.describe() for layer in layers]}
    if name is not None:
        body["name"] = name
    if project is not None:
        body["project"] = project
    if tags is not None:
        body["tags"] = tags
    if config is not None:
        body["config"] = config
    return body


def describe_run(name: str | None, project: str | None, tags: list[str] | None,
                 config: Any) -> dict[str, Any]:
    """attach()'s labels (already checked: strings) and its config as JSON can hold it:
    what it cannot (a `Path`, a numpy scalar, an object) is sent as text or dropped, with
    a warning naming the key (`plain_json`), so a run is never lost to its config. Once,
    at attach."""
    if config is not None and not isinstance(config, dict):
        logger.warning("ampwatch: config is a %s, not a dict: sent as {'config': ...}",
                       type(config).__name__)
        config = {"config": config}
    return {"name": name, "project": project,
            "tags": list(tags) if tags is not None else None,
            "config": plain_json(config, "config") if config is not None else None}


def plain_json(value: Any, key: str, depth: int = 0) -> Any:
    """`value` as JSON types (dict with str keys, list, str, int, float, bool, None);
    non-finite floats as "NaN"/"Infinity"/"-Infinity" (the wire encoding). Paths, enums,
    torch dtypes and devices become text, numpy and torch scalars numbers; anything else
    its `str()` with a warning naming `key`, dropped (with a warning) when even that
    fails. Host-only; called on the training thread at attach and on layer changes."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else (
            "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity")
    if depth >= MAX_DEPTH:
        logger.warning("ampwatch: dropped %s: nested deeper than %d levels", key, MAX_DEPTH)
        return _DROPPED if depth else None
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            name = k if isinstance(k, str) else str(k)
            item = plain_json(v, f"{key}.{name}", depth + 1)
            if item is not _DROPPED:
                out[name] = item
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [item for i, v in enumerate(items)
                if (item := plain_json(v, f"{key}[{i}]", depth + 1)) is not _DROPPED]
    if isinstance(value, enum.Enum):
        return plain_json(value.value, key, depth + 1)
    if isinstance(value, os.PathLike):
        return os.fspath(value) if isinstance(os.fspath(value), str) else str(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        return plain_json(value.item(), key, depth + 1)  # at attach only, on the host
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return plain_json(value.tolist(), key, depth + 1)  # numpy scalars and arrays
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - a user object whose __str__ fails
        logger.warning("ampwatch: dropped %s: a %s that cannot be shown as text", key,
                       type(value).__name__)
        return _DROPPED if depth else None
    logger.warning("ampwatch: %s is a %s, which JSON cannot hold: sent as its text %r",
                   key, type(value).__name__, text[:80])
    return text
