"""The signals the agent records, one collector each (see `base.Collector`)."""

from __future__ import annotations

from ampwatch.agent.collectors.activations import ActivationCollector
from ampwatch.agent.collectors.base import Collector
from ampwatch.agent.collectors.core import StepCollector
from ampwatch.agent.collectors.forward import ForwardCollector
from ampwatch.agent.collectors.grads import GradNormCollector
from ampwatch.agent.collectors.loss import LossCollector
from ampwatch.agent.collectors.pitfalls import PitfallCollector
from ampwatch.agent.collectors.scaler import ScalerCollector
from ampwatch.agent.collectors.timing import TimingCollector

__all__ = ["Collector", "default_collectors"]


def default_collectors(n_layers: int) -> list[Collector]:
    """Every signal of docs/wire-format.md's step record, in record field order."""
    return [StepCollector(), ScalerCollector(), GradNormCollector(n_layers), LossCollector(),
            TimingCollector(), ForwardCollector(), PitfallCollector(),
            ActivationCollector(n_layers)]
