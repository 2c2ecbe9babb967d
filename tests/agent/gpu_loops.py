"""Training recipes that run on CUDA as on the CPU, and the instruments that judge the
agent on a GPU: the sync debug mode around a step with the loop's own synchronisation
excluded, and the errors the agent's error boundary swallowed.

Shared by the `-m cuda` tests and `bench/gpu_check.py` (which also runs them on the CPU in
its smoke mode), so both judge the agent the same way.

How the sync debug mode works (c10/cuda/CUDAFunctions): the mode is one process-wide
setting, and a synchronising call raises in whichever thread makes it. So:
- the loop's own synchronisation must not run under "error": GradScaler reads `found_inf`
  with `.item()` in `_maybe_opt_step`; `allow_loop_syncs` runs that one read with the mode
  off and everything else of the step (the agent's hooks included) with it on;
- an error raised inside the agent's hooks does not reach the loop: the error boundary swallows it,
  so the check counts what the boundary swallowed (`SwallowedErrors`), by site;
- the agent's worker thread waits on CUDA events (`Event.synchronize`), which the mode
  does not flag; anything else it synchronised would be swallowed there and counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ampwatch.agent import errors

SYNC_MESSAGE = "synchronizing"  # "called a synchronizing CUDA operation"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int
    block: int
    layers: int
    heads: int
    embd: int


# nanoGPT's GPT-2 small (124M parameters; vocabulary padded to 50304 as nanoGPT does)
GPT2_SMALL = GPTConfig(vocab=50304, block=1024, layers=12, heads=12, embd=768)
TINY = GPTConfig(vocab=512, block=64, layers=2, heads=4, embd=64)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.c_attn = nn.Linear(config.embd, 3 * config.embd)
        self.c_proj = nn.Linear(config.embd, config.embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(config.embd), nn.LayerNorm(config.embd)
        self.attn = CausalSelfAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.embd, 4 * config.embd), nn.GELU(),
                                 nn.Linear(4 * config.embd, config.embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: learned positions, pre-LN blocks, LM head tied to the embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.embd)
        self.wpe = nn.Embedding(config.block, config.embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.embd)
        self.lm_head = nn.Linear(config.embd, config.vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


RECIPES = ("fp16_scaler", "deprecated_cuda_scaler", "bf16", "accumulation", "compiled",
           "fp8_torchao")


class Loop:
    """One model trained by one recipe of the reference loops:

    fp16_scaler: fp16 autocast, torch.amp.GradScaler, unscale_, clip_grad_norm_;
    deprecated_cuda_scaler: the same with torch.cuda.amp.GradScaler;
    bf16: bf16 autocast, no scaler, clipping; accumulation: fp16 with a scaler over
    `micro` micro-batches; compiled: the fp16 loop on a torch.compile'd model (`backend`;
    `compile=True` compiles any recipe's model);
    fp8_torchao: torchao Float8Linear layers (emulated off CUDA) under bf16 autocast.
    """

    def __init__(self, recipe: str, device: torch.device, config: GPTConfig = TINY, *,
                 batch: int = 4, seed: int = 0, backend: str = "inductor",
                 micro: int = 4, compile: bool = False) -> None:
        self.recipe, self.device, self.config, self.batch = recipe, device, config, batch
        torch.manual_seed(seed)
        self.model = GPT(config).to(device)
        if recipe == "fp8_torchao":
            convert_to_fp8(self.model, "tensorwise", emulate=device.type != "cuda")
        self.compiled = compile or recipe == "compiled"
        self.call: Any = (torch.compile(self.model, backend=backend) if self.compiled
                          else self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.dtype = torch.bfloat16 if recipe in ("bf16", "fp8_torchao") else torch.float16
        if device.type != "cuda" and self.dtype == torch.float16:
            self.dtype = torch.bfloat16  # CPU autocast: bf16 is the fast one; same code path
        self.scaler: Any = None
        if recipe == "deprecated_cuda_scaler":
            with _quiet_deprecation():
                self.scaler = torch.cuda.amp.GradScaler()
        elif recipe not in ("bf16", "fp8_torchao"):
            self.scaler = torch.amp.GradScaler(device.type)
        self.micro = micro if recipe == "accumulation" else 1
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)

    def batches(self, n: int) -> list[torch.Tensor]:
        """`n` steps of random tokens, made on the device up front (a host-to-device copy of
        pageable memory would synchronise inside the checked region)."""
        shape = (n, self.micro, self.batch, self.config.block + 1)
        return list(torch.randint(0, self.config.vocab, shape, generator=self.gen,
                                  device=self.device).unbind(0))

    def step(self, tokens: torch.Tensor, factor: torch.Tensor | None = None, *,
             mark: Callable[[str], contextlib.AbstractContextManager] | None = None,
             on_unscaled: Callable[[], None] | None = None) -> None:
        """One optimizer step; `factor` (a device scalar) multiplies the loss: inf makes
        the step overflow without a host read. `mark(phase)` wraps the forward, the
        backward and the optimizer step (profiler ranges); `on_unscaled` runs once the
        grads are final, before clipping."""
        mark = mark or (lambda phase: contextlib.nullcontext())
        for idx in tokens.unbind(0):
            with torch.autocast(self.device.type, dtype=self.dtype):
                with mark("forward"):
                    logits = self.call(idx[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            if factor is not None:
                loss = loss * factor
            loss = loss / self.micro
            with mark("backward"):
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if on_unscaled is not None:
            on_unscaled()
        nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        with mark("optimizer"):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _quiet_deprecation() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation (and, off CUDA, "disabling") notes
        yield


def fp8_unavailable(device: torch.device) -> str | None:
    """Why torchao FP8 training cannot run on `device`, or None: emulated casts off CUDA,
    real ones on CUDA from compute capability 8.9 (Ada, Hopper)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao (ampwatch[fp8]) is not installed"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "real FP8 casts need compute capability 8.9 or later (Ada, Hopper)"
    return None


