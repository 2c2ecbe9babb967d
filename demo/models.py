"""The demo's models, their data and their loss: what `ampwatch demo` trains, and the
factories `ampwatch replay --model ampwatch.demo.models:<factory>` rebuilds them with.

Each factory returns `(model, loss_fn)` as replay takes it: `loss_fn(output, inputs)` is
the loss the demo trained with, its targets computed from the inputs (the demo's labels
are a function of its synthetic data), so a replay runs the backward too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 32
FEATURES = 64
CLASSES = 16
VOCAB = 1001          # not a multiple of 8, but an untied lookup is no matmul: not flagged
TOKENS = 8
OVERFLOW_GAIN = 1e5   # what the overflowing layer multiplies its output by

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ScaledLinear(nn.Linear):
    """A Linear whose output is multiplied by its `gain` buffer: the demo raises it mid-run,
    as if the layer's weights had grown, so its fp16 output exceeds 65504. A buffer, so a
    bundle's state dict holds the gain the bad step ran with."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a 0-dim float32 buffer times an fp16 output stays fp16 under autocast
        return super().forward(x) * self.gain


class BagOfTokens(nn.Module):
    """Embedding, mean over the tokens, a misaligned hidden layer, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, FEATURES)
        self.hidden = nn.Linear(FEATURES, 127)
        self.head = nn.Linear(127, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.hidden(self.embed(tokens).mean(dim=1))))


def features(gen: torch.Generator) -> torch.Tensor:
    """A batch of the MLPs' inputs."""
    return torch.randn(BATCH, FEATURES, generator=gen)


def tokens(gen: torch.Generator) -> torch.Tensor:
    """A batch of BagOfTokens' inputs."""
    return torch.randint(0, VOCAB, (BATCH, TOKENS), generator=gen)


def features_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), (x[:, :CLASSES] > 0.5).sum(dim=1) % CLASSES)


def tokens_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), batch[:, 0] % CLASSES)


def _mlp(hidden: nn.Linear) -> nn.Module:
    return nn.Sequential(OrderedDict([
        ("fc1", nn.Linear(FEATURES, 128)),
        ("act1", nn.ReLU()),
        ("fc2", hidden),
        ("act2", nn.ReLU()),
        ("out", nn.Linear(128, CLASSES)),
    ]))


def mlp() -> tuple[nn.Module, LossFn]:
    """The healthy fp16 and bf16 runs' MLP (fc1, fc2, out) and its loss."""
    return _mlp(nn.Linear(128, 128)), features_loss


def overflow_mlp() -> tuple[nn.Module, LossFn]:
    """The MLP whose fc2 is a ScaledLinear (gain 1; the bundle's state holds the raised
    gain) and its loss."""
    return _mlp(ScaledLinear(128, 128)), features_loss


def bag_of_tokens() -> tuple[nn.Module, LossFn]:
    """BagOfTokens and its loss."""
    return BagOfTokens(), tokens_loss


def spec(factory: Callable[[], tuple[nn.Module, LossFn]]) -> str:
    """`factory` as `ampwatch replay --model` names it: `ampwatch.demo.models:mlp`."""
    return f"{factory.__module__}:{factory.__name__}"
