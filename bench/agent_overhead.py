"""What the agent costs a training step, against no agent and against its peers.

Model: a GPT-style model on the CPU (token and position embeddings, 4 pre-LN blocks,
d_model 256, 4 heads, MLP 1024, seq 64, batch 2, vocab 2048, ~4M parameters), AdamW, bf16
autocast with GradScaler("cpu") so the scaler path is measured, unscale_ then
clip_grad_norm_, one torch thread.

Modes:
  rounds  each configuration in its own process, visited in shuffled interleaved rounds
          so machine noise cancels; a second baseline process shows the noise floor.
  ab      one process alternating steps of an instrumented and a plain copy of the model
          (same weights, same batches): more precise for small overheads, but the agent's
          worker thread holds the GIL during the plain copy's steps too.
  processes  several processes per configuration (no agent, the agent offline, the agent
          sending to a server on this machine), one torch thread each, in interleaved
          rounds; also the server's CPU per step (bench/overhead_processes.py).
  memory  host memory (RSS) of the agent over many steps of a tiny model.

The agent sends to a real local server (started here unless --server is given).
Peers (wandb.watch, transformers' DebugUnderflowOverflow) run only when installed.

    python bench/agent_overhead.py --mode rounds --rounds 3 --steps 40
    python bench/agent_overhead.py --mode ab --steps 100
    python bench/agent_overhead.py --mode processes --processes 3 --steps 200
    python bench/agent_overhead.py --mode ab --steps 100 --compile   # torch.compile'd model
    python bench/agent_overhead.py --mode ab --steps 100 --record off  # no flight recorder

With --compile both copies are `torch.compile`d (inductor) and the agent is attached to the
compiled model, as nanoGPT users write it; the table also gives dynamo's graph-break and
graph counts for each copy.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

VOCAB, SEQ, BATCH, D_MODEL, HEADS, MLP, BLOCKS = 2048, 64, 2, 256, 4, 1024, 4


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.n_embd = HEADS, D_MODEL
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, MLP), nn.GELU(), nn.Linear(MLP, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Trainer:
    """One model, its AdamW and GradScaler; `step()` is the timed unit."""

    CLIPS = ("clip_grad_norm_", "total_norm_pair", "none")

    def __init__(self, seed: int = 0, compiled: bool = False, scaled: bool = True,
                 clip: str = "clip_grad_norm_") -> None:
        """`clip`: how the loop clips: torch's `clip_grad_norm_`, the `get_total_norm` +
        `clip_grads_with_norm_` pair (accelerate's), or not at all."""
        assert clip in self.CLIPS, clip
        self.clip = clip
        torch.manual_seed(seed)
        self.model = GPT()
        self.call = torch.compile(self.model) if compiled else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.scaler = torch.amp.GradScaler("cpu", enabled=scaled)  # disabled: passes through
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> float:
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=self.gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.call(idx[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.clip == "clip_grad_norm_":
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        elif self.clip == "total_norm_pair":
            params = list(self.model.parameters())
            total = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            nn.utils.clip_grads_with_norm_(params, 1.0, total)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1000.0


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def instrument(trainer: Trainer, config: str, server: str | None) -> Any:
    """Apply one configuration; returns a handle with detach() or None."""
    if config.startswith("baseline"):
        return None
    if config in ("agent", "agent_activations_every_step", "agent_offline", "agent_server"):
        from ampwatch import agent

        # agent_offline: AMPWATCH_MODE=offline in its environment keeps it off the network
        every = 1 if config == "agent_activations_every_step" else 10
        return agent.attach(trainer.model, trainer.scaler, server=server, sample_every=every,
                            name=f"bench-{config}")
    if config == "anomaly_mode":
        torch.autograd.set_detect_anomaly(True)
        return None
    if config == "wandb_watch":
        import wandb

        wandb.init(mode="offline", dir=tempfile.mkdtemp(prefix="ampwatch-bench-wandb-"))
        wandb.watch(trainer.model, log="gradients", log_freq=1)
        return None
    if config == "hf_debug_underflow_overflow":
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(trainer.model)
        return None
    raise ValueError(config)


def configurations() -> tuple[list[str], list[str]]:
    """(configurations to run, peers skipped because not installed)."""
    configs = ["baseline", "baseline_2", "agent", "agent_activations_every_step",
               "anomaly_mode"]
    missing = []
    for config, module in (("wandb_watch", "wandb"),
                           ("hf_debug_underflow_overflow", "transformers")):
        (configs if has(module) else missing).append(config)
    return configs, missing


def run_worker(config: str, steps: int, warmup: int, server: str | None) -> None:
    torch.set_num_threads(1)
    trainer = Trainer()
    handle = instrument(trainer, config, server)
    for _ in range(warmup):
        trainer.step()
    times = [trainer.step() for _ in range(steps)]
    if handle is not None:
        handle.detach()
    print(json.dumps({"config": config, "times": times}))


def summarize(times: dict[str, list[float]], reference: str) -> list[dict[str, Any]]:
    """Per configuration: the ratio of median step times to the reference's (the headline
    figure) and of mean step times (which charges every sampled step in full)."""
    base, base_mean = statistics.median(times[reference]), statistics.fmean(times[reference])
    rows = []
    for config, values in times.items():
        ordered = sorted(values)
        median, mean = statistics.median(ordered), statistics.fmean(ordered)
        rows.append({"config": config, "steps": len(values), "median_ms": median,
                     "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
                     "ratio": median / base, "mean_ms": mean, "mean_ratio": mean / base_mean})
    return rows


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}")
    print(f"{'configuration':32} {'steps':>6} {'median ms':>10} {'p90 ms':>9} {'ratio':>7} "
          f"{'mean ms':>9} {'ratio of means':>15}")
    for r in rows:
        print(f"{r['config']:32} {r['steps']:6d} {r['median_ms']:10.2f} {r['p90_ms']:9.2f} "
              f"{r['ratio']:7.3f} {r['mean_ms']:9.2f} {r['mean_ratio']:15.3f}")


def mode_rounds(args: argparse.Namespace, server: str) -> None:
    configs, missing = configurations()
    times: dict[str, list[float]] = {c: [] for c in configs}
    rng = random.Random(args.seed)
    for round_index in range(args.rounds):
        order = configs[:]
        rng.shuffle(order)
        for config in order:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", config, "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--server", server],
                capture_output=True, text=True, check=True, cwd=REPO)
            # peers (wandb) print their own lines around ours
            result = next(line for line in reversed(out.stdout.splitlines())
                          if line.startswith('{"config"'))
            times[config].extend(json.loads(result)["times"])
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    print_table(summarize(times, "baseline"),
                f"per-process rounds: {args.rounds} rounds x {args.steps} steps "
                f"(warm-up {args.warmup}), shuffled order")
    for config in missing:
        print(f"{config}: not installed, not measured")


def compile_counts() -> tuple[int, int]:
    """(graph breaks, graphs) dynamo counted in this process so far."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def alternate(watched: Trainer, plain: Trainer, steps: int) -> tuple[list[float], list[float]]:
    """Step times of `steps` alternating pairs (the order flips each pair, so drift and
    cache effects fall on both sides): (watched times, plain times)."""
    a, b = [], []
    for i in range(steps):
        pair = (watched, plain) if i % 2 else (plain, watched)
        t0, t1 = (t.step() for t in pair)
        a.append(t1 if i % 2 == 0 else t0)
        b.append(t0 if i % 2 == 0 else t1)
    return a, b


def mode_ab(args: argparse.Namespace, server: str) -> None:
    from ampwatch import agent

    torch.set_num_threads(1)
    for every in (10,) if args.compile else (10, 1):
        plain, watched = Trainer(compiled=args.compile), Trainer(compiled=args.compile)
        attachment = agent.attach(watched.call, watched.scaler, server=server,
                                  sample_every=every, name="bench-ab",
                                  record=args.record == "on")
        for _ in range(args.warmup):
            plain.step()
        if args.compile:
            plain_counts = compile_counts()
        for _ in range(args.warmup):
            watched.step()
        if args.compile:
            total = compile_counts()
            print(f"dynamo: after the plain copy {plain_counts[0]} graph breaks, "
                  f"{plain_counts[1]} graphs; after the watched copy too {total[0]} graph "
                  f"breaks, {total[1]} graphs (the same count: it reused the plain copy's graph)"
                  if total == plain_counts else
                  f"dynamo: plain copy {plain_counts}, with the watched copy {total} "
                  f"(graph breaks, graphs)")
        a, b = alternate(watched, plain, args.steps)
        attachment.detach()
        label = "agent defaults" if every == 10 else "agent activations every step"
        if args.compile:
            label = "agent, compiled model"
        rows = summarize({"no agent": b, label: a}, "no agent")
        paired = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print_table(rows, f"same-process A/B, {args.steps} alternating pairs")
        print(f"median of per-pair ratios: {paired:.3f}")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mode_memory(args: argparse.Namespace, server: str) -> None:
    from ampwatch import agent

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    attachment = agent.attach(model, scaler, server=server, name="bench-memory")
    x = torch.randn(8, 64)
    marks = {}
    for step in range(1, args.steps + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if step in (args.steps // 10, args.steps // 2, args.steps):
            attachment.flush(10)
            marks[step] = rss_bytes()
    attachment.detach()
    print("\nhost memory (RSS) of a training process with the agent")
    for step, rss in marks.items():
        print(f"after step {step:6d}: {rss / 2**20:8.1f} MiB")


@contextlib.contextmanager
def local_server(url: str | None):
    """A real `ampwatch serve` on a free port with a temporary SQLite file: (its URL, its
    process id; None for a server given by URL)."""
    if url:
        yield url, None
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ampwatch.client.cli", "serve", "--port", str(port),
             "--database-url", f"sqlite:///{tmp}/bench.db", "--log-level", "warning"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import httpx

            for _ in range(300):
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"http://127.0.0.1:{port}/api/v1/health").status_code == 200:
                        break
                time.sleep(0.1)
            os.environ["AMPWATCH_SPOOL_DIR"] = f"{tmp}/spool"
            yield f"http://127.0.0.1:{port}", proc.pid
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["rounds", "ab", "memory", "processes"],
                        default="rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=3,
                        help="processes mode: processes per configuration")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="ab mode: torch.compile both copies (the agent on the compiled one)")
    parser.add_argument("--server", default=None, help="use this server instead of a local one")
    parser.add_argument("--record", choices=["on", "off"], default="on",
                        help="ab mode: the flight recorder (attach's record=, on by default)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args.worker, args.steps, args.warmup, args.server)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1 torch thread; "
          f"model {sum(p.numel() for p in GPT().parameters()) / 1e6:.1f}M parameters")
    with local_server(args.server) as (server, server_pid):
        if args.mode == "processes":
            from bench.overhead_processes import mode_processes

            mode_processes(args, server, server_pid, Path(__file__).resolve())
            return
        {"rounds": mode_rounds, "ab": mode_ab, "memory": mode_memory}[args.mode](args, server)


if __name__ == "__main__":
    main()
