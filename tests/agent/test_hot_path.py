"""The training thread makes no host-device synchronising call on the agent's behalf:
with the agent attached it makes exactly the calls the plain loop makes (GradScaler
itself reads found_inf once per step). The worker thread may read, and does. One
exception, where the device is the host (CPU, `host_reduce`): the agent reads the loss
once per backward, a host value, to decide whether the step's forward is searched
(docs/agent.md, "Cheap by design"); with device-side reduction (what CUDA does) there is
no such read."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from tests.agent.factories import TinyGPT, batches, fp16_loop, mlp, spooled_steps

SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
           "__index__", "__repr__", "__format__")


@pytest.fixture
def sync_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts syncing Tensor calls made on the main (training) thread."""
    counts: Counter[str] = Counter()
    main = threading.main_thread()
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, __original=original, __name=name, **kwargs):
            if threading.current_thread() is main:
                counts[__name] += 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    yield counts


def _train(model, steps: int, counts: Counter[str], attach=None, **options
           ) -> tuple[dict, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    attachment = attach(model, scaler, **options) if attach else None
    data = batches(2 + steps, bad=lambda i: "inf" if i == 4 else None)
    fp16_loop(model, optimizer, scaler, data[:2], clip=1.0, scheduler=scheduler)
    counts.clear()
    fp16_loop(model, optimizer, scaler, data[2:], clip=1.0, scheduler=scheduler)
    seen = dict(counts)
    if attachment is not None:
        attachment.flush(5)
    return seen, attachment


@pytest.mark.parametrize("options", [{}, {"sample_every": 1}])
def test_attached_training_thread_adds_no_syncing_call(attach, offline, sync_calls,
                                                       options, reduction) -> None:
    plain, _ = _train(mlp(), 8, sync_calls)
    watched, attachment = _train(mlp(), 8, sync_calls, attach, **options)
    steps = spooled_steps(offline, attachment.run_id)
    assert len(steps) == 10 and steps[4]["input_nonfinite"]
    assert set(plain) == {"item"}  # GradScaler.step and AdamW's step counters on CPU
    extra = Counter(watched)
    extra.subtract(plain)
    if options:  # every step sampled: every output checked on the device, no read
        assert watched == plain
        return
    if reduction == "device":
        # the device path reads nothing on healthy steps; step 4 (its inf input) made the
        # scaler skip, after the scaler's own read of found_inf: only then the search
        # replays the forward, and reads every layer's (min, max) at once, one read
        assert steps[4]["first_nonfinite_layer"] == 0
        assert all(s["forward_nonfinite"] is None for s in steps[2:] if s["step"] != 4
                   and "activations" not in s)
        assert +extra == Counter({"tolist": 1}), extra
        return
    # host path: a read of the loss per unsampled step (2, 3, 4), and the search of
    # step 4 (its inf input makes the loss inf): a sum and a (min, max), host values
    unsampled = [s["step"] for s in steps[2:] if "activations" not in s]
    assert unsampled == [2, 3, 4] and steps[4]["first_nonfinite_layer"] == 0
    assert set(+extra) == {"item"} and 0 < extra["item"] <= len(unsampled) + 3, extra


def test_transformer_with_activations_adds_no_syncing_call(attach, sync_calls,
                                                            reduction) -> None:
    counts = []
    for use_agent in (False, True):
        torch.manual_seed(0)
        model = TinyGPT()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        if use_agent:
            attachment = attach(model, scaler, sample_every=1)
        sync_calls.clear()
        for _ in range(4):
            idx = torch.randint(0, 64, (2, 8))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx).float().logsumexp(-1).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        counts.append(dict(sync_calls))
    attachment.flush(5)
    assert counts[0] == counts[1]
