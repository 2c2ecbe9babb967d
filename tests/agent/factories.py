"""Small real models, the standard AMP training loops of the reference, and a reader
for what the agent spooled."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampwatch.wire import decode_tree


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.LayerNorm(width),
                         nn.Linear(width, 4))


class TinyGPT(nn.Module):
    """Token and position embeddings, one pre-LN attention block, tied LM head."""

    def __init__(self, vocab: int = 64, d_model: int = 32, heads: int = 4, seq: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x)


def batches(n: int, seed: int = 1, bad: Callable[[int], str | None] = lambda i: None
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression batches; `bad(i)` may return "inf" or "nan" to poison batch i's input."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        if bad(i):
            x[0, 0] = float(bad(i))
        out.append((x, y))
    return out


def train_with_faults(model: nn.Module, n: int, fault: Callable[[int], None]) -> None:
    """SGD on `batches(n)`: `fault(i)` (under no_grad) changes the weights before step i's
    forward, and they are put back after each step, so every step sees its own fault only."""
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(n)):
        with torch.no_grad():
            fault(i)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.load_state_dict(clean)


def fp16_loop(model: nn.Module, optimizer: Any, scaler: Any, data: list, *,
              clip: float | None = None, unscale: bool = True, accumulate: int = 1,
              scheduler: Any = None, on_step: Callable[..., None] | None = None,
              dtype: torch.dtype = torch.float16) -> None:
    """The reference fp16 loop: scale, backward, [unscale_, clip], step, update."""
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y) / accumulate
        scaler.scale(loss).backward()
        if (i + 1) % accumulate:
            continue
        if unscale:
            scaler.unscale_(optimizer)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        if on_step is not None:
            on_step(i)
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def bf16_loop(model: nn.Module, optimizer: Any, data: list, *, clip: float | None = None,
              autocast: bool = True) -> None:
    """bf16 (or fp32 with autocast=False) without a scaler."""
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def spooled(spool_root: Path, run_id: str, rank: int = 0) -> list[dict[str, Any]]:
    """Every spool entry of a run, in replay order, decoded (NaN/inf as floats)."""
    directory = spool_root / run_id / f"rank-{rank}"
    return [decode_tree(json.loads(gzip.decompress(p.read_bytes())))
            for p in sorted(directory.glob("*.json.gz"))]


def spooled_steps(spool_root: Path, run_id: str) -> list[dict[str, Any]]:
    return [s for e in spooled(spool_root, run_id) for s in e["batch"]["steps"]]


def same(a: float | None, b: float | None, rel: float = 1e-5) -> bool:
    """Equal to float tolerance, NaN equal to NaN, inf to inf of the same sign."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)
