"""Factories for test data in wire form (docs/wire-format.md)."""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

# seconds a test's read may first wait for the server to judge what the test stored (the
# `?wait=` of the reads of findings, incidents, spikes and runs), as a user's script does
ANALYSIS_WAIT_S = 30
WAIT = {"wait": ANALYSIS_WAIT_S}


def make_layers(n: int, kind: str = "Linear") -> list[dict[str, Any]]:
    return [
        {"index": i, "name": f"blocks.{i}.fc", "type": kind, "param_count": 64 * 64,
         "dtype": "float32", "shapes": {"weight": [64, 64]},
         "attrs": {"in_features": 64, "out_features": 64}, "forward_index": i}
        for i in range(n)
    ]


def make_steps(first: int, count: int, n_layers: int, *, skipped: set[int] = frozenset(),
               sample_every: int = 0, loss_scale: float = 65536.0) -> list[dict[str, Any]]:
    """Healthy-looking steps; the steps in `skipped` carry inf grads and a skip."""
    steps = []
    for s in range(first, first + count):
        bad = s in skipped
        step: dict[str, Any] = {
            "step": s, "loss_scale": loss_scale,
            "scale_after": loss_scale / 2 if bad else loss_scale,
            "skipped": bad, "grad_norm": "Infinity" if bad else 1.0 + (s % 7) / 10,
            "loss": 2.0 - s * 1e-4, "lr": 3e-4, "t_forward_ms": 10.0, "t_backward_ms": 20.0,
            "t_optimizer_ms": 3.0, "t_step_ms": 33.0, "autocast_dtype": "float16",
            "layer_grad_norm": [("Infinity" if bad and i == 0 else 0.01 * (i + 1))
                                for i in range(n_layers)],
        }
        if sample_every and s % sample_every == 0:
            step["activations"] = {"absmax": [1.0 + i for i in range(n_layers)],
                                   "dtype": ["float16"] * n_layers,
                                   "time_ms": [0.1] * n_layers}
        steps.append(step)
    return steps


def register_run(api, run_id: str = "run-1", n_layers: int = 4, **fields: Any) -> dict:
    body = {"name": run_id, "project": "tests", "layers": make_layers(n_layers), **fields}
    response = api.put(f"/api/v1/runs/{run_id}", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def post_batch(api, run_id: str, seq: int, steps: list[dict], rank: int = 0, **fields: Any):
    return api.post(f"/api/v1/runs/{run_id}/batches",
                    json={"rank": rank, "seq": seq, "steps": steps, **fields})


def meta_only_bundle(step: int, **meta: Any) -> bytes:
    """A bundle as the server reads it: bundle.json alone (it never reads the tensors)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("bundle.json", json.dumps({"step": step, "rank": 0,
                                                    "trigger": "nonfinite", **meta}))
    return out.getvalue()
