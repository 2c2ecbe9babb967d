"""gpu_check group 4: FP8. torchao Float8Linear with real FP8 casts (Hopper-class GPUs;
emulated in the smoke run), tensorwise and rowwise: the FP8 suite's scenario
(tests/agent/fp8_scenario.py) with its truth from torchao's own scale and cast. Then
Transformer Engine, when it installs from the registry in the time left."""

from __future__ import annotations

import importlib.util
import subprocess
import traceback
from typing import Any

import torch
from gpu_report import Context, pip_install

from ampwatch import agent
from tests.agent.fp8_scenario import fp8_report
from tests.agent.gpu_loops import SwallowedErrors, fp8_unavailable, sync_errors, sync_origin

REL = 1e-6  # float32 division apart, as the FP8 suite compares
TE_INSTALL_S = 150.0


class _Server:
    def __init__(self, url: str) -> None:
        self.url = url


def check_fp8(ctx: Context) -> None:
    """torchao Float8Linear, tensorwise and rowwise."""
    reason = fp8_unavailable(ctx.device)
    for recipe in ("tensorwise", "rowwise"):
        name = f"torchao {recipe} ({'emulated' if ctx.device.type != 'cuda' else 'real FP8'})"
        why = reason or (None if ctx.fits(20, 4) else "out of time")
        if why:
            ctx.report.add("fp8", name, "skip", why)
            continue
        try:
            _torchao(ctx, recipe, name)
        except Exception as exc:  # noqa: BLE001
            ctx.report.add("fp8", name, "fail", f"{type(exc).__name__}: {exc}"[:300],
                           traceback=traceback.format_exc()[-2000:])


def check_transformer_engine(ctx: Context, install: bool) -> None:
    """Run last but the pages: installing it may take what time is left."""
    try:
        _transformer_engine(ctx, install)
    except Exception as exc:  # noqa: BLE001
        ctx.report.add("fp8", "Transformer Engine", "fail", f"{type(exc).__name__}: {exc}"[:300],
                       traceback=traceback.format_exc()[-2000:])


def _torchao(ctx: Context, recipe: str, name: str) -> None:
    from tests.agent.fp8_scenario import (
        FAULT_STEP,
        fp8_report,
        observed_shares,
        severe_findings,
        train,
    )

    server = _Server(ctx.server)
    with SwallowedErrors() as swallowed:
        run, truth = train(server, recipe, outlier_from=FAULT_STEP, device=ctx.device)
    ctx.runs[f"fp8 {recipe}"] = run
    report = fp8_report(server, run)
    mismatched: list[Any] = []
    shares = observed_shares(report, "underflow")
    for key, share in shares.items():
        if abs(share - truth.seen[key]["underflow"]) > REL * max(abs(share), 1e-3):
            mismatched.append(("underflow", key, share, truth.seen[key]["underflow"]))
    latest = 0
    for layer in report["layers"]:
        for role, values in layer["latest"].items():
            seen = truth.seen[(values["step"], layer["name"], role)]
            latest += 1
            for stat in ("amax", "scale"):
                if abs(values[stat] - seen[stat]) > REL * abs(seen[stat]):
                    mismatched.append((stat, layer["name"], role, values[stat], seen[stat]))
    status = "fail" if mismatched or swallowed.errors else "pass"
    ctx.report.add("fp8", f"{name}: amax, scale, underflow", status,
                   f"{len(shares)} underflow shares, {latest} latest amax/scale pairs; "
                   f"{len(mismatched)} differ from torchao's cast", f"relative {REL:g}",
                   mismatched=mismatched[:20], errors=swallowed.errors[:20])
    if recipe == "tensorwise":
        fc1 = truth.seen[(FAULT_STEP, "fc1", "input")]["underflow"]
        found = ("fp8_underflow", "fc1", FAULT_STEP, "input") in severe_findings(server, run)
        ctx.report.add("fp8", "outlier scenario (tensorwise)",
                       "pass" if fc1 > 0.9 and found else "fail",
                       f"fc1 input flushed {fc1:.1%} at step {FAULT_STEP}; finding "
                       f"{'raised' if found else 'missing'}", "> 90% flushed, one finding")


