"""End to end: real CPU training (fp16 autocast, GradScaler("cpu")) through the real agent
and a real server process; each test asserts the exact findings of one kind."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch
from torch import nn

from ampwatch import agent
from tests.conftest import LiveServer, agent_errors_fail, module_server
from tests.utils import WAIT


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from module_server(tmp_path_factory, "e2e")


@pytest.fixture(autouse=True)
def _agent_errors_fail_the_test() -> Iterator[None]:
    torch.set_num_threads(1)
    with agent_errors_fail():
        yield


class Amplify(nn.Module):
    """Multiplies its input by `factor` (set it to overflow fp16 on purpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, width)
        self.amp = Amplify()
        self.act = nn.ReLU()
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.amp(self.inp(x))))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen))
            for _ in range(n)]


def train(server: LiveServer, model: nn.Module, steps: int, *, scaler: bool = True,
          before_step: Callable[[int], None] = lambda i: None, clip_scaled: bool = False,
          dtype: torch.dtype = torch.float16, scheduler_every_step: bool = False,
          eval_every: int = 0, eval_autocast: bool = True, x_dim: int = 16,
          make_input: Callable[[], torch.Tensor] | None = None,
          dtype_at: Callable[[int], torch.dtype] | None = None,
          init_scale: float = 65536.0, on_agent: Callable[[agent.Attachment], None] =
          lambda attachment: None) -> str:
    """A standard AMP loop on the CPU, watched by the agent; returns the run id."""
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if scaler else None
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1000)
    attachment = agent.attach(model, grad_scaler, run=run_id, server=server.url,
                              flush_interval=0.2)
    assert attachment.enabled
    for i, (x, y) in enumerate(data(steps)):
        if make_input is not None:
            x = make_input()
        before_step(i)
        with torch.autocast("cpu", dtype=dtype_at(i) if dtype_at else dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if grad_scaler is None:
            loss.backward()
            optimizer.step()
            skipped = False
        else:
            grad_scaler.scale(loss).backward()
            if not clip_scaled:
                grad_scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            scale = grad_scaler.get_scale()
            grad_scaler.step(optimizer)
            grad_scaler.update()
            skipped = grad_scaler.get_scale() < scale
        if scheduler_every_step or not skipped:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if eval_every and (i + 1) % eval_every == 0:
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=eval_autocast):
                model(x)
            model.train()
    on_agent(attachment)
    assert attachment.detach(timeout=30)
    return run_id


def findings(server: LiveServer, run_id: str, **params) -> list[dict]:
    response = httpx.get(f"{server.url}/api/v1/runs/{run_id}/findings",
                         params={**params, **WAIT}, timeout=60)
    response.raise_for_status()
    return response.json()["items"]


def steps_of(server: LiveServer, run_id: str) -> list[dict]:
    response = httpx.get(f"{server.url}/api/v1/runs/{run_id}/steps", timeout=30)
    response.raise_for_status()
    return response.json()["items"]


def test_forward_overflow_is_the_cause_and_the_layer(server):
    model = Net()

    def overflow_from_60(i: int) -> None:
        model.amp.factor = 1e6 if i >= 60 else 1.0

    run_id = train(server, model, 100, before_step=overflow_from_60)
    divergence = findings(server, run_id, kind="scaler_divergence", status="open")
    assert divergence, findings(server, run_id)
    assert {(f["evidence"]["cause"], f["layer"]) for f in divergence} == \
        {("forward_overflow", "amp")}
    assert any(f["severity"] == "critical" for f in divergence)
    nonfinite = findings(server, run_id, kind="nonfinite")
    assert [(f["layer"], f["evidence"]["first_nonfinite_layer"], f["step"])
            for f in nonfinite] == [("amp", "amp", 60)]


