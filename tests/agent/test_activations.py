"""Sampled activation statistics, sampling after anomalies, forward order."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ampwatch.agent.collectors import finite_checks
from ampwatch.agent.layers import discover_layers
from tests.agent.factories import (
    TinyGPT,
    batches,
    bf16_loop,
    fp16_loop,
    mlp,
    spooled,
    spooled_steps,
    train_with_faults,
)


@pytest.fixture(autouse=True)
def _both_reductions(reduction: str) -> None:
    """Every test here runs with host-side and with device-side reduction."""


def test_absmax_dtype_and_time_match_a_reference_hook(attach, offline: Path) -> None:
    model = mlp()
    layers = discover_layers(model)
    reference: dict[int, tuple[float, torch.dtype]] = {}
    handles = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: reference.__setitem__(
            i, (float(out.detach().abs().max()), out.dtype))) for layer in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=2)
    fp16_loop(model, optimizer, scaler, batches(3))
    for handle in handles:
        handle.remove()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert ["activations" in s for s in steps] == [True, False, True]
    act = steps[2]["activations"]
    assert act["absmax"] == [reference[i][0] for i in range(len(layers))]
    assert act["dtype"] == [str(reference[i][1]).removeprefix("torch.")
                            for i in range(len(layers))]
    assert act["dtype"][0] == "float16"
    assert all(t > 0 for t in act["time_ms"])


def test_accumulated_calls_keep_each_layers_largest_value_and_nan(attach, offline: Path
                                                                  ) -> None:
    """Three micro-batches per step: a layer's abs-max is its largest over its calls, a NaN
    in one call wins, and a layer that computed in two dtypes is "mixed"."""
    model = mlp()
    layers = discover_layers(model)
    largest = [0.0] * len(layers)
    dtypes: list[set[str]] = [set() for _ in layers]

    def record(i: int, out: torch.Tensor) -> None:
        largest[i] = max(largest[i], float(out.detach().abs().max()))
        dtypes[i].add(str(out.dtype).removeprefix("torch."))

    handles = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: record(i, out)) for layer in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=1)
    data = batches(6)
    data[1][0].mul_(40.0)  # the largest values come from the middle micro-batch
    fp16_loop(model, optimizer, scaler, data[:3], accumulate=3)
    first_largest, first_dtypes = list(largest), [next(iter(d)) for d in dtypes]
    # second step: micro-batch 4 runs in float32 (no autocast), micro-batch 5 holds a NaN
    for d in dtypes:
        d.clear()
    data[4][0][0, 0] = float("nan")
    for i, (x, y) in enumerate(data[3:]):
        with torch.autocast("cpu", dtype=torch.float16, enabled=i != 0):
            loss = nn.functional.mse_loss(model(x), y) / 3
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    for handle in handles:
        handle.remove()
    attachment.flush(5)
    first, second = (s["activations"] for s in spooled_steps(offline, attachment.run_id))
    assert first["absmax"] == first_largest
    assert first["dtype"] == first_dtypes and first_dtypes[0] == "float16"
    assert all(t > 0 for t in first["time_ms"])
    assert all(math.isnan(v) for v in second["absmax"])  # the NaN spreads from fc1 on
    assert second["dtype"] == ["mixed" if len(d) > 1 else next(iter(d)) for d in dtypes]
    assert second["dtype"][0] == "mixed"


def test_a_sampled_steps_hooks_cost_only_that_step(attach, offline: Path) -> None:
    """The pre hooks of sampled step 10 go on as its forward begins and come off as step
    11 is set up: step 9 registers nothing, and steps 11 on run without them."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model, sample_every=10)
    pre_hooks_seen: list[int] = []
    model[0].register_forward_hook(
        lambda m, a, out: pre_hooks_seen.append(len(m._forward_pre_hooks)))
    data = batches(12)
    bf16_loop(model, optimizer, data[:10])
    assert [len(layer._forward_pre_hooks) for layer in model] == [0, 0, 0, 0]
    bf16_loop(model, optimizer, data[10:])
    # step 0 also carries the reduction probe's, once per autocast state (compute_dtype.py)
    assert pre_hooks_seen == [2] + [0] * 9 + [1, 0]
    assert [len(layer._forward_pre_hooks) for layer in model] == [0, 0, 0, 0]
    attachment.flush(5)
    assert [s["step"] for s in spooled_steps(offline, attachment.run_id)
            if "activations" in s] == [0, 10]


