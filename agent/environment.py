"""The run registration body (`PUT /api/v1/runs/{run_id}`): environment and layer table.

Built on the training thread at attach and on change (host only, no device work).
"""

from __future__ import annotations

import platform
import socket
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from ampwatch.agent.layers import Layer


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
    """The full registration body; every PUT sends all of it."""
    body: dict[str, Any] = {"environment": env, "layers": [layer.describe() for layer in layers]}
    if name is not None:
        body["name"] = name
    if project is not None:
        body["project"] = project
    if tags is not None:
        body["tags"] = list(tags)
    if config is not None:
        body["config"] = config
    return body
