"""The agent's CUDA-only paths, on a CUDA device (`python -m pytest -m cuda`; skipped
without one): no host sync in any training recipe, CUDA-event phase times against
torch.profiler, peak memory per step, the pinned host copies, exact values on the device,
and real FP8 casts. The truth comes from the tests' own hooks, never from the agent."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.agent.factories import same, spooled_steps
from tests.agent.gpu_loops import (
    RECIPES,
    GPTConfig,
    Loop,
    allow_loop_syncs,
    allow_search_syncs,
    fp8_unavailable,
    host_waits,
    overflow_factors,
    sync_errors,
)
from tests.agent.gpu_timing import (
    PhaseMarks,
    compare_phases,
    peak_truth_before,
    phase_ms,
    profiled_trace,
)
from tests.conftest import LiveServer

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")
# big enough that the GPU, not the kernel launches, sets each phase's time
BUSY = GPTConfig(vocab=8192, block=512, layers=8, heads=16, embd=1024)  # ~110M parameters


def _needs_fp8() -> None:
    reason = fp8_unavailable(CUDA)
    if reason:
        pytest.skip(reason)


# inductor's own warnings: importing it (torch 2.13's pre_grad passes use torch.jit), and
# compiling on an Ampere-or-later GPU while float32 matmuls do not use TF32
INDUCTOR = [pytest.mark.filterwarnings(
                "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
            pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")]


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=INDUCTOR) if r == "compiled" else r
                                    for r in RECIPES])
def test_no_host_sync_in_any_recipe(attach, offline: Path, recipe: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """100 steps under the sync debug mode, sampled steps and an overflow's anomaly window
    included; the loop's own found_inf read is the only sync allowed, and the agent's one
    read when the scaler skipped a step (its search of that step's forward). A sync in the
    agent's hooks is swallowed by its guard and fails the test through `agent_errors`."""
    if recipe == "fp8_torchao":
        _needs_fp8()
    loop = Loop(recipe, CUDA)
    warmup, steps = 3, 100
    scaled = loop.scaler is not None and loop.scaler.is_enabled()
    tokens = loop.batches(warmup + steps)
    factors = overflow_factors(warmup + steps, warmup + 30 if scaled else None, CUDA)
    attachment = attach(loop.call, loop.scaler, sample_every=10)
    for i in range(warmup):
        loop.step(tokens[i], factors[i])
    allow_loop_syncs(loop.scaler, CUDA)
    searched = allow_search_syncs(monkeypatch, CUDA)
    with host_waits() as waits:
        for i in range(warmup, warmup + steps):
            with sync_errors(CUDA):
                loop.step(tokens[i], factors[i])
    assert waits == []  # no event or stream waited on by the training thread
    assert attachment.flush(60)
    records = spooled_steps(offline, attachment.run_id)
    assert [r["step"] for r in records] == list(range(warmup + steps))
    sampled = [r["step"] for r in records if "activations" in r and r["step"] >= warmup]
    assert bool(sampled) != loop.compiled  # sampled steps were checked (never when compiled)
    if scaled:
        assert records[warmup + 30]["skipped"]
    # searched: each unsampled step the scaler skipped, and only those (never a healthy
    # one): a replay per micro-batch at most, up to the first with a bad output
    skipped = [r["step"] for r in records[warmup:] if r["skipped"] and "activations" not in r]
    assert len(skipped) <= len(searched) <= loop.micro * len(skipped), (searched, skipped)


def test_the_loops_own_sync_raises_where_it_is_not_excluded() -> None:
    """The instrument works: without the exclusion GradScaler's found_inf read raises."""
    loop = Loop("fp16_scaler", CUDA)
    tokens = loop.batches(2)
    loop.step(tokens[0])
    with pytest.raises(RuntimeError, match="synchronizing"), sync_errors(CUDA):
        loop.step(tokens[1])


def test_host_waits_are_counted_on_the_entering_thread_only() -> None:
    event = torch.cuda.Event()
    event.record()
    with host_waits() as waits:
        event.synchronize()
        torch.cuda.synchronize()
        worker = threading.Thread(target=event.synchronize)
        worker.start()
        worker.join()
    assert waits == ["Event.synchronize", "torch.cuda.synchronize"]


def test_cuda_event_phase_times_match_the_profiler(attach, offline: Path) -> None:
    loop = Loop("fp16_scaler", CUDA, BUSY, batch=16)
    warmup, profiled = 3, 5
    tokens = loop.batches(warmup + profiled)
    attachment = attach(loop.call, loop.scaler)
    marks = PhaseMarks()

    def run(i: int) -> None:
        marks.step = i
        loop.step(tokens[i], mark=marks.mark)

    for i in range(warmup):
        run(i)
    trace = profiled_trace(lambda: [run(i) for i in range(warmup, warmup + profiled)], CUDA)
    assert attachment.flush(60)
    records = {r["step"]: r for r in spooled_steps(offline, attachment.run_id)}
    for phase, result in compare_phases(phase_ms(trace, CUDA), records).items():
        assert result["steps"] == profiled, phase
        assert result["median"] <= 0.10, (phase, result)


@pytest.mark.parametrize("recipe", ["fp16_scaler", "bf16"])
def test_peak_memory_per_step_is_max_memory_allocated(attach, offline: Path,
                                                      recipe: str) -> None:
    """Each step's recorded peak is max_memory_allocated over that step alone: the truth
    is read just before the agent reads and resets it (gpu_timing.peak_truth_before)."""
    loop = Loop(recipe, CUDA, BUSY, batch=8)
    n = 6
    tokens = loop.batches(n)
    attachment = attach(loop.call, loop.scaler)
    torch.cuda.reset_peak_memory_stats()
    with peak_truth_before(loop.scaler, loop.optimizer, CUDA) as peaks:
        for i in range(n):
            loop.step(tokens[i])
    assert attachment.flush(60)
    records = spooled_steps(offline, attachment.run_id)
    assert len(peaks) == n and min(peaks) > 0
    assert [r["peak_mem_bytes"] for r in records] == peaks


def test_host_copies_are_pinned_and_pooled(attach, offline: Path) -> None:
    """The per-step copy goes to pinned memory (a non-blocking copy into pageable memory
    would synchronise) from a bounded pool that is reused."""
    loop = Loop("fp16_scaler", CUDA)
    tokens = loop.batches(40)
    attachment = attach(loop.call, loop.scaler)
    for i in range(40):
        loop.step(tokens[i])
    assert attachment.flush(60)
    buffer = attachment._watch.buffer
    assert buffer.tensor.device.type == "cuda"
    assert buffer._free and all(host.is_pinned() for host in buffer._free)
    assert buffer._allocated <= buffer.pool_max and buffer._allocated < 40
    assert len(spooled_steps(offline, attachment.run_id)) == 40


def test_exact_values_on_the_device(attach, offline: Path) -> None:
    """Loss scale, skipped steps and the unscaled grad norm, reduced on the device, equal
    the scaler's own values and get_total_norm (an overflow at step 2)."""
    loop = Loop("fp16_scaler", CUDA)
    n = 8
    tokens, factors = loop.batches(n), overflow_factors(n, 2, CUDA)
    attachment = attach(loop.call, loop.scaler, sample_every=0)
    stepped: list[bool] = []
    loop.optimizer.register_step_post_hook(lambda *a: stepped.__setitem__(-1, True))
    refs = []
    for i in range(n):
        ref = {"loss_scale": loop.scaler.get_scale()}

        def grad_norm(ref: dict = ref) -> None:
            grads = [p.grad for p in loop.model.parameters() if p.grad is not None]
            ref["grad_norm"] = float(torch.nn.utils.get_total_norm(grads))

        stepped.append(False)
        loop.step(tokens[i], factors[i], on_unscaled=grad_norm)
        refs.append(ref)
    assert attachment.flush(60)
    records = spooled_steps(offline, attachment.run_id)
    assert [r["skipped"] for r in records] == [not s for s in stepped]
    assert records[2]["skipped"] and not math.isfinite(records[2]["grad_norm"])
    for record, ref in zip(records, refs, strict=True):
        assert record["loss_scale"] == ref["loss_scale"]
        assert same(record["grad_norm"], ref["grad_norm"], rel=1e-4)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("cuda")
    live = LiveServer(f"sqlite:///{root / 'cuda.db'}", root / "server.log")
    live.start()
    yield live
    live.stop()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_real_fp8_casts_match_torchao(server: LiveServer, recipe: str) -> None:
    """The FP8 suite's outlier scenario with real (not emulated) casts in bf16: every
    recorded underflow share and the latest abs-max and scale equal torchao's own cast."""
    _needs_fp8()
    from tests.agent.fp8_scenario import FAULT_STEP, fp8_report, observed_shares, train

    run, truth = train(server, recipe, outlier_from=FAULT_STEP, device=CUDA)
    report = fp8_report(server, run)
    shares = observed_shares(report, "underflow")
    assert shares
    for key, share in shares.items():
        assert share == pytest.approx(truth.seen[key]["underflow"], rel=1e-6, abs=1e-9), key
    for layer in report["layers"]:
        for role, latest in layer["latest"].items():
            seen = truth.seen[(latest["step"], layer["name"], role)]
            assert latest["amax"] == pytest.approx(seen["amax"], rel=1e-6)
            assert latest["scale"] == pytest.approx(seen["scale"], rel=1e-6)
    if recipe == "tensorwise":
        assert truth.seen[(FAULT_STEP, "fc1", "input")]["underflow"] > 0.9
