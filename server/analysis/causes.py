"""Every incident cause, declared once: the root causes incidents are grouped by and
named after, as finding kinds are in `kinds.py`. A kind's `KindSpec.cause` and
`follows`, a detector's `evidence["cause"]` and the pages name causes by these members;
tests/server/analysis/test_causes.py fails on a cause the code names that is not here,
and on a member nothing names.
"""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    """Why a run went wrong, as an incident tells it (`Incident.cause`)."""

    # where a non-finite step began (localize.py), in the order its codes are stored
    NONFINITE_INPUT = "nonfinite_input"
    FORWARD_OVERFLOW = "forward_overflow"
    NONFINITE_LOSS = "nonfinite_loss"
    GRAD_OVERFLOW = "grad_overflow"
    UNKNOWN = "unknown"
    # a forward overflow a later op absorbed before it reached the grads
    ABSORBED_OVERFLOW = "absorbed_overflow"
    # the gradients ran away before any value overflowed
    DIVERGENCE = "divergence"
    MISALIGNED = "misaligned"
    LOSS_SPIKE = "loss_spike"
    WEIGHT_JUMP = "weight_jump"
    LR_CHANGE = "lr_change"  # the learning rate rose at one step (lr_changes.py)
    # the pitfall whose findings the starved optimizer states follow from (kinds.py)
    CLIP_BEFORE_UNSCALE = "clip_before_unscale"
