"""Cheap by design (docs/agent.md): on a healthy, unsampled CPU step the agent reads at
most 3% more elements than the plain step, counted with torch.profiler over all threads
on the nanoGPT-style model of bench/agent_overhead.py (4 blocks, bf16 autocast, under a
GradScaler or without one), on the host path and on the accelerator path forced on the
CPU."""

from __future__ import annotations

import pytest

from bench.elements_read import measure
from tests.agent.test_device_path import kernel_on_cpu


@pytest.mark.parametrize(("path", "scaled", "hold_mb"), [
    ("host", True, None),
    ("device", True, None),  # the scaler's skip is that path's flag: no output read
    ("device", False, None),  # bf16 without a scaler: outputs held, the flagged kernel
    ("device", False, 0),  # ... with the outputs only the agent kept alive read instead
], ids=["host", "device-scaler", "device-no-scaler", "device-no-scaler-hold-0"])
def test_a_healthy_unsampled_step_reads_almost_nothing_extra(
        path: str, scaled: bool, hold_mb: float | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "device":
        monkeypatch.setenv("AMPWATCH_DEVICE_PATH", "1")
    if path == "device" and not scaled:
        kernel_on_cpu()  # else every output's aminmax would be counted, not the kernel's
    plain, watched = measure("flagged", scaled, hold_mb)
    assert plain > 10_000_000  # the count sees the step's GEMMs
    assert (watched - plain) / plain <= 0.03, (plain, watched)


def test_the_count_sees_every_output_checked() -> None:
    """The same count over check_outputs="every_step" (one sum of every layer output) is
    larger by at least the outputs' elements: the counter sees what the agent reads."""
    plain, watched = measure("every_step")
    assert (watched - plain) / plain > 0.015, (plain, watched)
