"""Attention found by behaviour: on every architecture of the zoo, each attention call
(torch's scaled_dot_product_attention, transformers' sdpa and eager paths, diffusers'
processors) is recorded as the largest |q k^T| * scale of the first sequence, credited to
the innermost module running it, whatever attributes that module keeps.

The truth is the test's own (tests/zoo/attention_truth.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ampwatch.agent.layers import discover_layers
from tests.agent.factories import spooled_steps
from tests.zoo.attention_truth import AttentionTruth
from tests.zoo.models import ARCHS, LLAMA, LLAMA_EAGER, Arch, loss_of

STEPS = 2


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_every_attention_call_is_credited_to_the_module_running_it(
        arch: Arch, attach, offline: Path) -> None:
    torch.manual_seed(0)
    model = arch.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    truth = AttentionTruth(model, arch)
    attachment = attach(model, run=f"zoo-attn-{arch.name}", sample_every=1)
    for step in range(STEPS):
        truth.steps.append({})
        with truth:
            loss = loss_of(model(**arch.batch(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert attachment.detach(timeout=10)
    names = [layer.name for layer in discover_layers(model)]
    attention = sorted(n for n, m in model.named_modules() if type(m).__name__ in arch.attention)
    records = spooled_steps(offline, f"zoo-attn-{arch.name}")
    assert len(records) == STEPS
    for record, seen in zip(records, truth.steps, strict=True):
        assert sorted(seen) == attention, "the truth did not see every attention module"
        logits = record["spikes"]["attn_max_logit"]
        recorded = {names[i]: v for i, v in enumerate(logits) if v is not None}
        assert recorded == pytest.approx(seen, rel=1e-4)


@pytest.mark.parametrize("arch", [LLAMA, LLAMA_EAGER], ids=["sdpa", "eager"])
def test_recording_attention_adds_no_syncing_call(arch: Arch, attach, offline: Path,
                                                  sync_calls) -> None:
    """Every step sampled: the training thread makes the calls the plain loop makes."""
    counts = []
    for use_agent in (False, True):
        torch.manual_seed(0)
        model = arch.build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if use_agent:
            # the recorder reads a CPU loss without a scaler (a host value: agent/recorder.py)
            attachment = attach(model, run=f"zoo-sync-{arch.name}", sample_every=1,
                                record=False)
        sync_calls.clear()
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(model(**arch.batch(step)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        counts.append(dict(sync_calls))
    assert attachment.detach(timeout=10)
    assert counts[0] == counts[1]
    records = spooled_steps(offline, f"zoo-sync-{arch.name}")
    assert all(len([v for v in r["spikes"]["attn_max_logit"] if v is not None]) == 2
               for r in records)