def _ensure_transformer_engine(ctx: Context, install: bool) -> str | None:
    """None when `transformer_engine.pytorch` imports, else why not (after one bounded
    attempt to install it from the registry: binary wheels only, a source build takes
    far longer than the check has)."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return None
    if not install:
        return "not installed (installs are off)"
    seconds = min(TE_INSTALL_S, ctx.budget.left() - 60)
    if seconds < 30:
        return "not installed: no time left to try"
    command = [*pip_install(ctx.report.out), "--only-binary=:all:", "transformer_engine[pytorch]"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return f"pip did not install it within {seconds:.0f} s"
    if done.returncode != 0:
        last = [x for x in done.stderr.splitlines() if x.strip()][-1:] or ["?"]
        return f"pip could not install it from the registry: {last[0][:200]}"
    importlib.invalidate_caches()
    return None


def _transformer_engine(ctx: Context, install: bool) -> None:
    name = "Transformer Engine (delayed scaling)"
    if ctx.device.type != "cuda":
        ctx.report.add("fp8", name, "skip", "needs a CUDA GPU")
        return
    why = _ensure_transformer_engine(ctx, install)
    ctx.report.note("transformer_engine", why or "available")
    if why:
        ctx.report.add("fp8", name, "skip", why)
        return
    import transformer_engine.pytorch as te
    from torch import nn
    from transformer_engine.common.recipe import DelayedScaling, Format

    device = ctx.device
    torch.manual_seed(0)
    model = nn.Sequential(te.Linear(64, 128), nn.ReLU(), te.Linear(128, 16)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    scales: dict[int, torch.Tensor] = {}  # step -> the input scale TE casts with (device)
    step = 0

    def truth(module: nn.Module, args: tuple) -> None:
        meta = module.fp8_meta.get("scaling_fwd")
        if meta is not None:
            scales[step] = meta.scale[0].clone()

    model[0].register_forward_pre_hook(truth)
    watch = agent.attach(model, server=ctx.server, name="gpu-check-te", sample_every=5,
                         sample_after_anomaly=0)
    ctx.runs["fp8 transformer engine"] = watch.run_id
    raised: list[str] = []
    with SwallowedErrors() as swallowed:
        for step in range(12):
            x, y = torch.randn(32, 64, device=device), torch.randn(32, 16, device=device)
            try:
                with sync_errors(device):
                    with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                        loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            except RuntimeError as exc:
                origin = sync_origin(exc)
                if origin is None:
                    raise
                raised.append(f"step {step}: {origin}")
                break  # TE's own sync, or the agent's: the row says which
        watch.flush(60)
    watch.detach()
    report = fp8_report(_Server(ctx.server), watch.run_id)
    layer = next((x for x in report["layers"] if x["name"] == "0"), None)
    latest = (layer or {}).get("latest", {}).get("input")
    truth_scale = (float(scales[latest["step"]]) if latest and latest["step"] in scales
                   else None)
    scale_ok = latest is not None and truth_scale is not None and abs(
        latest["scale"] - truth_scale) <= REL * abs(truth_scale)
    ok = (layer is not None and layer["recipe"] == "delayed (amax history 16)" and scale_ok
          and not swallowed.errors and not raised)
    ctx.report.add("fp8", name, "pass" if ok else "fail",
                   f"layer 0 recorded as {(layer or {}).get('recipe')!r}; input scale "
                   f"{latest and latest['scale']} against TE's {truth_scale}; "
                   f"{len(swallowed.syncs)} agent syncs swallowed, {len(raised)} raised",
                   "delayed (amax history 16), TE's scale, 0 syncs",
                   errors=swallowed.errors[:20], raised=raised)
