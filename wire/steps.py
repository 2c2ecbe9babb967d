"""Every per-step scalar of a step record, declared once: its name, its type, its unit,
what it means and which chart of the run page shows it.

The server's `StepIn` and `StepPublic`, its storage columns (`series.SCALAR_FIELDS`, in
this order), the client's `Step`, the pages' `StepColumns.FIELDS` and the step table of
docs/wire-format.md are derived from `STEP_FIELDS`, and tests/test_wire.py fails when one
of them falls out of step. Adding a signal: its collector (agent/collectors/), one
`StepField` appended here (never reorder: the order is the storage format), its row in
docs/wire-format.md (`doc_row`), its tests; a charted one also gets its figure
(server/pages/figures.py, named by `chart`). Per-layer vectors (`layer_grad_norm`,
`activations`, ...) are not declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# float: a WireFloat; bool; count: a counter (0..2**31-1); step: the step index;
# layer: a layer table index; dtype: a dtype name ("float16", ..., "mixed");
# guard: a step guard's reason (wire.batch.GUARD_REASONS)
FieldType = Literal["float", "bool", "count", "step", "layer", "dtype", "guard"]
# the run page's step charts (server/pages/views.py, overview_figures)
Chart = Literal["loss_scale", "grad_norm", "loss", "lr", "phases", "memory"]


@dataclass(frozen=True)
class StepField:
    """One scalar of a step record; `optional`: absent from older server answers, so the
    public model gives it a default (fields added after the first release)."""

    name: str
    type: FieldType
    doc: str
    unit: str = ""
    chart: Chart | None = None
    optional: bool = False


STEP_FIELDS: tuple[StepField, ...] = (
    StepField("step", "step", "optimizer step index (0-based; skipped steps count), strictly "
              "increasing per rank"),
    StepField("loss_scale", "float", "`scaler.get_scale()` just before this step's `update()` "
              "(the scale its backward used); null without a scaler", chart="loss_scale"),
    StepField("scale_after", "float", "the scale `update()` set", chart="loss_scale"),
    StepField("skipped", "bool", "the optimizer did not step (the scaler found inf/NaN)"),
    StepField("grad_norm", "float", "total L2 norm of the unscaled grads before clipping "
              "(`clip_grad_norm_`'s return value)", chart="grad_norm"),
    StepField("grad_norm_clipped", "float", "total norm after clipping, when the loop "
              "clipped"),
    StepField("loss", "float", "the unscaled losses backpropagated into the watched model "
              "since its previous step, summed, or those named with `log_loss` "
              "(docs/agent.md, \"Loops with several models\")", chart="loss"),
    StepField("lr", "float", "learning rate of param group 0", chart="lr"),
    StepField("t_forward_ms", "float", "time of the training forwards", "ms", "phases"),
    StepField("t_backward_ms", "float", "time of the backward", "ms", "phases"),
    StepField("t_optimizer_ms", "float", "time of the optimizer step", "ms", "phases"),
    StepField("t_step_ms", "float", "time from the end of the previous optimizer step to "
              "the end of this one", "ms", "phases"),
    StepField("peak_mem_bytes", "float", "peak device memory during the step", "bytes",
              "memory"),
    StepField("input_nonfinite", "bool", "the input batch of the training forward had "
              "inf/NaN"),
    StepField("autocast_dtype", "dtype", "autocast dtype of the training forwards in this "
              "step: `float16`, `bfloat16`, ..., `\"mixed\"` when several, null without "
              "autocast"),
    StepField("scheduler_steps", "count", "LR scheduler `step()` calls since the previous "
              "optimizer step"),
    StepField("scaler_updates", "count", "`scaler.update()` calls since the previous "
              "optimizer step"),
    StepField("clip_before_unscale", "bool", "`clip_grad_norm_` (or a grad read) ran on "
              "still-scaled grads"),
    StepField("eval_forwards", "count", "forwards in eval mode"),
    StepField("eval_forwards_no_autocast", "count", "forwards in eval mode without autocast "
              "while training uses it"),
    StepField("forward_nonfinite", "bool", "some layer's output held inf/NaN in this step's "
              "training forwards (null: not observed; a CPU agent observes sampled steps and "
              "steps whose loss is inf/NaN, docs/agent.md \"Cheap by design\"; with "
              "`check_outputs=\"every_step\"` and on a GPU, every step)", optional=True),
    StepField("first_nonfinite_layer", "layer", "layer table index of the first such output "
              "in execution order (null when none); must be below L", optional=True),
    StepField("guarded", "guard", "why the agent's step guard (docs/guard.md) left the step "
              "out: `loss_spike`, `nonfinite_grads` or `nonfinite_loss` (`skipped` is true "
              "too); null when it did not", optional=True),
)
BY_NAME: dict[str, StepField] = {f.name: f for f in STEP_FIELDS}


def names(*types: FieldType) -> tuple[str, ...]:
    """The declared names, in storage order; of these types only, when given."""
    return tuple(f.name for f in STEP_FIELDS if not types or f.type in types)


def charted() -> tuple[str, ...]:
    """The fields some chart of the run page draws, in storage order."""
    return tuple(f.name for f in STEP_FIELDS if f.chart is not None)


def doc_row(f: StepField) -> str:
    """The field's row of the step table in docs/wire-format.md."""
    unit = f" ({f.unit})" if f.unit else ""
    return f"| `{f.name}` | {f.doc}{unit} |"
