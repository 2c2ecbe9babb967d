"""The spike signals (agent/collectors/spikes.py) against the truth: the test's own copies of
the weights around each step, the optimizer's own state, and the test's own hooks on the
attention and output layers. Real training on the CPU, sampled every step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ampwatch.agent.collectors.spikes import SpikeCollector
from tests.agent.factories import TinyGPT, spooled, spooled_steps
from tests.spikes.model import VOCAB, Attention, TinyLM, batch

STEPS = 4


@pytest.fixture(autouse=True)
def _update_stats_every_step(request: pytest.FixtureRequest,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare every step with the truth; the default reads the update every
    20th step at most (test_the_update_is_read_every_twentieth_step)."""
    if request.function.__name__ != "test_the_update_is_read_every_twentieth_step":
        monkeypatch.setattr(SpikeCollector, "UPDATE_EVERY_MIN", 1)


def layer_names(model: nn.Module) -> list[str]:
    from ampwatch.agent.layers import discover_layers
    return [layer.name for layer in discover_layers(model)]


def train(attach, model: nn.Module, optimizer: torch.optim.Optimizer, run: str, *,
          autocast: bool = True, loss_scale: float = 1.0, hooks=None) -> list[dict]:
    """STEPS steps sampled every step; returns per step the truth: each layer's own
    parameters before and after the step, and the grads."""
    attachment = attach(model, run=run, sample_every=1)
    truth = []
    for step in range(STEPS):
        x, y = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1)) * loss_scale
        loss.backward()
        before = {id(p): p.detach().clone() for p in model.parameters()}
        grads = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
        optimizer.step()
        truth.append({"before": before, "grads": grads,
                      "after": {id(p): p.detach().clone() for p in model.parameters()}})
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    return truth


