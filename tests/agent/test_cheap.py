"""Cheap by design (docs/agent.md): on a healthy, unsampled CPU step the agent reads at
most 3% more elements than the plain step, counted with torch.profiler over all threads
on the nanoGPT-style model of bench/agent_overhead.py (4 blocks, bf16 autocast)."""

from __future__ import annotations

from bench.elements_read import measure


def test_a_healthy_unsampled_step_reads_almost_nothing_extra() -> None:
    plain, watched = measure("flagged")
    assert plain > 10_000_000  # the count sees the step's GEMMs
    assert (watched - plain) / plain <= 0.03, (plain, watched)


def test_the_count_sees_every_output_checked() -> None:
    """The same count over check_outputs="every_step" (one sum of every layer output) is
    larger by at least the outputs' elements: the counter sees what the agent reads."""
    plain, watched = measure("every_step")
    assert (watched - plain) / plain > 0.015, (plain, watched)
