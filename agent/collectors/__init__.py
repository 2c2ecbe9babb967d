"""The signals the agent records, one collector each (see `base.Collector`)."""

from __future__ import annotations

from agent.collectors.activations import ActivationCollector
from agent.collectors.base import Collector
from agent.collectors.core import StepCollector
from agent.collectors.forward import ForwardCollector
from agent.collectors.grads import GradNormCollector
from agent.collectors.loss import LossCollector
from agent.collectors.pitfalls import PitfallCollector
from agent.collectors.scaler import ScalerCollector
from agent.collectors.timing import TimingCollector

__all__ = ["Collector", "default_collectors"]


def default_collectors(n_layers: int) -> list[Collector]:
    """Every signal of docs/wire-format.md's step record, in record field order."""
    return [StepCollector(), ScalerCollector(), GradNormCollector(n_layers), LossCollector(),
            TimingCollector(), ForwardCollector(), PitfallCollector(),
            ActivationCollector(n_layers)]
