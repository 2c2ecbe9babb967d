"""ampwatch agent: `agent.attach(model, scaler)` inside a training script.

Records loss scales, skipped steps, gradient norms, per-layer inf/NaN and activation
ranges without synchronising the device, and delivers them to an ampwatch server.
"""

from agent.attachment import Attachment, attach

__all__ = ["Attachment", "attach"]
