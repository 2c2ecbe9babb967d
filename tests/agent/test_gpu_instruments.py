"""The GPU check's instruments, on the CPU: the parts of them that do not need a device
(the profiler trace arithmetic for CUDA traces, the scaler's sync exclusion), so that the
first GPU run is not also their first run."""

from __future__ import annotations

import pytest
import torch

from tests.agent.gpu_loops import Loop, allow_loop_syncs, host_waits, overflow_factors
from tests.agent.gpu_timing import compare_phases, phase_ms

CUDA = torch.device("cuda")


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
            "args": args}


def test_cuda_phase_time_is_the_gpu_span_of_the_work_launched_in_the_range() -> None:
    """Launches inside a range, from any thread, count with their kernels, copies and
    memsets, first start to last end (gaps included); launches outside it do not."""
    trace = {"traceEvents": [
        _event("user_annotation", "ampwatch.forward.3", 100, 50),
        _event("cuda_runtime", "cudaLaunchKernel", 110, 2, correlation=1),
        _event("cuda_driver", "cuLaunchKernel", 120, 2, correlation=2),
        _event("kernel", "gemm", 200, 30, tid=7, correlation=1),
        _event("kernel", "triton_fused", 260, 15, tid=7, correlation=2),
        _event("user_annotation", "ampwatch.backward.3", 160, 40),
        _event("cuda_runtime", "cudaLaunchKernel", 170, 2, tid=9, correlation=3),  # autograd
        _event("cuda_runtime", "cudaMemsetAsync", 175, 2, tid=9, correlation=4),
        _event("gpu_memset", "Memset", 280, 5, tid=7, correlation=4),
        _event("kernel", "gemm_bwd", 290, 40, tid=7, correlation=3),
        _event("cuda_runtime", "cudaEventRecord", 180, 1, correlation=5),  # no GPU work
        _event("cuda_runtime", "cudaLaunchKernel", 300, 2, correlation=6),  # outside
        _event("kernel", "later", 400, 10, tid=7, correlation=6),
        _event("kernel", "unlaunched", 420, 10, tid=7, correlation=99),  # follows "later"
    ]}
    spans = phase_ms(trace, CUDA)
    assert spans == {("forward", 3): pytest.approx((275 - 200) / 1000),
                     ("backward", 3): pytest.approx((330 - 280) / 1000)}
    cpu = phase_ms(trace, torch.device("cpu"))
    assert cpu == {("forward", 3): pytest.approx(0.05), ("backward", 3): pytest.approx(0.04)}


def test_gpu_work_without_a_recorded_launch_goes_with_the_work_before_it() -> None:
    """A library kernel whose launch the trace lacks (cuBLAS's own driver call) extends the
    span of the phase whose kernel ran just before it, not the next phase's."""
    trace = {"traceEvents": [
        _event("user_annotation", "ampwatch.forward.0", 0, 100),
        _event("cuda_runtime", "cudaLaunchKernel", 10, 2, correlation=1),
        _event("kernel", "layernorm", 50, 10, correlation=1),
        _event("kernel", "cublas_gemm", 60, 40, correlation=77),
        _event("cuda_runtime", "cudaLaunchKernel", 120, 2, correlation=2),  # the loss
        _event("kernel", "loss", 100, 5, correlation=2),
        _event("kernel", "loss_reduce", 105, 5, correlation=78),
        _event("user_annotation", "ampwatch.backward.0", 150, 100),
        _event("cuda_runtime", "cudaLaunchKernel", 160, 2, correlation=3),
        _event("kernel", "gemm_bwd", 200, 30, correlation=3),
    ]}
    assert phase_ms(trace, CUDA) == {("forward", 0): pytest.approx(0.05),
                                     ("backward", 0): pytest.approx(0.03)}


def test_micro_batches_add_up_and_phases_compare_by_step() -> None:
    trace = {"traceEvents": [_event("user_annotation", "ampwatch.forward.1", 0, 1000),
                             _event("user_annotation", "ampwatch.forward.1", 2000, 1000),
                             _event("user_annotation", "ampwatch.forward.2", 4000, 1000),
                             _event("cuda_runtime", "cudaLaunchKernel", 10, 1, correlation=1),
                             _event("kernel", "a", 100, 500, correlation=1),
                             _event("cuda_runtime", "cudaLaunchKernel", 2010, 1, correlation=2),
                             _event("kernel", "b", 2100, 300, correlation=2)]}
    truth = phase_ms(trace, torch.device("cpu"))
    assert truth == {("forward", 1): pytest.approx(2.0), ("forward", 2): pytest.approx(1.0)}
    # on CUDA each micro-batch's span counts apart: the gap between them is not forward time
    assert phase_ms(trace, CUDA) == {("forward", 1): pytest.approx(0.8)}
    result = compare_phases(truth, {1: {"t_forward_ms": 2.1}, 2: {"t_forward_ms": 0.5}})
    assert result["forward"]["steps"] == 2
    assert result["forward"]["median"] == pytest.approx((0.05 + 0.5) / 2)
    assert result["forward"]["worst"] == pytest.approx(0.5)
    assert result["backward"]["steps"] == 0 and result["backward"]["median"] is None


def test_the_sync_exclusion_keeps_the_scalers_behaviour() -> None:
    """GradScaler with its found_inf read moved under the check's control skips the same
    steps and trains to the same weights as the original."""
    device = torch.device("cpu")
    loops = [Loop("fp16_scaler", device), Loop("fp16_scaler", device)]
    allow_loop_syncs(loops[1].scaler, device)
    stepped: list[list[bool]] = [[], []]
    for loop, flags in zip(loops, stepped, strict=True):
        loop.optimizer.register_step_post_hook(lambda *a, flags=flags: flags.__setitem__(-1, True))
        tokens, factors = loop.batches(5), overflow_factors(5, 2, device)
        for i in range(5):
            flags.append(False)
            loop.step(tokens[i], factors[i])
    assert stepped[0] == stepped[1] == [True, True, False, True, True]
    for a, b in zip(loops[0].model.parameters(), loops[1].model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_host_waits_restores_what_it_wrapped() -> None:
    originals = (torch.cuda.synchronize, torch.cuda.Event.synchronize,
                 torch.cuda.Event.elapsed_time, torch.cuda.Stream.synchronize)
    with host_waits() as waits:
        assert torch.cuda.synchronize is not originals[0]
    assert waits == []
    assert (torch.cuda.synchronize, torch.cuda.Event.synchronize,
            torch.cuda.Event.elapsed_time, torch.cuda.Stream.synchronize) == originals
