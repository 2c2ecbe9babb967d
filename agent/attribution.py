"""Which backward belongs to the watched model, and which loss it carries.

`Tensor.backward` is one function for the whole process: a discriminator's, a critic's
or a reward model's backward passes through the same wrapper as the watched model's. A
backward is the model's own when its graph reaches one of the model's parameters (an
AccumulateGrad node holding it): that is the backward that writes the model's grads.
The walk reads autograd's host-side graph only (no device work, no synchronisation) and
stops at the first parameter it finds; it is bounded so that a huge foreign graph costs
at most `WALK_LIMIT` nodes.

With a GradScaler the tensor a loop backpropagates is `scaler.scale(loss)`; `ScaledLosses`
remembers what each `scale()` call was given, so the loss recorded is the unscaled one
the loop actually backpropagated, once, and a `scale()` whose output is never
backpropagated (the gradient-penalty recipe's `autograd.grad` pass) adds nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ampwatch.agent.distributed import SHARDED_PARALLELISMS

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
WALK_LIMIT = 4096  # graph nodes; past it the backward is taken as the model's (as before)


def reaches_params(tensor: torch.Tensor, param_ids: set[int],
                   limit: int = WALK_LIMIT) -> bool:
    """Whether backpropagating `tensor` writes a grad of a parameter in `param_ids`
    (ids). Depth-first from `tensor.grad_fn`, so the parameters next to the loss (the
    model's head) are found within a few nodes; a graph that never reaches the model
    (another model's loss) is walked whole, up to `limit` nodes, past which the answer
    is True: the agent records too much rather than lose the model's own backward."""
    root = tensor.grad_fn
    if root is None:
        return id(tensor) in param_ids  # a leaf: backward() on a parameter itself
    stack = [root]
    seen = {root}
    while stack:
        node = stack.pop()
        if type(node) is _ACCUMULATE_GRAD:
            if id(node.variable) in param_ids:
                return True
            continue
        if len(seen) > limit:
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return False


class ScaledLosses:
    """What each `scaler.scale(loss)` call returned, mapped back to its loss (detached);
    a step's worth at most (`clear()` at each step end). Training thread only."""

    def __init__(self) -> None:
        self._by_output: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def note(self, loss: Any, scaled: Any) -> None:
        if isinstance(scaled, torch.Tensor) and isinstance(loss, torch.Tensor):
            self._by_output[id(scaled)] = (weakref.ref(scaled), loss.detach())

    def pop(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The loss `tensor` is the scaled form of (once), or None."""
        entry = self._by_output.pop(id(tensor), None)
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def latest(self) -> torch.Tensor | None:
        """The loss of the latest `scale()` not yet backpropagated (once), or None: for
        a loop that transforms the scaled loss (divides it) before its backward."""
        return self._by_output.popitem()[1][1] if self._by_output else None

    def clear(self) -> None:
        self._by_output.clear()


class BackwardOwner:
    """One loop watch's view: is the backward about to run the model's own, and with which
    loss. Training thread only; no device work."""

    # parameters autograd never accumulates into (the all-gathered copies are): every
    # backward is taken as the model's, as the agent cannot tell
    UNWALKABLE = SHARDED_PARALLELISMS

    def __init__(self, param_ids: set[int], parallelism: str | None) -> None:
        self._param_ids = param_ids
        self._walk = parallelism not in self.UNWALKABLE
        self.scaled = ScaledLosses()
        self._ran = self._ran_ever = False  # a forward of the model since its last step

    def forward_ran(self) -> None:
        self._ran = self._ran_ever = True

    def step_ended(self) -> None:
        self.scaled.clear()
        self._ran = False

    def claim(self, tensor: torch.Tensor, scaler_enabled: bool
              ) -> tuple[bool, torch.Tensor | None]:
        """(whether backpropagating `tensor` is the model's own backward, its unscaled
        loss). Once the model's forward has been seen, a backward before its next one
        cannot be the model's: no walk then (a foreign backward costs nothing)."""
        loss = self.scaled.pop(tensor) if scaler_enabled else tensor
        if self._walk and ((self._ran_ever and not self._ran)
                           or not reaches_params(tensor, self._param_ids)):
            return False, None
        if loss is None:
            loss = self.scaled.latest()
        return True, loss
