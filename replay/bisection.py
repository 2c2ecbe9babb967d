"""`--bisect`: the smallest set of modules whose upcast to float32 makes the step finite,
and the fix as code to paste.

The search runs the step again and again (each trial a forward and backward): first a
binary search for the shortest prefix of the forward order (modules in the order their
forward finished) whose upcast is enough, then one module at a time, dropping each that
the rest do not need. About log2(n) + k trials for n modules and a prefix of k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ampwatch.agent.fp8 import find_fp8_layers
from ampwatch.agent.layers import discover_layers
from ampwatch.replay.bundle import Bundle
from ampwatch.replay.step import StepOutcome
from ampwatch.wire.bundles import BisectVerdict

Trial = Callable[[list[str]], StepOutcome]


@dataclass
class BisectResult:
    """`modules`: the names to keep in float32 (empty when no upcast helps); `fixed`:
    whether upcasting them made the step finite; `reason`: why not, when not; `verdict`:
    the same, as the word the server reads (wire/bundles.py)."""

    modules: list[str]
    fixed: bool
    trials: int
    fp8_modules: list[str] = field(default_factory=list)
    reason: str | None = None
    verdict: BisectVerdict = BisectVerdict.FIXED


def bisect(model: nn.Module, bundle: Bundle, trial: Trial) -> BisectResult:
    """Search with `trial(names) -> StepOutcome` (the step run with `names` upcast)."""
    count = 0

    def fixes(names: list[str]) -> bool:
        nonlocal count
        count += 1
        return not trial(names).bad

    base = trial([])
    count += 1
    if not base.bad:
        return BisectResult([], False, count, reason="the step is not bad when replayed",
                            verdict=BisectVerdict.NOT_REPRODUCED)
    order = base.order
    upcast = trial(order) if order else base
    count += 1 if order else 0
    if upcast.bad:
        if bundle.meta.get("input_nonfinite"):
            why, verdict = "its input holds inf/NaN", BisectVerdict.INPUT_NONFINITE
        elif upcast.finite:
            why = (f"with every module in float32 the step is finite (loss "
                   f"{upcast.loss:.6g}); it was flagged as a loss spike (over "
                   f"{upcast.loss_limit:.6g}), not an overflow: the cause is not the "
                   "precision (the data, the weights or the learning rate)")
            verdict = BisectVerdict.NOT_PRECISION
        else:
            why = ("upcasting every module to float32 does not make it finite: the cause is "
                   "not the precision (the data, the weights or the learning rate)")
            verdict = BisectVerdict.NOT_PRECISION
        return BisectResult([], False, count, reason=f"no upcast fixes this step: {why}",
                            verdict=verdict)
    low, high = 0, len(order)  # order[:high] fixes the step, order[:low] does not
    while high - low > 1:
        middle = (low + high) // 2
        if fixes(order[:middle]):
            high = middle
        else:
            low = middle
    chosen = order[:high]
    for name in list(chosen):
        rest = [n for n in chosen if n != name]
        if rest and fixes(rest):
            chosen = rest
    layers = discover_layers(model)
    fp8 = {layers[f.index].name for f in find_fp8_layers(layers)}
    return BisectResult(chosen, True, count, fp8_modules=[n for n in chosen if n in fp8])


def fix_code(result: BisectResult, bundle: Bundle) -> str:
    """The fix as Python to paste into the training script. Nothing of the bundle goes
    into it as source: the dtype is a name from a closed set (`Bundle.autocast_dtype`),
    the device type and the module names (the model's own, which the trials ran) repr'd."""
    names = [n for n in result.modules if n not in result.fp8_modules]
    dtype = str(bundle.autocast_dtype or torch.float16).removeprefix("torch.")
    parts: list[str] = []
    if names:
        parts.append(f'''import torch

# ampwatch replay --bisect: these modules overflow in {dtype}; run them in float32
KEEP_FP32 = {names!r}


def keep_in_fp32(model: torch.nn.Module, names=KEEP_FP32, device_type={bundle.device_type!r}):
    """Run each named module with autocast disabled and its inputs in float32."""
    for name in names:
        module = model.get_submodule(name)
        forward = module.forward

        def fp32_forward(*args, _forward=forward, **kwargs):
            with torch.autocast(device_type, enabled=False):
                args = [a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                        for a in args]
                kwargs = {{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in kwargs.items()}}
                return _forward(*args, **kwargs)

        module.forward = fp32_forward


# after building the model (before torch.compile and the optimizer):
# keep_in_fp32(model)
''')
    if result.fp8_modules:
        parts.append(f'''# ampwatch replay --bisect: keep these Linear layers out of FP8 (torchao)
KEEP_HIGH_PRECISION = {result.fp8_modules!r}


def module_filter_fn(module, fqn):
    return fqn not in KEEP_HIGH_PRECISION


# convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
''')
    return "\n".join(parts)
