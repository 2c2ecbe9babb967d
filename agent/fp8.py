"""FP8 layers: how to recognise them and what their casts do to a tensor.

Two families are known, by duck typing (neither torchao nor Transformer Engine is
imported): torchao's `Float8Linear` (`convert_to_float8_training`), whose casts scale each
tensor dynamically from its own abs-max (tensorwise, or per row/axis), and Transformer
Engine's modules (`te.Linear`, `te.LayerNormLinear`, `te.TransformerLayer`'s linears), whose
default recipe scales with a scale derived from an amax *history* (delayed scaling).

`cast_stats` measures, on the device and without synchronising, what casting a tensor to
an FP8 format with a given scale does: the share of elements that saturate (clipped at the
format's maximum) and that flush to zero, plus the abs-max, the scale and the RMS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampwatch.wire import FP8_ROLES, FP8_STATS

ROLES, STATS = FP8_ROLES, FP8_STATS
N_STATS = len(STATS)
EPS = 1e-12  # torchao's floor on an amax before it becomes a scale

FORMAT_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2",
                "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2fnuz": "e5m2fnuz"}


@dataclass(frozen=True)
class CastSpec:
    """How one tensor role of an FP8 layer is cast.

    dtype: the FP8 format; dim: the axis reduced for a per-row scale (None: one scale for
    the tensor); pow2: scales rounded down to a power of two (torchao's rowwise recipe).
    Under delayed scaling the scale is read from the module (`scale_of`) instead.
    """

    dtype: torch.dtype
    dim: int | None = None
    pow2: bool = False

    @property
    def format(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        return FORMAT_NAMES.get(name, name)


def _thresholds(dtype: torch.dtype) -> tuple[float, float, float]:
    """(max, saturation threshold, flush threshold) of an FP8 format.

    A scaled value saturates when it would round past the format's maximum (beyond half
    an ulp of the top binade), and flushes to zero at or below half the smallest
    subnormal (round-half-to-even sends the exact half to zero).
    """
    info = torch.finfo(dtype)
    top_ulp = info.eps * 2.0 ** math.floor(math.log2(info.max))
    smallest_subnormal = info.smallest_normal * info.eps
    return info.max, info.max + top_ulp / 2, smallest_subnormal / 2


def cast_stats(tensor: torch.Tensor, spec: CastSpec,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    """[amax, scale, rms, saturated share, underflow share] of casting `tensor` to
    `spec.dtype`, as a float32 tensor of 5 on the tensor's device.

    With `scale` None the scale is computed as torchao computes it (max / amax, per row
    along `spec.dim`); nothing can saturate then (the largest value scales to the format's
    maximum or below), so that share is 0 without a pass. A given scale (delayed scaling)
    is used as is. The scaled values are the float32 products torchao's cast rounds, so
    the shares equal what the cast does. About eight passes over the tensor and about
    three float32 copies of it in temporaries (sampled steps only); does not synchronise
    the device.
    """
    fmax, saturates, flushes = _thresholds(spec.dtype)
    magnitude = tensor.detach().to(torch.float32).abs()
    n = max(magnitude.numel(), 1)
    amax = magnitude.amax()
    given = scale is not None
    if scale is None:
        row_amax = amax if spec.dim is None else magnitude.amax(dim=spec.dim, keepdim=True)
        scale = (fmax / row_amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
        if spec.pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = magnitude * scale
    saturated = ((scaled > saturates).sum().div(n).to(torch.float32) if given
                 else torch.zeros((), dtype=torch.float32, device=tensor.device))
    return torch.stack([
        amax,
        scale.amin().to(torch.float32),
        torch.linalg.vector_norm(magnitude).div(math.sqrt(n)),
        saturated,
        ((scaled <= flushes) & (magnitude > 0)).sum().div(n).to(torch.float32),
    ])


@dataclass
class Fp8Layer:
    """An FP8 module of the layer table and how each of its tensors is cast."""

    index: int  # in the run's layer table
    module: nn.Module
    recipe: str
    specs: dict[str, CastSpec]  # role -> spec; a role cast in high precision is absent
    delayed: bool = False  # scales come from the module's amax history (Transformer Engine)

    def scale_of(self, role: str) -> torch.Tensor | None:
        """The scale a delayed-scaling module will cast `role` with (a device tensor)."""
        return _te_scale(self.module, role) if self.delayed else None

    def casting(self) -> bool:
        """Whether the module casts to FP8 now: a torchao layer always; a Transformer
        Engine module once a forward ran under `fp8_autocast` (TE sets `module.fp8` and
        creates its scaling state then), so a TE model trained in bf16 is no FP8 layer."""
        if not self.delayed:
            return True
        meta = getattr(self.module, "fp8_meta", None)
        return bool(getattr(self.module, "fp8", False)) and isinstance(meta, dict) and (
            "scaling_fwd" in meta)

    def read_recipe(self) -> None:
        """Transformer Engine: the formats and history length of the recipe in use (the
        one given to `fp8_autocast`, known once the module casts)."""
        if self.delayed:
            self.recipe, self.specs = _te_recipe(self.module)

    def attrs(self) -> dict[str, Any]:
        """What the layer table says of this layer (`fp8_*` attrs, docs/wire-format.md)."""
        out: dict[str, Any] = {"fp8_recipe": self.recipe}
        for role, spec in self.specs.items():
            out[f"fp8_{role}_format"] = spec.format
        return out


def _torchao_layer(index: int, module: nn.Module) -> Fp8Layer | None:
    config = getattr(module, "config", None)
    if type(module).__name__ != "Float8Linear" or config is None:
        return None
    casts = {"input": config.cast_config_input, "weight": config.cast_config_weight,
             "grad": config.cast_config_grad_output}
    # the axis each role's per-row scale reduces over, as float8_linear.py chooses it
    # (the weight is cast transposed, so its axis 0 is in_features)
    axes = {"input": -1, "weight": 0, "grad": -1}
    specs = {}
    granularities = set()
    for role, cast in casts.items():
        if getattr(cast.scaling_type, "value", "") != "dynamic":
            continue
        granularity = getattr(cast.scaling_granularity, "value", "tensorwise")
        granularities.add(granularity)
        specs[role] = CastSpec(cast.target_dtype,
                               axes[role] if granularity == "axiswise" else None,
                               bool(config.round_scales_to_power_of_2))
    if not specs:
        return None
    if granularities == {"tensorwise"}:
        recipe = "tensorwise"
    elif granularities == {"axiswise"}:
        recipe = "rowwise" if config.round_scales_to_power_of_2 else "axiswise"
    else:
        recipe = "mixed (" + "/".join(sorted(granularities)) + ")"
    return Fp8Layer(index, module, f"dynamic {recipe}", specs)


# Transformer Engine: FP8TensorMeta rows of the forward (input, weight) and backward
# (grad output) scaling states (transformer_engine.pytorch.constants: GEMM1_INPUT = 0,
# GEMM1_WEIGHT = 1, GRAD_OUTPUT1 = 0)
_TE_META = {"input": ("scaling_fwd", 0), "weight": ("scaling_fwd", 1),
            "grad": ("scaling_bwd", 0)}


def _te_scale(module: nn.Module, role: str) -> torch.Tensor | None:
    key, row = _TE_META[role]
    meta = getattr(module, "fp8_meta", {}).get(key)
    return None if meta is None else meta.scale[row]


# the Transformer Engine modules whose GEMM inputs are the module's own input and weight
# (te.TransformerLayer is made of these); LayerNorm* cast the normalised input, which
# the module's input is not: their input role is not measured
_TE_LINEARS = ("Linear", "LayerNormLinear", "LayerNormMLP")


def _te_layer(index: int, module: nn.Module) -> Fp8Layer | None:
    """A Transformer Engine linear (it has `fp8_meta`); whether it casts is known only at
    run time (`Fp8Layer.casting`). Checked on a GPU only: TE needs CUDA (docs/fp8.md)."""
    if (not isinstance(getattr(module, "fp8_meta", None), dict)
            or type(module).__name__ not in _TE_LINEARS
            or not type(module).__module__.startswith("transformer_engine")):
        return None
    recipe, specs = _te_recipe(module)
    return Fp8Layer(index, module, recipe, specs, delayed=True)


def _te_recipe(module: nn.Module) -> tuple[str, dict[str, CastSpec]]:
    """The recipe name and casts of a TE module's `fp8_meta["recipe"]`: HYBRID (the
    default) is E4M3 forward and E5M2 backward."""
    recipe = module.fp8_meta.get("recipe")
    fmt = str(getattr(getattr(recipe, "fp8_format", None), "name", "HYBRID"))
    forward = torch.float8_e5m2 if fmt == "E5M2" else torch.float8_e4m3fn
    backward = torch.float8_e4m3fn if fmt == "E4M3" else torch.float8_e5m2
    history = getattr(recipe, "amax_history_len", None)
    name = "delayed" + (f" (amax history {history})" if history else "")
    specs = {"weight": CastSpec(forward), "grad": CastSpec(backward)}
    if type(module).__name__ == "Linear":
        specs["input"] = CastSpec(forward)
    return name, specs


def find_fp8_layers(layers: list[Any]) -> list[Fp8Layer]:
    """The FP8 modules among the layer table's layers (host only)."""
    found = []
    for layer in layers:
        fp8 = _torchao_layer(layer.index, layer.module) or _te_layer(layer.index, layer.module)
        if fp8 is not None:
            found.append(fp8)
    return found
