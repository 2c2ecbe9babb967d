"""torch.compile: the agent adds no graph break and no recompile, in either order of
attach and compile, names layers without `_orig_mod.`, does not time compiling as a
forward, and still records exact grad norms and losses (ground truth: the loop's own
clip_grad_norm_ and loss)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from tests.agent.factories import same, spooled, spooled_steps

# dynamo itself reads .grad of a non-leaf input it traces (torch 2.13)
NON_LEAF_INPUT = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf")
BACKEND = "aot_eager"  # dynamo + AOT autograd without inductor's C++ build: fast on CPU


def five_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(32, 32), nn.GELU())])


def train(model: nn.Module, compiled: nn.Module, steps: int = 6) -> list[tuple[float, float]]:
    """bf16 autocast steps; returns the loop's own (loss, clip_grad_norm_) per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    truth = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(x).float().pow(2).mean()
        loss.backward()
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        truth.append((loss.item(), norm.item()))
        optimizer.step()
        optimizer.zero_grad()
    return truth


def compile_stats() -> tuple[int, int, int]:
    return (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
            counters["stats"]["calls_captured"])


def attach_compiled(attach, order: str) -> tuple[nn.Module, nn.Module, object]:
    """(model, what the loop calls, attachment) for each way users combine the two."""
    model = five_layers()
    if order == "attach_then_compile":
        attachment = attach(model, sample_every=2)
        return model, torch.compile(model, backend=BACKEND), attachment
    if order == "attach_compiled":
        compiled = torch.compile(model, backend=BACKEND)
        return model, compiled, attach(compiled, sample_every=2)
    attachment = attach(model, sample_every=2)
    model.compile(backend=BACKEND)
    return model, model, attachment


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("order", ["attach_then_compile", "attach_compiled", "module_compile"])
def test_no_graph_break_no_recompile_exact_values(attach, offline: Path, order: str) -> None:
    model = five_layers()
    train(model, torch.compile(model, backend=BACKEND))
    without_agent = compile_stats()
    torch._dynamo.reset()
    counters.clear()

    model, compiled, attachment = attach_compiled(attach, order)
    truth = train(model, compiled)  # steps 0, 2, 4 would be sampled in eager mode
    attachment.flush()
    assert compile_stats() == without_agent
    assert without_agent[0] == 0

    steps = spooled_steps(offline, attachment.run_id)
    assert [s["step"] for s in steps] == list(range(6))
    for record, (loss, norm) in zip(steps, truth, strict=True):
        assert same(record["loss"], loss) and same(record["grad_norm"], norm)
        assert record["autocast_dtype"] == "bfloat16"
        assert "activations" not in record  # per-layer hooks would recompile the model
    assert steps[0]["t_forward_ms"] is None  # that forward compiled the model
    assert all(s["t_forward_ms"] is not None for s in steps[1:])
    layers = spooled(offline, attachment.run_id)[-1]["run"]["layers"]
    assert [layer["name"] for layer in layers][:3] == ["0", "1", "2"]


def test_explain_counts_no_break_from_the_agent_hooks(attach) -> None:
    model = five_layers()
    x = torch.randn(4, 32)
    plain = torch._dynamo.explain(model)(x)
    attach(model, sample_every=1)  # the per-layer hooks are registered for step 0
    hooked = torch._dynamo.explain(model)(x)
    assert (hooked.graph_break_count, hooked.graph_count) == (
        plain.graph_break_count, plain.graph_count) == (0, 1)


@NON_LEAF_INPUT
def test_eager_model_still_sampled_after_a_compiled_function(attach, offline: Path) -> None:
    """Compiling something that is not the model (a loss function) leaves the model
    eager: its layers are still sampled."""
    model = five_layers()
    attachment = attach(model, sample_every=1)
    loss_fn = torch.compile(lambda out: out.pow(2).mean(), backend=BACKEND)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn(model(torch.randn(4, 32))).backward()
    optimizer.step()
    attachment.flush()
    (record,) = spooled_steps(offline, attachment.run_id)
    assert record["activations"]["absmax"][0] is not None


