"""The ground-truth fault suite: real CPU training with a known fault, watched by the real
agent and judged by a real server. Each scenario's truth comes from the test's own
forward hooks, its own checks of the grads and the weights and the optimizer's own step
hook, never from the agent; `expected()` turns that truth into the findings the analysis
must raise (docs/diagnosis.md states the rules), and nothing else at warning or critical.

Used by tests/diagnosis/test_fault_suite.py and bench/diagnosis_table.py.
"""

from __future__ import annotations

import math
import statistics
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from torch import nn
from torch.amp import custom_bwd, custom_fwd
from torch.utils.checkpoint import checkpoint

from ampwatch import agent
from tests.utils import WAIT

SAMPLE_EVERY = 10  # the agent's default
ZERO_SHARE = 0.5  # the server's default underflow_zero_share


# ----------------------------------------------------------------------------- models
class Scale(nn.Module):
    """Multiplies its input by `factor`: 1 normally, set by a scenario."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Mlp(nn.Module):
    """fc1 -> act1 -> fc2 -> act2 -> fc3, with an optional gain stage after fc2."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.gain = Scale()
        self.calm = Scale()
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 8)
        self.checkpointed = checkpointed

    def middle(self, h: torch.Tensor) -> torch.Tensor:
        return self.act2(self.calm(self.gain(self.fc2(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.fc1(x))
        h = checkpoint(self.middle, h, use_reentrant=False) if self.checkpointed else \
            self.middle(h)
        return self.fc3(h)


class _Boost(torch.autograd.Function):
    """A custom op that computes in fp32 whatever autocast says (custom_fwd)."""

    @staticmethod
    @custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x * factor

    @staticmethod
    @custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Boost(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Boost.apply(x, self.factor)


class CustomMlp(Mlp):
    """fc1 -> act1 -> boost (custom fp32 Function) -> fc3."""

    def __init__(self) -> None:
        super().__init__()
        self.boost = Boost()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.boost(self.act1(self.fc1(x))))


# ----------------------------------------------------------------------------- truth
@dataclass
class StepTruth:
    input_bad: bool = False
    first_bad_layer: str | None = None
    loss_bad: bool = False
    grad_bad_layers: list[str] = field(default_factory=list)  # in forward order
    skipped: bool = False
    weights_bad: bool = False
    scale_after: float | None = None  # the scaler's own scale after update()
    zero_share: dict[str, float] = field(default_factory=dict)
    fp16_absmax: dict[str, float] = field(default_factory=dict)  # finite fp16 outputs
    absmax: float = 0.0  # the largest finite output of any layer, any dtype
    grad_norm: float | None = None  # L2 norm of every grad before the optimizer step
    # each layer's own parameters' norm as the step's first forward began
    weight_norm: dict[str, float] = field(default_factory=dict)


class Recorder:
    """The test's own view of each step: forward hooks on every layer (a module that
    owns parameters or has no children), the grads before the optimizer step, the
    weights after it, and whether the optimizer stepped (its own step hook)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.layers = {name or "model": m for name, m in model.named_modules()
                       if list(m.parameters(recurse=False)) or next(m.children(), None) is None}
        self.order: list[str] = []
        self.steps: list[StepTruth] = []
        self.current = StepTruth()
        self.in_forward = False
        self.stepped = False
        self.handles = [m.register_forward_hook(self._hook(name))
                        for name, m in self.layers.items()]
        self.handles.append(optimizer.register_step_post_hook(self._optimizer_stepped))

    def _hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self.in_forward or not isinstance(output, torch.Tensor):
                return
            output = output.detach()  # no graph (checkpointing counts saved tensors)
            if name not in self.order:
                self.order.append(name)
            finite = bool(output.isfinite().all())
            if self.current.first_bad_layer is None and not finite:
                self.current.first_bad_layer = name
            if finite and output.is_floating_point() and output.numel():
                self.current.absmax = max(self.current.absmax, float(output.abs().max()))
            if finite and output.dtype == torch.float16 and output.numel():
                peak = float(output.abs().max())
                self.current.fp16_absmax[name] = max(peak, self.current.fp16_absmax.get(name, 0))
        return hook

    def _optimizer_stepped(self, *args: Any) -> None:
        self.stepped = True

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.current.input_bad |= not bool(x.isfinite().all())
        if not self.current.weight_norm:
            for name, module in self.layers.items():
                own = [p.detach().double().flatten() for p in module.parameters(recurse=False)]
                if own:
                    self.current.weight_norm[name] = float(torch.linalg.vector_norm(
                        torch.cat(own)))
        self.in_forward = True
        try:
            return model(x)
        finally:
            self.in_forward = False

    def loss(self, loss: torch.Tensor) -> None:
        self.current.loss_bad |= not math.isfinite(float(loss.detach()))

    def grads(self, sampled: bool) -> None:
        """Before the optimizer step (grads unscaled, or scaled: finiteness is the same)."""
        every = [p.grad.float() for m in self.layers.values()
                 for p in m.parameters(recurse=False) if p.grad is not None]
        if every:
            self.current.grad_norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in every])))
        for name, module in self.layers.items():
            grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            if not grads:
                continue
            if not all(bool(g.isfinite().all()) for g in grads):
                self.current.grad_bad_layers.append(name)
            if sampled:
                self.current.zero_share[name] = (sum(int((g == 0).sum()) for g in grads)
                                                 / sum(g.numel() for g in grads))
        self.stepped = False

    def end_step(self, model: nn.Module) -> None:
        self.current.skipped = not self.stepped
        self.current.weights_bad = not all(bool(p.isfinite().all()) for p in model.parameters())
        self.current.grad_bad_layers.sort(key=lambda n: self.order.index(n)
                                          if n in self.order else len(self.order))
        self.steps.append(self.current)
        self.current = StepTruth()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# ----------------------------------------------------------------------------- scenarios
Expected = tuple[str, str | None, int, str]  # (kind or pitfall:code, layer, step, severity)


@dataclass
class Scenario:
    name: str
    fault: str  # what is wrong, in words
    steps: int = 40
    dtype: torch.dtype = torch.float16
    scaler: dict[str, Any] | None = field(default_factory=dict)  # GradScaler kwargs; None: none
    lr: float = 1e-2
    model: Callable[[], nn.Module] = Mlp
    inject: Callable[[int, nn.Module, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor]] | None = None
    grad_fault: Callable[[int], bool] | None = None  # inf into fc2's weight grad at these
    accumulate: int = 1
    clip_before_unscale: bool = False
    scheduler_every_step: bool = False
    stop_after_skips: int | None = None  # end the run after this many skipped steps
    pitfalls: tuple[str, ...] = ()  # loop pitfalls the loop commits from its first step
    infos: tuple[tuple[str, str | None], ...] = ()  # (kind or pitfall:code, layer) expected
    # "every_step": an overflow a later op absorbs (the loss stays finite) is seen only by
    # checking every output of every step (docs/agent.md, "Cheap by design")
    check_outputs: str = "flagged"


def _batches(n: int, accumulate: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen) * 0.1)
             for _ in range(accumulate)] for _ in range(n)]


def train(scenario: Scenario, server: str) -> tuple[str, Recorder]:
    """Run the scenario's loop under the agent; returns the run id and the truth."""
    torch.manual_seed(0)
    model = scenario.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=scenario.lr)
    scaler = (None if scenario.scaler is None
              else torch.amp.GradScaler("cpu", **scenario.scaler))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1000)
    run_id = f"fault-{scenario.name}-{uuid.uuid4().hex[:6]}"
    truth = Recorder(model, optimizer)
    poison = {"on": False}
    model.fc2.weight.register_hook(lambda g: g * math.inf if poison["on"] else g)
    attachment = agent.attach(model, scaler, run=run_id, server=server, flush_interval=0.2,
                              check_outputs=scenario.check_outputs)
    assert attachment.enabled
    skips = 0
    for i, micro in enumerate(_batches(scenario.steps, scenario.accumulate)):
        poison["on"] = bool(scenario.grad_fault and scenario.grad_fault(i))
        for k, (x, y) in enumerate(micro):
            if scenario.inject is not None and k == len(micro) // 2:
                x, y = scenario.inject(i, model, x.clone(), y.clone())
            with torch.autocast("cpu", dtype=scenario.dtype):
                out = truth.forward(model, x)
            loss = nn.functional.mse_loss(out.float(), y) / scenario.accumulate
            truth.loss(loss)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            if scenario.clip_before_unscale:
                nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            else:
                scaler.unscale_(optimizer)
            truth.grads(sampled=i % SAMPLE_EVERY == 0)
            scaler.step(optimizer)
            scaler.update()
            truth.current.scale_after = scaler.get_scale()
        else:
            truth.grads(sampled=i % SAMPLE_EVERY == 0)
            optimizer.step()
        truth.end_step(model)
        if scenario.scheduler_every_step or not truth.steps[-1].skipped:
            with warnings.catch_warnings():  # torch's own warning about this very pitfall
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step",
                                        UserWarning)
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        skips += truth.steps[-1].skipped
        if scenario.stop_after_skips is not None and skips >= scenario.stop_after_skips:
            break
    truth.close()
    assert attachment.detach(timeout=30)
    return run_id, truth