def own_params(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    seen: set[int] = set()
    out = {}
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            out[name] = own
    return out


def test_update_ratio_is_the_step_the_weights_took(attach, offline: Path) -> None:
    """fp32 weights: ||w_after - w_before|| / ||w_after|| per layer, as the test saw it
    (the agent rebuilds the update from Adam's state; the weights after the step are what
    it divides by)."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    truth = train(attach, model, optimizer, "spike-ratio")
    steps = spooled_steps(offline, "spike-ratio")
    names = layer_names(model)
    for record, seen in zip(steps, truth, strict=True):
        ratio = record["spikes"]["update_ratio"]
        for name, params in own_params(model).items():
            delta = math.sqrt(sum(float((seen["after"][id(p)] - seen["before"][id(p)])
                                        .double().square().sum()) for p in params))
            weight = math.sqrt(sum(float(seen["after"][id(p)].double().square().sum())
                                   for p in params))
            assert ratio[names.index(name)] == pytest.approx(delta / weight, rel=1e-3), name
        assert "update_lost" not in record["spikes"]  # fp32 weights: not measured


def test_bf16_weights_count_the_updates_rounding_lost(attach, offline: Path) -> None:
    """bf16 weights: the share of a layer's elements the step did not move, as the test
    saw it, among those Adam wanted to move (all of them: its moments are not zero)."""
    model = TinyLM().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    truth = train(attach, model, optimizer, "spike-lost", autocast=False)
    steps = spooled_steps(offline, "spike-lost")
    names = layer_names(model)
    lost_somewhere = False
    for record, seen in zip(steps[1:], truth[1:], strict=True):  # step 0: m may be exact 0
        lost = record["spikes"]["update_lost"]
        for name, params in own_params(model).items():
            kept = sum(int((seen["after"][id(p)] == seen["before"][id(p)]).sum())
                       for p in params)
            total = sum(p.numel() for p in params)
            assert lost[names.index(name)] == pytest.approx(kept / total, abs=0.02), name
            lost_somewhere |= kept > 0
    assert lost_somewhere


def test_adam_shares_come_from_the_optimizer_state(attach, offline: Path) -> None:
    """fp16 weights and moments with a large eps: the eps-dominated and zero second-moment
    shares among elements with a gradient, computed by the test from the state."""
    model = TinyLM().half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    attachment = attach(model, run="spike-adam", sample_every=1)
    expected = []
    for step in range(STEPS):
        x, y = batch(step)
        F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        per_layer = {}
        for name, params in own_params(model).items():
            counts = [0, 0, 0]
            for p in params:
                state, graded = optimizer.state[p], p.grad != 0
                v = state["exp_avg_sq"].float()
                root = (v / (1 - 0.999 ** float(state["step"]))).sqrt()
                counts[0] += int((graded & (root < 1e-4)).sum())
                counts[1] += int((graded & (v == 0)).sum())
                counts[2] += int(graded.sum())
            per_layer[name] = counts
        expected.append(per_layer)
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    names = layer_names(model)
    underflowed = False
    for record, per_layer in zip(spooled_steps(offline, "spike-adam"), expected, strict=True):
        spikes = record["spikes"]
        for name, (eps, zero, graded) in per_layer.items():
            i = names.index(name)
            if not graded:
                assert spikes["adam_eps_share"][i] is None
                continue
            assert spikes["adam_eps_share"][i] == pytest.approx(eps / graded)
            assert spikes["adam_v_zero_share"][i] == pytest.approx(zero / graded)
            underflowed |= zero > 0
    assert underflowed  # fp16 flushed some g**2 * (1 - beta2) to zero


def test_attention_and_output_logits_match_the_tests_own_hooks(attach, offline: Path) -> None:
    """A module calling scaled_dot_product_attention and nn.MultiheadAttention: the largest
    |q k^T| * scale over the first sequence (its rows and heads all fit the sample), and
    the output layer's largest |logit| and mean logsumexp, as the test's hooks saw them."""
    seen: dict[str, list[float]] = {"sdpa": [], "mha": [], "absmax": [], "lse": []}
    sdpa_model = TinyLM()
    attention = next(m for m in sdpa_model.modules() if isinstance(m, Attention))

    def sdpa_hook(module: Attention, args: tuple) -> None:
        with torch.no_grad():
            q = module.split(module.q(args[0]))[0].float()
            k = module.split(module.k(args[0]))[0].float()
            seen["sdpa"].append(float((q @ k.transpose(-2, -1)).abs().max())
                                / math.sqrt(q.shape[-1]))

    def head_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        rows = output.detach().float().reshape(-1, output.shape[-1])
        seen["absmax"].append(float(rows.abs().max()))
        seen["lse"].append(float(torch.logsumexp(rows, dim=-1).mean()))

    attention.register_forward_pre_hook(sdpa_hook)
    sdpa_model.head.register_forward_hook(head_hook)
    optimizer = torch.optim.AdamW(sdpa_model.parameters(), lr=1e-3)
    train(attach, sdpa_model, optimizer, "spike-sdpa", autocast=False)
    names = layer_names(sdpa_model)
    for step, record in enumerate(spooled_steps(offline, "spike-sdpa")):
        spikes = record["spikes"]
        assert spikes["attn_max_logit"][names.index("blocks.0.attn")] == pytest.approx(
            seen["sdpa"][step], rel=1e-4)
        assert [i for i, v in enumerate(spikes["attn_max_logit"]) if v is not None] == [
            names.index("blocks.0.attn")]
        assert spikes["logit_absmax"][names.index("head")] == pytest.approx(
            seen["absmax"][step], rel=1e-5)
        assert spikes["logit_lse"][names.index("head")] == pytest.approx(
            seen["lse"][step], rel=1e-5)

    torch.manual_seed(0)
    mha_model = TinyGPT()

    def mha_hook(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        x = args[0][0]  # batch_first: the first sequence
        e = module.embed_dim
        q = F.linear(x, module.in_proj_weight[:e], module.in_proj_bias[:e])
        k = F.linear(x, module.in_proj_weight[e:2 * e], module.in_proj_bias[e:2 * e])
        d = e // module.num_heads
        q = q.view(-1, module.num_heads, d).transpose(0, 1)
        k = k.view(-1, module.num_heads, d).transpose(0, 1)
        seen["mha"].append(float((q @ k.transpose(-2, -1)).detach().abs().max())
                           / math.sqrt(d))

    mha_model.attn.register_forward_pre_hook(mha_hook, with_kwargs=True)
    attachment = attach(mha_model, run="spike-mha", sample_every=1)
    optimizer = torch.optim.AdamW(mha_model.parameters(), lr=1e-3)
    for step in range(STEPS):
        idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
        F.cross_entropy(mha_model(idx).reshape(-1, 64), idx.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    names = layer_names(mha_model)
    for step, record in enumerate(spooled_steps(offline, "spike-mha")):
        assert record["spikes"]["attn_max_logit"][names.index("attn")] == pytest.approx(
            seen["mha"][step], rel=1e-4)


def test_unsampled_steps_carry_no_spike_signals(attach, offline: Path) -> None:
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    attachment = attach(model, run="spike-sampled", sample_every=3)
    for step in range(7):
        x, y = batch(step)
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    steps = spooled_steps(offline, "spike-sampled")
    assert [s["step"] for s in steps if "spikes" in s] == [0, 3, 6]
    sampled = next(s for s in steps if "spikes" in s)["spikes"]
    assert "adam_eps_share" not in sampled  # SGD: no second moment
    assert any(v for v in sampled["update_ratio"] if v is not None)


def test_a_large_parameter_is_read_on_a_strided_sample(attach, offline: Path) -> None:
    """Over SAMPLE_ELEMENTS elements the sums come from every stride-th element, scaled:
    the ratio stays within a few percent of the truth."""
    from ampwatch.agent.update_stats import SAMPLE_ELEMENTS

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    assert model[0].weight.numel() > 8 * SAMPLE_ELEMENTS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    attachment = attach(model, run="spike-strided", sample_every=1)
    seen = []
    for _ in range(3):
        F.mse_loss(model(torch.randn(32, 256)), torch.randn(32, 4)).backward()
        before = [p.detach().clone() for p in model[0].parameters()]
        optimizer.step()
        after = [p.detach() for p in model[0].parameters()]
        moved = sum(float((a - b).square().sum()) for a, b in zip(after, before, strict=True))
        seen.append(math.sqrt(moved) / math.sqrt(sum(float(a.square().sum()) for a in after)))
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    names = layer_names(model)
    for record, truth in zip(spooled_steps(offline, "spike-strided"), seen, strict=True):
        assert record["spikes"]["update_ratio"][names.index("0")] == pytest.approx(truth,
                                                                                   rel=0.05)


def test_the_update_is_read_every_twentieth_step(attach, offline: Path) -> None:
    """By default the logits are sampled every 10 steps, the update every 20th."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attachment = attach(model, run="spike-every")
    for step in range(45):
        x, y = batch(step)
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    attachment.detach()
    steps = spooled_steps(offline, "spike-every")
    assert [s["step"] for s in steps if "attn_max_logit" in s.get("spikes", {})] == [
        0, 10, 20, 30, 40]
    assert [s["step"] for s in steps if "update_ratio" in s.get("spikes", {})] == [0, 20, 40]


class Fp32ScoresAttention(Attention):
    """Attention that leaves autocast for its scores: q and k projected and met in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            x = x.float()
            q, k, v = (self.split(proj(x)) for proj in (self.q, self.k, self.v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape))


class KernelDtypes(TorchDispatchMode):
    """The dtype each attention kernel's query reached it in, after autocast cast it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if "scaled_dot_product" in func.overloadpacket.__name__:
            self.seen.add(args[0].dtype)
        return func(*args, **kwargs or {})


@pytest.mark.parametrize(("autocast", "fp32_scores"), [
    (True, False), (False, False), (True, True)], ids=["bf16", "fp32", "bf16-fp32-scores"])
def test_logits_name_the_dtype_they_are_computed_in(attach, offline: Path, autocast: bool,
                                                    fp32_scores: bool) -> None:
    """The layer table's `logits_in`: the dtype the attention kernel's query reached it in
    and the output layer's logits were in, as the test's own dispatch trace and hook saw
    them."""
    model = TinyLM()
    if fp32_scores:
        model.blocks[0].attn = Fp32ScoresAttention()
    heads: set[torch.dtype] = set()
    model.head.register_forward_hook(lambda m, a, out: heads.add(out.dtype) and None)
    kernels = KernelDtypes()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), kernels:
        model(batch(0)[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = f"spike-dtype-{autocast}-{fp32_scores}"
    train(attach, model, optimizer, run, autocast=autocast)
    table = {layer["name"]: layer["attrs"] for layer in spooled(offline, run)[-1]["run"]["layers"]}
    (kernel,), (head,) = kernels.seen, heads
    assert table["blocks.0.attn"]["logits_in"] == str(kernel).removeprefix("torch.")
    assert table["head"]["logits_in"] == str(head).removeprefix("torch.")
    assert kernel == (torch.float32 if fp32_scores or not autocast else torch.bfloat16)
