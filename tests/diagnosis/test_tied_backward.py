"""A backward-born overflow in a model with tied weights (issue 44, point 1): Hugging Face
GPT-2 built from a config, lm_head tied to wte, fp16 autocast with GradScaler("cpu");
block 1's MLP input weight is multiplied by 1e4 at step 30. Every forward output stays
finite; the truth, from the test's own hooks on each layer's output gradient, is where
the backward pass's gradient first went inf/NaN. The tied weight's gradient is inf too
(wte's use accumulates into it at the very end of backward): it must not decide."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

from ampwatch import agent
from tests.diagnosis.scenarios import observed

transformers = pytest.importorskip("transformers")

FAULT_STEP, STEPS, VOCAB = 30, 40, 256


class BackwardTruth:
    """Each step, every leaf module's output gradient in the order backward made them,
    and whether it was finite; and whether every forward output was finite."""

    def __init__(self, model: nn.Module) -> None:
        self.order: list[tuple[str, bool]] = []
        self.forward_finite = True
        self.names = {m: n for n, m in model.named_modules() if next(m.children(), None) is None}
        for module in self.names:
            module.register_forward_hook(self._forward)

    def _forward(self, module: nn.Module, args: tuple, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.forward_finite &= bool(torch.isfinite(out).all())
            if out.requires_grad:
                name = self.names[module]
                out.register_hook(lambda g, name=name: self.order.append(
                    (name, bool(torch.isfinite(g).all()))))

    def first_bad(self) -> str | None:
        return next((name for name, finite in self.order if not finite), None)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                     n_positions=32, tie_word_embeddings=True,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def test_backward_born_overflow_is_charged_to_the_layer_not_the_tied_head(server) -> None:
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    truth = BackwardTruth(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run_id = f"tied-gpt2-{uuid.uuid4().hex[:6]}"
    attachment = agent.attach(model, scaler, run=run_id, server=server.url,
                              flush_interval=0.2)
    gen = torch.Generator().manual_seed(0)
    first_bad: dict[int, str | None] = {}
    forward_finite: dict[int, bool] = {}
    tied_grad_finite: dict[int, bool] = {}
    for i in range(STEPS):
        if i == FAULT_STEP:
            with torch.no_grad():
                model.transformer.h[1].mlp.c_fc.weight.mul_(1e4)
        idx = torch.randint(0, VOCAB, (4, 17), generator=gen)
        truth.order, truth.forward_finite = [], True
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(idx[:, :-1]).logits
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                               idx[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        first_bad[i], forward_finite[i] = truth.first_bad(), truth.forward_finite
        tied_grad_finite[i] = bool(torch.isfinite(model.lm_head.weight.grad).all())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=30)
    # the scenario happened: from the fault on, a backward-born overflow, the tie inf too
    assert all(first_bad[i] is None for i in range(FAULT_STEP))
    assert all(forward_finite.values())
    culprit = first_bad[FAULT_STEP]
    assert culprit is not None and culprit.startswith("transformer.h.1.mlp"), culprit
    assert not tied_grad_finite[FAULT_STEP]
    got, items = observed(server.url, run_id)
    named = {layer for _, layer, step, _ in got if step == FAULT_STEP}
    assert named == {culprit}, "\n".join(f"{f['severity']} {f['kind']} {f['layer']} "
                                         f"{f['step']} {f['message']}" for f in items)
