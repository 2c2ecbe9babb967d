"""Names inside a batch (POST /api/v1/runs/{id}/batches) that the agent writes and the
server reads: event kinds and the FP8 statistics' layout. The batch's fields themselves
are the server's `BatchIn` schema (docs/wire-format.md)."""

from __future__ import annotations

FINISHED_EVENT = "finished"  # the agent's detach: the rank is done
RESTART_EVENT = "restart"  # the agent resumed a run from an earlier step
SPEED_CHECK_EVENT = "speed_check"  # detail: fp32_ms, amp_ms, speedup, dtype
# delivery stopped and recovered; sent once it did. detail: start, end (ISO 8601 UTC: the
# first request without an answer, the first answer after), cause (text), batches_spooled
DELIVERY_EVENT = "delivery"

# A step's `guarded`: why the step guard (agent/step_guard.py) left it out; codes 1..3 in
# this order, least severe first (ranks agree on the highest). The server keeps the code
# in the `skipped` column as 1 + code (1 alone: skipped by a GradScaler).
GUARD_REASONS = ("loss_spike", "nonfinite_grads", "nonfinite_loss")

# An FP8 layer's statistics per step: one vector (one entry per layer) per role and stat.
FP8_ROLES = ("input", "weight", "grad")
FP8_STATS = ("amax", "scale", "rms", "saturated", "underflow")
# A sampled step's spike signals (its `spikes` object): one vector per signal, in the
# server's storage order (docs/spikes.md)
SPIKE_SIGNALS = ("update_ratio", "update_lost", "adam_eps_share", "adam_v_zero_share",
                 "attn_max_logit", "logit_absmax", "logit_lse", "weight_norm")
