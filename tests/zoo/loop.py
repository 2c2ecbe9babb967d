"""The zoo's training loop and its truth: a real HF / diffusers model from tests/zoo/models.py
trained on the CPU under the agent and a live server, with a seeded fault.

The truth is the test's own (tests/diagnosis/scenarios.Recorder: forward hooks on every
layer, the grads before the optimizer step, the optimizer's own step hook, the scaler's own
scale), plus the gradients flowing between layers: a hook on each layer's output records,
in backward execution order, the first layer whose output gradient held inf/NaN."""

from __future__ import annotations

import math
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampwatch import agent
from tests.diagnosis.scenarios import SAMPLE_EVERY, Recorder, Scenario
from tests.zoo.attention_truth import AttentionTruth
from tests.zoo.models import Arch, loss_of

Inject = Callable[[int, nn.Module, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Fault:
    name: str
    arch: Arch
    what: str  # the fault, in words
    inject: Inject | None = None
    steps: int = 40
    dtype: torch.dtype = torch.float16
    scaler: bool = True
    lr: float = 1e-3
    lr_jump: tuple[int, float] | None = None  # (step, factor): the learning rate x factor from it
    scenario: Scenario = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scenario", Scenario(
            self.name, self.what, steps=self.steps, dtype=self.dtype,
            scaler={} if self.scaler else None))


class Truth(Recorder):
    """Recorder, plus per step the first layer (backward execution order) whose output
    gradient held inf/NaN, and the scale each step's backward used."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 arch: Arch) -> None:
        super().__init__(model, optimizer)
        self.first_bad_grad: list[str | None] = []
        self.scale_used: list[float | None] = []
        self.losses: list[float] = []
        self.output_lse: list[float] = []  # the output logits' mean logsumexp, per step
        self.attention = AttentionTruth(model, arch)  # per step: {module: largest logit}
        self._bad_grad: str | None = None
        head = getattr(model, "get_output_embeddings", lambda: None)()
        if head is not None:
            self.handles.append(head.register_forward_hook(self._output))
        self.handles += [m.register_forward_hook(self._grad_watch(name))
                         for name, m in self.layers.items()]

    def _grad_watch(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.in_forward and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._grad(name, grad))
        return hook

    def _grad(self, name: str, grad: torch.Tensor) -> None:
        if self._bad_grad is None and not bool(grad.isfinite().all()):
            self._bad_grad = name

    def _output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.in_forward:
            rows = output.detach().float().reshape(-1, output.shape[-1])
            self.output_lse.append(float(torch.logsumexp(rows, dim=-1).mean()))

    def run(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        self.current.input_bad |= any(
            isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(v.isfinite().all())
            for v in batch.values())
        self.in_forward = True
        self.attention.steps.append({})
        try:
            with self.attention:
                return loss_of(model(**batch))
        finally:
            self.in_forward = False

    def end_step(self, model: nn.Module) -> None:
        super().end_step(model)
        self.first_bad_grad.append(self._bad_grad)
        self._bad_grad = None


def train(fault: Fault, server: str, record: Path | None = None,
          fix: dict[str, Any] | None = None, watch: bool = True
          ) -> tuple[str, Truth]:
    """Run the fault's loop (under the agent when `watch`); `record`: a folder for its
    bundles; `fix`: the namespace of a printed `replay --bisect` fix, applied to the model."""
    torch.manual_seed(0)
    model = fault.arch.build()
    if fix is not None:
        fix["keep_in_fp32"](model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=fault.lr)
    scaler = torch.amp.GradScaler("cpu") if fault.scaler else None
    run_id = f"zoo-{fault.name}-{uuid.uuid4().hex[:6]}"
    truth = Truth(model, optimizer, fault.arch)
    attachment = None
    if watch:
        # the agent's default batching (timed flushes cut batches wherever the machine's
        # load puts them): the diagnosis must not depend on it (test_batch_partitions.py)
        attachment = agent.attach(
            model, scaler, run=run_id, server=server,
            record={"mode": "local", "folder": record} if record is not None else False)
    for i in range(fault.steps):
        batch = fault.arch.batch(i)
        if fault.lr_jump is not None and i == fault.lr_jump[0]:
            for group in optimizer.param_groups:
                group["lr"] *= fault.lr_jump[1]
        if fault.inject is not None:
            batch = fault.inject(i, model, batch)
        with torch.autocast("cpu", dtype=fault.dtype):
            loss = truth.run(model, batch)
        truth.loss(loss)
        truth.losses.append(float(loss.detach()))
        truth.scale_used.append(scaler.get_scale() if scaler else None)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
            truth.grads(sampled=i % SAMPLE_EVERY == 0)
            scaler.step(optimizer)
            scaler.update()
            truth.current.scale_after = scaler.get_scale()
        else:
            truth.grads(sampled=i % SAMPLE_EVERY == 0)
            optimizer.step()
        truth.end_step(model)
        optimizer.zero_grad(set_to_none=True)
    truth.close()
    if attachment is not None:
        assert attachment.detach(timeout=30)
    return run_id, truth


def first_precursor(values: list[float], dtype: torch.dtype, factor: float = 10.0,
                    floor: float = 1.0, warm: int = 20, error: float = 0.25) -> int | None:
    """The first sampled step (every SAMPLE_EVERY) whose value is `factor` times its
    trained level (the median of the earliest third of the values sampled from step `warm`
    on, at least `floor`) and large enough to matter to `dtype`: its rounding there, half
    an ulp |v|*eps/2, at least `error` nats (docs/spikes.md; the server's
    precursor_factor, LEVEL_FLOOR, spike_min_history and precursor_logit_error)."""
    sampled = [(i, v) for i, v in enumerate(values) if i % SAMPLE_EVERY == 0 and i >= warm]
    early = sorted(v for _, v in sampled[: max(1, len(sampled) // 3)])
    level = max(statistics.median(early), floor)
    matters = 2 * error / torch.finfo(dtype).eps
    return next((i for i, v in sampled if v >= factor * level and v >= matters), None)


def step_is_finite(truth: Truth, step: int) -> bool:
    s = truth.steps[step]
    return (math.isfinite(truth.losses[step]) and not s.grad_bad_layers
            and s.first_bad_layer is None)


def weights(name: str, factor: float, at: int, every_step: bool = False) -> Inject:
    """Multiply parameter `name` by `factor` at step `at` (and each step after, when
    `every_step`)."""
    def inject(i: int, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        if i == at or (every_step and i > at):
            with torch.no_grad():
                model.get_parameter(name).mul_(factor)
        return batch
    return inject


def nan_embeddings(at: int) -> Inject:
    """The batch's input embeddings (`inputs_embeds`, from the model's own embedding) with a
    NaN at step `at`: a bad input the model's weights cannot catch."""
    def inject(i: int, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        if i != at:
            return batch
        embeds = model.get_input_embeddings()(batch["input_ids"]).detach().clone()
        embeds.view(-1)[0] = math.nan
        return {"inputs_embeds": embeds, "labels": batch["labels"]}
    return inject


def nan_input(key: str, at: int) -> Inject:
    def inject(i: int, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        if i == at:
            batch = {**batch, key: batch[key].clone()}
            batch[key].view(-1)[0] = math.nan
        return batch
    return inject


def foreign_tokens(at: int, vocab: int) -> Inject:
    """One batch of tokens the model never saw (a bad batch)."""
    def inject(i: int, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        if i == at:
            gen = torch.Generator().manual_seed(1000)
            ids = torch.randint(0, vocab, batch["input_ids"].shape, generator=gen)
            batch = {**batch, "input_ids": ids, "labels": ids}
        return batch
    return inject