# ----------------------------------------------------------------------------- rules
FORWARD, ABSORBED, INPUT, LOSS, GRAD = ("forward_overflow", "absorbed_overflow",
                                        "nonfinite_input", "nonfinite_loss", "grad_overflow")
DIVERGENCE = "divergence"
DIVERGENCE_GROWTH = 1e4  # the server's default divergence_growth
OVERFLOW_FACTOR = 2.0  # the server's default overflow_factor
DTYPE_MAX = {torch.float16: 65504.0, torch.bfloat16: float(torch.finfo(torch.bfloat16).max)}


def calibration_end(truth: Recorder, clean: int = 10) -> int:
    """The scaler's initial calibration: until the first run of `clean` unskipped steps."""
    run = 0
    for i, step in enumerate(truth.steps):
        run = 0 if step.skipped else run + 1
        if run == clean:
            return i - clean + 1
    return len(truth.steps)


def expected(scenario: Scenario, truth: Recorder) -> set[Expected]:
    """The warning and critical findings the truth calls for (docs/diagnosis.md)."""
    found: dict[tuple[str, str | None], list[tuple[int, bool]]] = {}
    calibration = calibration_end(truth) if scenario.scaler is not None else 0
    for i, step in enumerate(truth.steps):
        grads_bad = bool(step.grad_bad_layers)
        if step.input_bad:
            group = (INPUT, None)
        elif step.first_bad_layer is not None:
            absorbed = not step.skipped and not grads_bad and not step.loss_bad
            group = (ABSORBED if absorbed else FORWARD, step.first_bad_layer)
        elif step.loss_bad:
            group = (LOSS, None)
        elif grads_bad:
            if step.skipped and i < calibration:
                continue  # how a GradScaler finds its scale
            group = (GRAD, step.grad_bad_layers[-1])  # backward runs in reverse
        else:
            continue
        applied_bad = not step.skipped and grads_bad
        found.setdefault(group, []).append((i, applied_bad))
    first = min((i for hits in found.values() for i, _ in hits), default=None)
    if first is not None and _diverged(scenario, truth, first):
        # the gradients ran away first: every later inf/NaN (but a bad input) is theirs
        runaway = [hit for group, hits in found.items() if group[0] != INPUT for hit in hits]
        found = {group: hits for group, hits in found.items() if group[0] == INPUT}
        if runaway:
            found[(DIVERGENCE, None)] = sorted(runaway)
    out: set[Expected] = set()
    for (cause, layer), hits in found.items():
        if any(bad for _, bad in hits):
            severity = "critical"
        elif cause == GRAD:
            continue  # skipped gradient overflows: info
        else:
            severity = "warning"
        out.add(("nonfinite", layer, hits[0][0], severity))
    out |= _underflow(scenario, truth)
    collapsed = [i for i, s in enumerate(truth.steps)
                 if s.scale_after is not None and s.scale_after <= 1.0]
    if collapsed:  # fp16 can hold no gradient: training has stopped
        out.add(("scaler_divergence", None, collapsed[0], "critical"))
    out |= {(f"pitfall:{code}", None, 0, "warning") for code in scenario.pitfalls}
    return out | _scheduler(scenario, truth) | _overflow_risk(scenario, truth)


