"""ampwatch agent: `agent.attach(model, scaler)` inside a training script.

Records loss scales, skipped steps, gradient norms, per-layer inf/NaN and activation
ranges without synchronising the device, and delivers them to an ampwatch server.
torch is imported on first use of `attach`, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampwatch.agent.attachment import Attachment, attach

__all__ = ["Attachment", "attach"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ampwatch.agent import attachment

        return getattr(attachment, name)
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
