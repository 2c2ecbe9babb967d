"""The cost of the weight-norm signal (agent/collectors/weights.py) on a sampled step: the
fused norm of every parameter, summed into the layers, against one plain training step of
the same model (forward, backward, AdamW), both on the CPU in the same process.

    python bench/weight_norm_cost.py [--width 1024] [--layers 8] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU())
                            for _ in range(args.layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    layer_of = torch.tensor([i // 2 for i in range(len(params))])  # weight, bias per Linear
    zeros = torch.zeros(args.layers)
    x = torch.randn(64, args.width)

    def norms() -> torch.Tensor:
        sq = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32)).square()
        return zeros.index_add(0, layer_of, sq).sqrt()

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
        norms()
    timed = {"norms": [], "step": []}
    for _ in range(args.repeats):
        for name, fn in (("norms", norms), ("step", step)):
            start = time.perf_counter()
            fn()
            timed[name].append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in params)
    med = {name: statistics.median(v) * 1e3 for name, v in timed.items()}
    print(f"{n_params / 1e6:.1f}M parameters, {len(params)} tensors, "
          f"{torch.get_num_threads()} threads")
    print(f"weight norms {med['norms']:.2f} ms, training step {med['step']:.2f} ms: "
          f"{med['norms'] / med['step']:.2%} of a step on a sampled step, "
          f"{med['norms'] / med['step'] / 10:.3%} averaged at sample_every=10")


if __name__ == "__main__":
    main()