def test_injected_grad_inf_skips_exactly_those_steps_and_names_the_layer(server):
    model = Net()
    injected = {70, 90, 110}
    poison = {"on": False}
    model.out.weight.register_hook(
        lambda grad: grad * float("inf") if poison["on"] else grad)

    def inject(i: int) -> None:
        poison["on"] = i in injected

    run_id = train(server, model, 130, before_step=inject)
    skipped = {s["step"] for s in steps_of(server, run_id) if s["skipped"]}
    nonfinite = findings(server, run_id, kind="nonfinite")
    calibration = {s for s in skipped if s < 20}
    assert skipped - calibration == injected
    assert [(f["layer"], f["evidence"]["cause"]) for f in nonfinite] == \
        [("out", "grad_overflow")]
    assert set(nonfinite[0]["evidence"]["steps"]) == injected


def test_misaligned_dimensions_with_padded_values(server):
    class Misaligned(nn.Module):
        """A lookup table tied to the LM head, and an odd hidden width."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50257, 64)
            self.odd = nn.Linear(64, 127)
            self.back = nn.Linear(127, 64)
            self.head = nn.Linear(64, 50257, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.back(self.odd(self.emb(idx))))[:, 0, :8]

    gen = torch.Generator().manual_seed(0)
    run_id = train(server, Misaligned(), 3,
                   make_input=lambda: torch.randint(0, 50257, (8, 4), generator=gen))
    found = findings(server, run_id, kind="misaligned_layer")
    flagged = {(f["layer"], f["evidence"]["dimension"], f["evidence"]["value"],
                f["evidence"]["padded"]) for f in found}
    # the vocabulary once, on the matmul that uses it; the lookup itself is no matmul
    assert flagged == {("head", "out_features", 50257, 50264),
                       ("odd", "out_features", 127, 128), ("back", "in_features", 127, 128)}
    head = next(f for f in found if f["layer"] == "head")
    assert head["evidence"]["tied_embedding"] == "emb" and head["severity"] == "warning"
    layers = httpx.get(f"{server.url}/api/v1/runs/{run_id}/layers", timeout=30).json()["items"]
    by_name = {layer["name"]: layer for layer in layers}
    assert by_name["head"]["attrs"]["tied_to"] == "emb"
    assert by_name["head"]["param_count"] == 0  # the tied matrix counts once, in emb
    assert by_name["emb"]["param_count"] == 50257 * 64


def test_token_count_seen_at_run_time_is_checked(server):
    class Sequence(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 64)
            self.head = nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.head(self.proj(x)).mean(dim=1)  # one row per sequence
            return out.repeat(8 // out.shape[0], 1)  # the 8 x 8 target

    gen = torch.Generator().manual_seed(0)
    aligned = train(server, Sequence(), 3,
                    make_input=lambda: torch.randn(8, 7, 16, generator=gen))  # 56 tokens
    assert findings(server, aligned, kind="misaligned_layer") == []
    odd = train(server, Sequence(), 3,
                make_input=lambda: torch.randn(4, 9, 16, generator=gen))  # 36 tokens
    flagged = {(f["layer"], f["evidence"]["dimension"], f["evidence"]["value"],
                f["evidence"]["padded"]) for f in findings(server, odd, kind="misaligned_layer")}
    assert flagged == {("proj", "token_count", 36, 40), ("head", "token_count", 36, 40)}


def test_healthy_fp16_run_ends_without_warnings(server):
    run_id = train(server, Net(), 500)
    serious = [f for f in findings(server, run_id) if f["severity"] != "info"]
    assert serious == []
    run = httpx.get(f"{server.url}/api/v1/runs/{run_id}", timeout=30).json()
    assert run["status"] == "healthy"


PITFALL_LOOPS = {
    "clip_before_unscale": {"clip_scaled": True},
    "fp16_without_scaler": {"scaler": False},
    "eval_without_autocast": {"eval_every": 10, "eval_autocast": False},
}


@pytest.mark.parametrize("code", sorted(PITFALL_LOOPS))
def test_pitfall_fires_for_the_wrong_loop_and_not_the_right_one(server, code):
    wrong = train(server, Net(), 30, **PITFALL_LOOPS[code])
    right = train(server, Net(), 30, eval_every=10)
    assert [f["code"] for f in findings(server, wrong, kind="pitfall")
            if f["code"] == code] == [code]
    assert [f for f in findings(server, right, kind="pitfall") if f["code"] == code] == []
