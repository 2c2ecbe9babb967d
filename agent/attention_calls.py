"""Where attention runs: the modules whose forward calls an attention function, and the
patches that see every call of one.

A module runs attention when its class's `forward` names an attention entry point (torch's
`scaled_dot_product_attention`, transformers' `ALL_ATTENTION_FUNCTIONS` or its
`eager_attention_forward`, flash-attn's functions): such a module is a layer
(agent/layers.py) whatever attributes it keeps, so its calls have a slot to be credited to.
Host only, read once at attach from the code object; no call is made.

Every call is seen through one of two patches, installed only on sampled steps
(agent/collectors/spikes.py): `torch.nn.functional.scaled_dot_product_attention`, and
transformers' `AttentionInterface.get_interface` (transformers 5), through which its
attention modules pick the function they call (sdpa, eager, flash, flex or a registered
one); each of those functions takes the calling module first, then query and key.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from torch import nn

from ampwatch.agent import patches

ATTENTION_NAMES = frozenset({
    "scaled_dot_product_attention", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward",
    "flash_attn_func", "flash_attn_varlen_func", "flex_attention"})

SDPA = patches.GlobalPatch("scaled_dot_product_attention",
                           [(nn.functional, "scaled_dot_product_attention")])
_interface_patch: list[patches.GlobalPatch] = []  # made once transformers is imported


def calls_attention(module: nn.Module) -> bool:
    """Whether the module's class's forward names an attention entry point (host only)."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return False
    # transformers wraps forwards in decorators (deprecated-kwarg checks): read the original
    code = getattr(inspect.unwrap(forward), "__code__", None)
    return code is not None and not ATTENTION_NAMES.isdisjoint(code.co_names)


def interface_patch() -> patches.GlobalPatch | None:
    """The patch of transformers' `AttentionInterface.get_interface`; None while
    transformers is not imported (the agent never imports it) or has no such method."""
    if not _interface_patch:
        modeling = sys.modules.get("transformers.modeling_utils")
        interface: Any = getattr(modeling, "AttentionInterface", None)
        if interface is None or not callable(getattr(interface, "get_interface", None)):
            return None
        _interface_patch.append(patches.GlobalPatch(
            "AttentionInterface.get_interface", [(interface, "get_interface")]))
    return _interface_patch[0]