class Pick(nn.Module):
    """A leaf layer whose output is integer indices."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.argmax(dim=1, keepdim=True)


class PickedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.pick = nn.Linear(16, 4), Pick()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h.gather(1, self.pick(h)).expand(-1, 4)


def test_a_layer_with_an_integer_output_has_no_statistics(attach, offline: Path) -> None:
    """Only floating outputs are checked and measured: an integer output is not."""
    torch.manual_seed(0)
    model = PickedLinear()
    assert [layer.name for layer in discover_layers(model)] == ["fc", "pick"]
    attachment = attach(model, sample_every=2)
    bf16_loop(model, torch.optim.SGD(model.parameters(), lr=0.01), batches(3))
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["first_nonfinite_layer"] for s in steps] == [None, None, None]
    for sampled in (steps[0], steps[2]):
        assert sampled["activations"]["absmax"][1] is None
        assert sampled["activations"]["dtype"] == ["bfloat16", None]


def test_every_step_sampled_after_a_skipped_step(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=100, sample_after_anomaly=3)
    fp16_loop(model, optimizer, scaler, batches(8, bad=lambda i: "nan" if i == 2 else None))
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    sampled = [s["step"] for s in steps if "activations" in s]
    assert sampled == [0, 3, 4, 5]
    assert steps[2]["skipped"]


def test_nonfinite_forward_output_is_recorded(attach, offline: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=1)
    fp16_loop(model, optimizer, scaler, batches(1, bad=lambda i: "nan"))
    attachment.flush(5)
    (step,) = spooled_steps(offline, attachment.run_id)
    assert math.isnan(step["activations"]["absmax"][0])


def test_forward_order_and_attrs_reach_the_layer_table(attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attachment = attach(model)
    idx = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx).float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    attachment.flush(5)
    (entry,) = spooled(offline, attachment.run_id)
    table = {layer["name"]: layer for layer in entry["run"]["layers"]}
    order = sorted((lay["forward_index"], name) for name, lay in table.items()
                   if lay["forward_index"] is not None)
    assert [name for _, name in order] == ["tok", "pos", "ln1", "attn", "ln2", "mlp.0",
                                           "mlp.1", "mlp.2", "head"]
    assert table["attn"]["attrs"]["head_dim"] == 8
    assert table["attn"]["attrs"]["num_heads"] == 4
    assert table["tok"]["attrs"] == {"num_embeddings": 64, "embedding_dim": 32,
                                     "norm_type": 2.0, "scale_grad_by_freq": False,
                                     "sparse": False}
    assert table["head"]["attrs"]["in_features"] == 32
    assert entry["run"]["environment"]["autocast_dtype"] == "bfloat16"
    # attn.out_proj never runs through its own forward (MHA uses its weights directly)
    assert table["attn.out_proj"]["forward_index"] is None
    assert entry["batch"]["steps"][0]["activations"]["absmax"][
        table["attn.out_proj"]["index"]] is None


def test_custom_attention_block_reports_head_size(attach, offline: Path) -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head, self.n_embd = 6, 96
            self.qkv = nn.Linear(96, 288)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.qkv(x)[..., :96]

    model = nn.Sequential(Attention())
    table = {layer.name: layer.attrs for layer in discover_layers(model)}
    assert table["0"]["head_dim"] == 16 and table["0"]["num_heads"] == 6


def test_token_counts_of_linear_layers_reach_the_layer_table(attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    attachment = attach(model, sample_every=1)
    for batch, seq in ((2, 8), (3, 7), (2, 8)):  # 16 tokens, then 21: not a multiple of 8
        idx = torch.randint(0, 64, (batch, seq))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    attachment.flush(5)
    (entry,) = spooled(offline, attachment.run_id)
    table = {layer["name"]: layer for layer in entry["run"]["layers"]}
    # 16 first, then 21 replaced it (not a multiple of 8), and the later 16 did not
    assert table["head"]["attrs"]["token_count"] == 21
    assert table["mlp.0"]["attrs"]["token_count"] == 21
    assert "token_count" not in table["tok"]["attrs"]  # an Embedding has no GEMM rows


def test_first_nonfinite_layer_on_every_step_matches_a_reference_hook(attach, offline: Path
                                                                      ) -> None:
    """Between samples, the first layer in execution order whose output held inf/NaN, at
    that exact step: here the second Linear's weights overflow fp16 on steps 3 and 6 only;
    step 5's input holds a NaN, so the first layer is the first one."""
    model = mlp()
    layers = discover_layers(model)
    first_bad: dict[int, int | None] = {}
    step = {"i": 0}

    def reference(index: int, out: torch.Tensor) -> None:
        if first_bad.get(step["i"]) is None and not bool(torch.isfinite(out).all()):
            first_bad[step["i"]] = index

    handles = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: reference(i, out)) for layer in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(model, scaler, sample_every=100, sample_after_anomaly=0,
                        check_outputs="every_step")
    last = model[3]

    def on_step(i: int, *args) -> None:
        step["i"] = i + 1
        with torch.no_grad():
            last.weight.mul_(1e6 if i + 1 in (3, 6) else 1e-6 if i in (3, 6) else 1.0)

    fp16_loop(model, optimizer, scaler, batches(8, bad=lambda i: "nan" if i == 5 else None),
              on_step=on_step)
    for handle in handles:
        handle.remove()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == \
        {i: first_bad.get(i) for i in range(8)}
    assert {i for i, layer in first_bad.items() if layer is not None} == {3, 5, 6}
    assert first_bad[3] == 3 and first_bad[5] == 0
    assert [s["forward_nonfinite"] for s in steps] == [i in (3, 5, 6) for i in range(8)]
    assert [s["step"] for s in steps if "activations" in s] == [0]


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16", "fp32"])
def test_first_nonfinite_layer_in_bf16_and_fp32_between_samples(attach, offline: Path,
                                                                 autocast: bool) -> None:
    """bf16 and fp32 outputs between samples (on the CPU, checked by their sum): -inf and
    NaN are found at the right layer and step; outputs of huge finite values, whose sum
    overflows, are not flagged. Truth from the test's own hooks."""
    model = mlp()
    layers = discover_layers(model)
    inject = {2: (0, -math.inf), 4: (2, math.nan), 6: (0, "huge")}  # step: (layer, value)
    step = {"i": 0}

    def injector(index: int, out: torch.Tensor) -> torch.Tensor | None:
        layer, value = inject.get(step["i"], (None, None))
        if layer != index:
            return None
        out = out.clone()
        if value == "huge":
            out.fill_(3e38)  # finite in bf16 and fp32; the sum of 256 of them is not
        else:
            out[0, 0] = value
        return out

    injectors = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: injector(i, out)) for layer in layers]
    attachment = attach(model, sample_every=100, sample_after_anomaly=0,
                        check_outputs="every_step")
    first_bad: dict[int, int | None] = {}
    overflowing_sums: set[int] = set()

    def reference(index: int, out: torch.Tensor) -> None:
        if not bool(torch.isfinite(out).all()):
            first_bad.setdefault(step["i"], index)
        elif not bool(torch.isfinite(out.sum())):
            overflowing_sums.add(step["i"])

    references = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: reference(i, out)) for layer in layers]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(8)):
        step["i"] = i
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not all(bool(p.grad.isfinite().all()) for p in model.parameters()):
            optimizer.zero_grad()  # the weights stay finite, as a scaler would keep them
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for handle in injectors + references:
        handle.remove()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert first_bad[2] == 0 and first_bad[4] == 2 and first_bad.get(6) != 0
    assert 6 in overflowing_sums  # the path under test: finite outputs, inf sums
    assert {s["step"]: s["first_nonfinite_layer"] for s in steps} == \
        {i: first_bad.get(i) for i in range(8)}
    assert [s["forward_nonfinite"] for s in steps] == [i in first_bad for i in range(8)]
    assert not any("layer_grad_zero_share" in s for s in steps)  # counted in fp16 only


