"""The signals the agent records, one collector each (see `base.Collector`)."""

from __future__ import annotations

from ampwatch.agent.collectors.activations import ActivationCollector
from ampwatch.agent.collectors.base import Collector
from ampwatch.agent.collectors.compute_dtype import ComputeDtypeCollector
from ampwatch.agent.collectors.core import StepCollector
from ampwatch.agent.collectors.forward import ForwardCollector
from ampwatch.agent.collectors.fp8 import Fp8Collector
from ampwatch.agent.collectors.grads import GradNormCollector
from ampwatch.agent.collectors.loss import LossCollector
from ampwatch.agent.collectors.pitfalls import PitfallCollector
from ampwatch.agent.collectors.scaler import ScalerCollector
from ampwatch.agent.collectors.spikes import SpikeCollector
from ampwatch.agent.collectors.timing import TimingCollector
from ampwatch.agent.collectors.weights import WeightNormCollector
from ampwatch.agent.fp8 import find_fp8_layers
from ampwatch.agent.layers import Layer

__all__ = ["Collector", "attached_collectors", "default_collectors"]


def default_collectors(n_layers: int) -> list[Collector]:
    """Every signal of docs/wire-format.md's step record, in record field order."""
    return [StepCollector(), ScalerCollector(), GradNormCollector(n_layers), LossCollector(),
            TimingCollector(), ForwardCollector(), PitfallCollector(),
            ActivationCollector(n_layers), ComputeDtypeCollector()]


def attached_collectors(layers: list[Layer], *last: Collector | None) -> list[Collector]:
    """What attach() records for a model with `layers`: `default_collectors`, FP8 (when
    the model has FP8 layers), the spike signals, the weight norms (after them: they add to
    `spikes`), then `last` in order, leaving out None (the step guard, whose read marks a
    step skipped, then the flight recorder, whose read sees the whole record)."""
    collectors = default_collectors(len(layers))
    fp8_layers = find_fp8_layers(layers)
    if fp8_layers:
        collectors.append(Fp8Collector(fp8_layers, layers))
    collectors.append(SpikeCollector(layers))
    collectors.append(WeightNormCollector(layers))
    collectors.extend(c for c in last if c is not None)
    return collectors