def convert_to_fp8(model: nn.Module, recipe: str, *, emulate: bool) -> None:
    """torchao `convert_to_float8_training` on every Linear whose dimensions are multiples
    of 16 (what torch._scaled_mm accepts); emulated casts off Hopper-class GPUs."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, name: (module.in_features % 16 == 0
                                               and module.out_features % 16 == 0))


def set_sync_debug(mode: str, device: torch.device) -> None:
    if device.type == "cuda":
        with warnings.catch_warnings():  # "a prototype feature": said once, known here
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def sync_errors(device: torch.device) -> Iterator[None]:
    """Every synchronising CUDA call raises inside (process-wide; a no-op off CUDA)."""
    set_sync_debug("error", device)
    try:
        yield
    finally:
        set_sync_debug("default", device)


def allow_loop_syncs(scaler: Any, device: torch.device) -> None:
    """Exclude GradScaler's own synchronisation from a sync-checked step: its
    `_maybe_opt_step` reads found_inf with `.item()` (the one host read a scaler makes per
    step); this instance's copy of it makes that read with the mode off and steps the
    optimizer (whose hooks are the agent's) with it back on. Same logic as torch's."""
    if scaler is None:
        return

    def maybe_opt_step(optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        set_sync_debug("default", device)
        try:
            found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        finally:
            set_sync_debug("error", device)
        return None if found else optimizer.step(*args, **kwargs)

    scaler._maybe_opt_step = maybe_opt_step


def allow_search_syncs(monkeypatch: Any, device: torch.device) -> list[int]:
    """Exclude the agent's search of a step a GradScaler skipped from a sync-checked step:
    its replay of that step's forward reads every layer's (min, max) at once (one host
    read, after the scaler's own; agent/collectors/forward_search.py), made here with the
    mode off. Returns the list each search appends its answer to (a layer index, or -1)."""
    from ampwatch.agent.collectors import forward_search

    original = forward_search.first_bad_output
    searched: list[int] = []

    def search(*args: Any, **kwargs: Any) -> Any:
        set_sync_debug("default", device)
        try:
            call = original(*args, **kwargs)
        finally:
            set_sync_debug("error", device)
        searched.append(-1 if call is None else call[0])
        return call

    monkeypatch.setattr(forward_search, "first_bad_output", search)
    return searched


# host waits the sync debug mode does not flag (c10 flags only the synchronising copies
# and stream/device syncs it wraps): an event or stream waited on from the training thread
WAITS = (("Event", "synchronize"), ("Event", "elapsed_time"), ("Stream", "synchronize"))


@contextlib.contextmanager
def host_waits() -> Iterator[list[str]]:
    """Counts, on the thread that enters it, the Python-level waits on the device that the
    sync debug mode misses: `torch.cuda.synchronize()`, `Event.synchronize()` and
    `.elapsed_time()`, `Stream.synchronize()`. The agent's worker makes such waits (on
    its own thread); the training thread must not."""
    seen: list[str] = []
    thread = threading.get_ident()
    patched: list[tuple[Any, str, Any]] = []

    def counting(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def wait(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == thread:
                seen.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)

        patched.append((owner, name, original))
        setattr(owner, name, wait)

    counting(torch.cuda, "synchronize")
    for owner, name in WAITS:
        counting(getattr(torch.cuda, owner), name)
    try:
        yield seen
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


AGENT_DIR = str(Path(errors.__file__).resolve().parent)


def sync_origin(exc: BaseException) -> str | None:
    """For an error of the sync debug mode that reached the loop: "agent" when an agent
    frame is on its traceback, else "loop", with the innermost frames; None for any other
    error."""
    if SYNC_MESSAGE not in str(exc):
        return None
    frames = list(traceback.walk_tb(exc.__traceback__))
    who = "agent" if any(f.f_code.co_filename.startswith(AGENT_DIR) for f, _ in frames) else "loop"
    where = "; ".join(f"{Path(f.f_code.co_filename).name}:{line}" for f, line in frames[-3:])
    return f"{who}: {str(exc).splitlines()[0]} at {where}"


class SwallowedErrors:
    """The exceptions the agent's error boundary swallowed while installed, as (site, message)."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, str]] = []

    def __enter__(self) -> SwallowedErrors:
        errors.set_error_handler(lambda site, exc: self.errors.append(
            (site, f"{type(exc).__name__}: {exc}".splitlines()[0])))
        return self

    def __exit__(self, *exc: object) -> None:
        errors.set_error_handler(None)

    @property
    def syncs(self) -> list[tuple[str, str]]:
        """The swallowed errors that are the sync debug mode's: a synchronising call."""
        return [(site, message) for site, message in self.errors if SYNC_MESSAGE in message]


def overflow_factors(n: int, at: int | None, device: torch.device) -> list[torch.Tensor]:
    """Per-step loss factors on the device: 1, and inf at step `at` (an overflow)."""
    values = torch.ones(n, device=device)
    if at is not None:
        values[at] = math.inf
    return list(values.unbind(0))