class Block(nn.Module):
    """An attention-like block (it names a head count: a layer) returning its last
    layer's output, which on one step it poisons in place after that layer ran."""

    n_head = 2

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.proj = nn.Linear(16, 4)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.proj(torch.relu(self.fc(x)))
        if self.poison:
            out[0, 0] = math.inf
        return out


def poisoned_steps(attach, offline: Path, model: nn.Module, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[dict[int, int], dict[int, int | None], dict[int, int]]:
    """Six unsampled fp32 CPU steps (step 0 sampled) of `model`, with an inf input at
    step 2 and `model.poison` set at step 4: (the first non-finite layer per step from the
    test's own hooks, the agent's `first_nonfinite_layer` per step, the number of sums
    the agent took per step)."""
    summed: dict[int, int] = {}
    step = {"i": 0}

    def counted(tensor: torch.Tensor) -> tuple[float, float]:
        summed[step["i"]] = summed.get(step["i"], 0) + 1
        return check(tensor)

    check = finite_checks.finite_check
    monkeypatch.setattr(finite_checks, "finite_check", counted)
    first_bad: dict[int, int] = {}

    def reference(index: int, out: torch.Tensor) -> None:
        if not bool(torch.isfinite(out).all()):
            first_bad.setdefault(step["i"], index)

    handles = [layer.module.register_forward_hook(
        lambda m, a, out, i=layer.index: reference(i, out)) for layer in discover_layers(model)]
    attachment = attach(model, sample_every=100, sample_after_anomaly=0,
                        check_outputs="every_step")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(batches(6, bad=lambda i: "inf" if i == 2 else None)):
        step["i"], model.poison = i, i == 4
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.zero_grad()  # the weights stay finite: each step is judged alone
        optimizer.step()
    for handle in handles:
        handle.remove()
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    return first_bad, {s["step"]: s["first_nonfinite_layer"] for s in steps}, summed


class LinearGelu(nn.Module):
    """Linear, GELU, Linear; on one step the first Linear's output is poisoned in place
    after its hook ran and before the GELU reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)
        self.poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.poison:
            h[0, 0] = math.inf
        return self.out(self.act(h))


# Between samples (CPU, fp32), per model: its layers, the first non-finite layer at the
# inf-input step 2 and the poisoned step 4 (the test's own hooks say so), and the sums
# per step (step 0 is sampled: aminmax)
REUSED_VERDICTS = {
    # a block returning its last layer's output is not summed twice, unless that output
    # was changed in place since: then the block is first (3 sums at step 4)
    "block": (Block, ["model", "fc", "proj"], {2: 1, 4: 0},
              {1: 2, 2: 2, 3: 2, 4: 3, 5: 2}),
    # a GELU whose input is the output just checked finite cannot be non-finite and is
    # not summed; when that input was changed in place since its check, the GELU is
    # checked and named first (3 sums at step 4; at step 2 fc is not finite: 3 sums)
    "activation": (LinearGelu, ["fc", "act", "out"], {2: 0, 4: 1},
                   {1: 2, 2: 3, 3: 2, 4: 3, 5: 2}),
}


@pytest.mark.parametrize("case", list(REUSED_VERDICTS))
def test_an_unchanged_output_checked_finite_is_not_summed_again(
        attach, offline: Path, reduction: str, monkeypatch: pytest.MonkeyPatch,
        case: str) -> None:
    model_type, names, expected_first, expected_sums = REUSED_VERDICTS[case]
    torch.manual_seed(0)
    model = model_type()
    assert [layer.name for layer in discover_layers(model)] == names
    first_bad, found, summed = poisoned_steps(attach, offline, model, monkeypatch)
    assert first_bad == expected_first
    assert found == {i: first_bad.get(i) for i in range(6)}
    if reduction == "host":
        assert summed == expected_sums


def test_a_train_mode_forward_under_inference_mode_is_checked(attach, offline: Path) -> None:
    """Inference tensors have no version counter: the check must not rely on one (the
    conftest fails the test on any error the agent swallowed)."""
    model = mlp()
    attachment = attach(model, sample_every=100)
    data = batches(2)
    bf16_loop(model, torch.optim.SGD(model.parameters(), lr=0.01), data[:1], autocast=False)
    with torch.inference_mode():  # step 1: not sampled, checked by the sum on the CPU
        model(data[1][0])
    attachment.flush(5)


def test_zero_grad_share_on_sampled_steps_matches_the_grads(attach, offline: Path) -> None:
    """Each layer's share of exactly-zero grad elements, measured on sampled steps; a tiny
    loss scale makes fp16 backward flush most of them to zero."""
    model = mlp()
    layers = discover_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-24, growth_interval=10**6)
    attachment = attach(model, scaler, sample_every=2)  # zeros: every 10th step at most
    reference: dict[int, list[float | None]] = {}

    def on_step(i: int, *args) -> None:
        reference[i] = [None if not layer.params else
                        sum(int((p.grad == 0).sum()) for p in layer.params)
                        / sum(p.numel() for p in layer.params) for layer in layers]

    fp16_loop(model, optimizer, scaler, batches(12), on_step=on_step)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["step"] for s in steps if "layer_grad_zero_share" in s] == [0, 10]
    for s in (steps[0], steps[10]):
        assert s["layer_grad_zero_share"] == pytest.approx(reference[s["step"]])
    assert steps[0]["layer_grad_zero_share"][0] > 0.5  # underflow, measured


class HalfLinear(nn.Linear):
    """fp32 weights, fp16 compute (what FSDP's mixed precision does): no autocast, no
    fp16 parameter, yet fp16 gradients that can underflow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.half(), self.weight.half(), self.bias.half())


def test_zero_shares_are_counted_when_layers_compute_in_fp16(attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(HalfLinear(16, 32), nn.ReLU(), HalfLinear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    attachment = attach(model, sample_every=10)
    for x, y in batches(12):
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    # step 0's forward is the first sampled one: its dtypes are known from step 1 on
    assert [s["step"] for s in steps if "layer_grad_zero_share" in s] == [10]
    assert steps[0]["activations"]["dtype"][0] == "float16"


def test_a_sampled_minus_inf_is_the_first_offender_and_its_abs_max(attach, offline: Path
                                                                  ) -> None:
    """On an accelerator a sampled step's abs-max comes from one _foreach_norm(ord=inf) a
    dtype (torch._foreach_max would drop a -inf): a -inf output is the first offender and
    its layer's abs-max is inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    attachment = attach(model, sample_every=1)

    def fault(i: int) -> None:
        if i == 1:
            model[0].bias[0] = -math.inf

    train_with_faults(model, 3, fault)
    attachment.flush(5)
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["first_nonfinite_layer"] for s in steps] == [None, 0, None]
    absmax = steps[1]["activations"]["absmax"]
    assert absmax[0] == math.inf and not math.isfinite(absmax[1])