def _diverged(scenario: Scenario, truth: Recorder, first: int) -> bool:
    """Divergence before step `first` (the first with inf/NaN): the last grad norms
    before it grew DIVERGENCE_GROWTH times past the typical one of the steps before,
    while no output on a sampled step came within OVERFLOW_FACTOR of the dtype's max."""
    norms = [s.grad_norm for s in truth.steps[:first]
             if s.grad_norm is not None and math.isfinite(s.grad_norm) and s.grad_norm > 0]
    if len(norms) < 3:
        return False
    typical = statistics.median(norms[: len(norms) // 2 + 1])
    if max(norms[-3:]) < DIVERGENCE_GROWTH * typical:
        return False
    limit = DTYPE_MAX[scenario.dtype] / OVERFLOW_FACTOR
    return all(s.absmax < limit for i, s in enumerate(truth.steps[:first])
               if i % SAMPLE_EVERY == 0)


def _underflow(scenario: Scenario, truth: Recorder) -> set[Expected]:
    """fp16: a layer whose grads are mostly exact zeros on most measured steps."""
    if scenario.dtype != torch.float16:
        return set()
    out = set()
    measured = [(i, s) for i, s in enumerate(truth.steps) if s.zero_share and not s.skipped]
    for name in truth.layers:
        shares = [(i, s.zero_share[name]) for i, s in measured if name in s.zero_share]
        high = [i for i, share in shares if share >= ZERO_SHARE]
        if shares and len(high) / len(shares) > 0.5:
            out.add(("underflow_risk", name, high[0], "warning"))
    return out


def _scheduler(scenario: Scenario, truth: Recorder) -> set[Expected]:
    """A scheduler step after a skipped step puts the schedule one step ahead: warning
    when it leads by 5% of the optimizer's steps or more."""
    if not scenario.scheduler_every_step or scenario.scaler is None:
        return set()
    ahead = [i for i, s in enumerate(truth.steps[:-1]) if s.skipped]
    applied = sum(not s.skipped for s in truth.steps)
    if ahead and len(ahead) / max(applied, 1) >= 0.05:
        return {("pitfall:scheduler_on_skipped_step", None, ahead[0], "warning")}
    return set()


def _overflow_risk(scenario: Scenario, truth: Recorder) -> set[Expected]:
    """A finite fp16 output within 2x of 65504 on a step the agent samples (every 10th,
    and every step for 20 after a skipped one)."""
    out: dict[str, int] = {}
    after_skip = -1
    for i, step in enumerate(truth.steps):
        if i % SAMPLE_EVERY == 0 or i <= after_skip:
            for name, peak in step.fp16_absmax.items():
                if peak >= 65504 / 2 and name not in out:
                    out[name] = i
        if step.skipped:
            after_skip = i + 20
    return {("overflow_risk", name, i, "warning") for name, i in out.items()}


WEIGHT_JUMP = 100.0  # the server's default weight_jump_factor


def weight_jump_holds(truth: Recorder, finding: dict) -> bool:
    """Whether the test's own weight norms show the jump a weight_jump finding names: its
    layer's norm at the finding's step `WEIGHT_JUMP` x (or under) the norm at the sample
    before it. The agent samples through the anomaly window too, so which steps the jump
    falls between is the finding's to say; that it is there is the truth's."""
    evidence = finding["evidence"]
    norms = [step.weight_norm.get(finding["layer"]) for step in truth.steps]
    before, after = norms[evidence["before_step"]], norms[evidence["jump_step"]]
    if not before or not after:
        return False
    return after / before >= WEIGHT_JUMP or after / before <= 1 / WEIGHT_JUMP


def observed(server: str, run_id: str) -> tuple[set[Expected], list[dict]]:
    response = httpx.get(f"{server}/api/v1/runs/{run_id}/findings", params=WAIT, timeout=60)
    response.raise_for_status()
    items = response.json()["items"]
    serious = {(f["kind"] if f["kind"] != "pitfall" else f"pitfall:{f['code']}", f["layer"],
                f["step"], f["severity"]) for f in items if f["severity"] != "info"}
    return serious, items


def _weights(layer: str, factor: float, at: Callable[[int], bool], undo: bool = True
             ) -> Callable:
    """Multiply `layer`'s weight by `factor` before the steps where `at` holds (and back
    after, when `undo`)."""
    state = {"on": False}

    def inject(i: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        weight = getattr(model, layer).weight
        with torch.no_grad():
            if at(i) and not state["on"]:
                weight.mul_(factor)
                state["on"] = True
            elif not at(i) and state["on"] and undo:
                weight.div_(factor)
                state["on"] = False
        return x, y
    return inject


def _input(at: int, value: float | None = None, times: float = 1.0,
           labels: bool = False) -> Callable:
    def inject(i: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        if i == at:
            target = y if labels else x
            if value is not None:
                target[0, 0] = value
            target.mul_(times)
        return x, y
    return inject


def _set(attribute: str, value: Callable[[int], float]) -> Callable:
    def inject(i: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
        module_name, name = attribute.split(".")
        setattr(getattr(model, module_name), name, value(i))
        return x, y
    return inject


def _growing(i: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.gain.factor = 1e4 * 1.06 ** i  # fc2's output, amplified, creeps up to 65504
    model.calm.factor = 1 / model.gain.factor  # and brought back, so grads stay sane
    return x, y


def growing_until_absorbed(i: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """gain's output grows 8% a step; fc2's bias, lowered a little at the start, makes its
    most negative outputs overflow first (to -inf, which act2, a ReLU, absorbs) a few
    steps before its positive ones carry inf on to the loss."""
    if i == 0:
        with torch.no_grad():
            model.fc2.bias -= 0.1
    model.gain.factor = 1e3 * 1.08 ** i
    model.calm.factor = 1 / model.gain.factor
    return x, y


def _absorbed(i: int, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    if i == 11:  # one fc1 unit's bias overflows fp16 to -inf; act1 (ReLU) zeroes it
        with torch.no_grad():
            model.fc1.bias[3] = -1e6
    return x, y


FIXED_TINY_SCALE = {"init_scale": 2.0**-24, "growth_interval": 10**6}
PROBING = {"init_scale": 2.0**22, "growth_interval": 40}
EAGER = {"init_scale": 2.0**20, "growth_interval": 2}

SCENARIOS = [
    Scenario("forward_overflow_between_samples",
             "fc2's weights x1e6 for steps 13-14 (between the samples at 10 and 20)",
             inject=_weights("fc2", 1e6, lambda i: i in (13, 14))),
    Scenario("one_step_spike", "one batch x3e4 at step 27: fc1's fp16 output overflows",
             inject=_input(27, times=3e4)),
    Scenario("nan_in_input", "a NaN in the input batch of step 15",
             inject=_input(15, value=math.nan)),
    Scenario("nan_in_labels", "a NaN in the labels of step 22: only the loss is NaN",
             inject=_input(22, value=math.nan, labels=True)),
    Scenario("inf_in_one_layers_grads", "inf injected into fc2's weight grad at steps 17, 31",
             grad_fault=lambda i: i in (17, 31), infos=(("nonfinite", "fc2"),)),
    Scenario("overflow_absorbed_by_relu",
             "from step 11 one fc1 unit's output is -inf in fp16; the ReLU after it zeroes it",
             inject=_absorbed, check_outputs="every_step"),
    Scenario("slowly_growing_layer", "gain's output grows 6% a step until fp16 overflows",
             inject=_growing, stop_after_skips=2, steps=60),
    Scenario("bf16_high_lr_divergence", "bf16 without a scaler, SGD at lr 30: diverges",
             dtype=torch.bfloat16, scaler=None, lr=30.0),
    Scenario("fp16_underflow_tiny_fixed_scale", "GradScaler fixed at 2^-24: grads flush to 0",
             scaler=FIXED_TINY_SCALE),
    Scenario("clip_before_unscale", "clip_grad_norm_ on scaled grads, no unscale_",
             clip_before_unscale=True, pitfalls=("clip_before_unscale",)),
    Scenario("scheduler_on_skipped_steps",
             "a GradScaler growing every 2 steps skips often; the scheduler steps anyway",
             scaler=EAGER, scheduler_every_step=True),
    Scenario("fp16_without_scaler", "fp16 autocast, plain backward and step",
             scaler=None, pitfalls=("fp16_without_scaler",)),
    Scenario("bf16_with_scaler", "bf16 with a GradScaler (harmless, unneeded)",
             dtype=torch.bfloat16, infos=(("pitfall:scaler_with_bf16", None),)),
    Scenario("gradient_accumulation", "4 micro-batches a step; a NaN input in step 9's",
             accumulate=4, inject=_input(9, value=math.nan)),
    Scenario("gradient_checkpointing",
             "fc2 inside torch.utils.checkpoint, its weights x1e6 at step 14",
             model=lambda: Mlp(checkpointed=True),
             inject=_weights("fc2", 1e6, lambda i: i == 14)),
    Scenario("custom_autograd_function",
             "a custom_fwd(fp32) op x1e6 at step 18: finite in fp32, fc3 overflows fp16",
             model=CustomMlp, inject=_set("boost.factor", lambda i: 1e6 if i == 18 else 1.0)),
    Scenario("healthy_probing_scaler",
             "healthy fp16; the scaler probes upward (a skip per growth interval) and the "
             "scheduler steps every step", scaler=PROBING, scheduler_every_step=True,
             steps=200),
    Scenario("healthy_fp16", "healthy fp16 with a GradScaler"),
    Scenario("healthy_bf16", "healthy bf16 without a scaler", dtype=torch.bfloat16,
             scaler=None),
]
