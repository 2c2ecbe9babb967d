"""What the agent, the server and the client must agree on, in one place: the run id
pattern and label limits (`runs`), the wire encoding of non-finite floats (`floats`),
names inside a batch (`batch`), the per-step scalars (`steps`), and the spool's file format
(`spool`).

Imports nothing beyond the standard library and numpy, so the agent, the server and the
client may all import it (docs/architecture.md, "The walls").
"""

from ampwatch.wire.batch import (
    DELIVERY_EVENT,
    FINISHED_EVENT,
    FP8_ROLES,
    FP8_STATS,
    GUARD_REASONS,
    RESTART_EVENT,
    SPEED_CHECK_EVENT,
    SPIKE_SIGNALS,
)
from ampwatch.wire.floats import (
    NONFINITE_STRINGS,
    decode_float,
    decode_tree,
    encode_float,
    encode_float_array,
    encode_tree,
)
from ampwatch.wire.runs import (
    DEFAULT_SERVER,
    LABEL_MAX_CHARS,
    LABEL_PATTERN,
    RUN_ID_PATTERN,
    RUN_ID_RULE,
    check_label,
    check_run_id,
    url_problem,
)

__all__ = [
    "DEFAULT_SERVER",
    "DELIVERY_EVENT",
    "FINISHED_EVENT",
    "FP8_ROLES",
    "FP8_STATS",
    "GUARD_REASONS",
    "SPIKE_SIGNALS",
    "LABEL_MAX_CHARS",
    "LABEL_PATTERN",
    "NONFINITE_STRINGS",
    "RESTART_EVENT",
    "RUN_ID_PATTERN",
    "RUN_ID_RULE",
    "SPEED_CHECK_EVENT",
    "check_label",
    "check_run_id",
    "decode_float",
    "decode_tree",
    "encode_float",
    "encode_float_array",
    "encode_tree",
    "url_problem",
]