@NON_LEAF_INPUT
def test_blocks_compiled_before_attach(attach, offline: Path) -> None:
    """Blocks compiled one by one (the torchtitan way) before attach: the model counts as
    compiled, so no hook toggling recompiles a block."""

    def blockwise() -> nn.Module:
        model = five_layers()
        for i in range(0, len(model), 2):
            model[i] = torch.compile(model[i], backend=BACKEND)
        return model

    model = blockwise()
    train(model, model)
    without_agent = compile_stats()
    torch._dynamo.reset()
    counters.clear()
    model = blockwise()
    attachment = attach(model, sample_every=2)
    truth = train(model, model)
    attachment.flush()
    assert compile_stats() == without_agent
    steps = spooled_steps(offline, attachment.run_id)
    assert all(same(s["grad_norm"], norm) for s, (_, norm) in zip(steps, truth, strict=True))
    layers = spooled(offline, attachment.run_id)[-1]["run"]["layers"]
    assert [layer["name"] for layer in layers] == [str(i) for i in range(10)]


def first_bad_child(model: nn.Sequential, x: torch.Tensor, dtype: torch.dtype) -> int | None:
    """The truth: the position of the first child whose output held inf/NaN, the test
    running the children itself, eagerly, under autocast to `dtype`."""
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        for position, child in enumerate(model):
            x = child(x)
            if not bool(x.isfinite().all()):
                return position
    return None


def train_with_an_inf_weight_at_3(model: nn.Sequential, compiled: nn.Module,
                                  dtype: torch.dtype, scaler: Any = None
                                  ) -> dict[int, int | None]:
    """Six steps of `compiled` (SGD, autocast to `dtype`, under `scaler` if given), an inf
    written into model[4]'s weight as step 3 begins, the weights put back after each step;
    per step, the truth of `first_bad_child`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    clean = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    truth: dict[int, int | None] = {}
    for i in range(6):
        if i == 3:
            with torch.no_grad():
                model[4].weight[0, 0] = math.inf
        truth[i] = first_bad_child(model, x, dtype)
        with torch.autocast("cpu", dtype=dtype):
            loss = compiled(x).float().pow(2).mean()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        model.load_state_dict(clean)
    return truth


@pytest.mark.parametrize("order", ["attach_then_compile", "attach_compiled", "module_compile"])
def test_the_first_bad_layer_of_a_compiled_model_is_named(attach, offline: Path,
                                                          order: str) -> None:
    """An inf written into a Linear's weight at step 3 of a compiled model: the step's
    loss is inf, the agent replays its forward through the eager module and names that
    Linear, with no added graph break or recompile. Truth: the test replays the batch
    through the children itself; the weights are put back after the step."""
    model, compiled, attachment = attach_compiled(attach, order)
    truth = train_with_an_inf_weight_at_3(model, compiled, torch.bfloat16)
    attachment.flush()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1  # compiled once: no recompile
    assert truth == {i: 4 if i == 3 else None for i in range(6)}
    layers = spooled(offline, attachment.run_id)[-1]["run"]["layers"]
    names = [layer["name"] for layer in layers]
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["first_nonfinite_layer"] for s in steps] == [
        None if truth[i] is None else names.index(str(truth[i])) for i in range(6)]
    assert [s["forward_nonfinite"] for s in steps] == [True if i == 3 else None
                                                      for i in range(6)]


def test_a_compiled_model_on_the_device_path_is_searched_when_the_scaler_skips(
        attach, offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (forced on the CPU), fp16 under a GradScaler, a compiled
    model: healthy steps check no output; the step the scaler skips (an inf written into
    a Linear's weight at step 3) is replayed through the eager module, which names that
    Linear, with no graph break or recompile. Truth: the test's own eager pass."""
    monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    model = five_layers()
    compiled = torch.compile(model, backend=BACKEND)
    scaler = torch.amp.GradScaler("cpu")
    attachment = attach(compiled, scaler)
    truth = train_with_an_inf_weight_at_3(model, compiled, torch.float16, scaler)
    attachment.flush()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert truth == {i: 4 if i == 3 else None for i in range(6)}
    names = [layer["name"] for layer in spooled(offline, attachment.run_id)[-1]["run"]["layers"]]
    steps = spooled_steps(offline, attachment.run_id)
    assert [s["skipped"] for s in steps] == [i == 3 for i in range(6)]
    assert [s["first_nonfinite_layer"] for s in steps] == [
        names.index("4") if i == 3 else None for i in range(6)]
    assert [s["forward_nonfinite"] for s in steps] == [True if i == 3 else None
                                                      for i in range(6)]
