"""End to end, the remaining kinds: fp16 range risks, the precision map, the speed check
and the pitfall codes not covered in test_end_to_end.py, each with its correct loop.

`bf16_unsupported_device` needs a GPU of compute capability below 8.0; it cannot be
produced by CPU training, so it is covered only by the detector's unit tests.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

from ampwatch import agent
from tests.server.analysis import test_end_to_end
from tests.server.analysis.test_end_to_end import Net, data, findings, steps_of, train

# the same live server fixture and agent-error guard, by assignment (pytest finds them here)
server = test_end_to_end.server
_agent_errors_fail_the_test = test_end_to_end._agent_errors_fail_the_test


def layer_codes(server, run_id: str, kind: str) -> set[tuple]:
    return {(f["layer"], f["code"]) for f in findings(server, run_id, kind=kind)}


def pitfall_codes(server, run_id: str, code: str) -> list[dict]:
    return [f for f in findings(server, run_id, kind="pitfall") if f["code"] == code]


class Peak(nn.Module):
    """Scales its input so its largest element is `peak` (finite in fp16 up to 65504)."""

    def __init__(self, peak: float) -> None:
        super().__init__()
        self.peak = peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.peak / x.detach().abs().max())


class Calm(nn.Module):
    """Divides by `peak` again, so the layers after it stay in range."""

    def __init__(self, peak: float) -> None:
        super().__init__()
        self.peak = peak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.peak


class Peaked(nn.Module):
    def __init__(self, peak: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.peak = Peak(peak)
        self.calm = Calm(peak)
        self.out = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.calm(self.peak(self.inp(x))))


def test_overflow_risk_names_the_layer_near_fp16_max(server):
    risky = train(server, Peaked(40000.0), 30)
    flagged = findings(server, risky, kind="overflow_risk")
    assert [(f["layer"], f["step"]) for f in flagged] == [("peak", 0)]
    assert flagged[0]["evidence"]["absmax"] == pytest.approx(40000.0, rel=1e-3)  # fp16 rounding
    assert findings(server, risky, kind="nonfinite") == []
    safe = train(server, Peaked(30000.0), 30)  # just over 2x below 65504
    assert findings(server, safe, kind="overflow_risk") == []


def test_underflow_risk_for_grads_flushed_to_zero_in_fp16(server):
    low = train(server, Net(), 30, init_scale=2.0**-24)  # growth only every 2000 steps
    flagged = findings(server, low, kind="underflow_risk")
    assert {f["layer"] for f in flagged} == {"inp", "out"}
    assert all(f["evidence"]["zero_share"] >= 0.5 for f in flagged)
    # the default init_scale lifts the same grads into fp16's range
    scaled = train(server, Net(), 30)
    assert findings(server, scaled, kind="underflow_risk") == []


class Normed(nn.Module):
    """Linear, LayerNorm, Linear; `safe_norm` runs the norm in fp32, `fp32_head` runs
    the last Linear in fp32 (both by disabling autocast around them)."""

    def __init__(self, *, safe_norm: bool, fp32_head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 8)
        self.safe_norm, self.fp32_head = safe_norm, fp32_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        with torch.autocast("cpu", enabled=not self.safe_norm):
            h = self.norm(h.float() if self.safe_norm else h)
        with torch.autocast("cpu", enabled=not self.fp32_head):
            return self.out(h.float() if self.fp32_head else h)


def test_precision_map_flags_an_fp16_norm_and_an_fp32_matmul(server):
    # CPU fp16 autocast leaves LayerNorm's output in fp16
    fp16_norm = train(server, Normed(safe_norm=False), 12)
    assert layer_codes(server, fp16_norm, "precision_map") == {("norm", "fp16_sensitive")}
    fp32_head = train(server, Normed(safe_norm=True, fp32_head=True), 12)
    [finding] = findings(server, fp32_head, kind="precision_map")
    assert (finding["layer"], finding["code"], finding["severity"],
            finding["evidence"]["computed_in"], finding["evidence"]["autocast_dtype"]) == \
        ("out", "fp32_matmul", "info", "float32", "float16")
    right = train(server, Normed(safe_norm=True), 12)
    assert findings(server, right, kind="precision_map") == []


def test_speed_check_gives_the_verdict_of_its_ratio(server):
    measured = {}
    x, y = data(1)[0]

    def check(attachment: agent.Attachment) -> None:
        measured["speedup"] = attachment.check_speedup(
            x, lambda out: nn.functional.mse_loss(out.float(), y), steps=3)

    run_id = train(server, Net(), 5, on_agent=check)
    speedup = measured["speedup"]
    assert speedup is not None and speedup > 0
    expected = "stay_fp32" if speedup < 1.1 else "optional" if speedup <= 1.5 else "use_amp"
    [finding] = findings(server, run_id, kind="speed")
    assert (finding["code"], finding["severity"], finding["evidence"]["dtype"]) == \
        (expected, "info", "float16")
    assert finding["evidence"]["speedup"] == pytest.approx(speedup)


def poisoned() -> tuple[Net, dict]:
    """A Net whose `out.weight` grad turns inf while poison["on"] (GradScaler skips those)."""
    model = Net()
    poison = {"on": False}
    model.out.weight.register_hook(lambda grad: grad * float("inf") if poison["on"] else grad)
    return model, poison


def test_scheduler_on_skipped_step(server):
    injected = {12, 20}

    def run(scheduler_every_step: bool) -> str:
        model, poison = poisoned()
        return train(server, model, 30, scheduler_every_step=scheduler_every_step,
                     before_step=lambda i: poison.update(on=i in injected))

    wrong = run(scheduler_every_step=True)
    skipped = {s["step"] for s in steps_of(server, wrong) if s["skipped"]}
    assert injected <= skipped
    [finding] = pitfall_codes(server, wrong, "scheduler_on_skipped_step")
    assert set(finding["evidence"]["steps"]) == skipped
    assert finding["step"] == min(skipped)
    assert pitfall_codes(server, run(scheduler_every_step=False),
                         "scheduler_on_skipped_step") == []


def test_mixed_autocast_dtypes(server):
    wrong = train(server, Net(), 20,
                  dtype_at=lambda i: torch.bfloat16 if i >= 15 else torch.float16)
    [finding] = pitfall_codes(server, wrong, "mixed_autocast_dtypes")
    assert (finding["step"], finding["last_step"]) == (15, 19)
    assert pitfall_codes(server, train(server, Net(), 20), "mixed_autocast_dtypes") == []


def accumulate(server, *, update_every_micro_batch: bool, steps: int = 12) -> str:
    """Two micro-batches per optimizer step. The wrong loop unscales (to clip) and calls
    scaler.update() after every micro-batch; the right one once per optimizer step."""
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    attachment = agent.attach(model, scaler, run=run_id, server=server.url,
                              flush_interval=0.2)
    for i, (x, y) in enumerate(data(2 * steps)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y) / 2
        scaler.scale(loss).backward()
        last_micro_batch = i % 2 == 1
        if last_micro_batch:
            scaler.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        elif update_every_micro_batch:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        if last_micro_batch or update_every_micro_batch:
            scaler.update()
    assert attachment.detach(timeout=30)
    return run_id


def test_update_without_step(server):
    wrong = accumulate(server, update_every_micro_batch=True)
    [finding] = pitfall_codes(server, wrong, "update_without_step")
    assert finding["step"] == 1  # step 0 saw one update; each later step two
    assert pitfall_codes(server, accumulate(server, update_every_micro_batch=False),
                         "update_without_step") == []


def test_scaler_with_bf16(server):
    wrong = train(server, Net(), 10, dtype=torch.bfloat16)
    [finding] = pitfall_codes(server, wrong, "scaler_with_bf16")
    assert (finding["severity"], finding["evidence"]["autocast_dtype"]) == \
        ("info", "bfloat16")
    right = train(server, Net(), 10, dtype=torch.bfloat16, scaler=False)
    assert pitfall_codes(server, right, "scaler_with_bf16") == []
    assert pitfall_codes(server, right, "fp16_without_scaler") == []


class Large(nn.Module):
    """Over 10M parameters, nearly all in an aligned embedding table (cheap on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40960, 256)
        self.out = nn.Linear(256, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(dim=1))


def test_small_model(server):
    small = train(server, Net(), 5)
    [finding] = pitfall_codes(server, small, "small_model")
    expected = sum(p.numel() for p in Net().parameters())
    assert (finding["severity"], finding["evidence"]["param_count"]) == ("info", expected)
    gen = torch.Generator().manual_seed(0)
    large = train(server, Large(), 3,
                  make_input=lambda: torch.randint(0, 40960, (8, 4), generator=gen))
    assert pitfall_codes(server, large, "small_model") == []
