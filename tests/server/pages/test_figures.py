"""The figure builders on hand-made twins: problems are drawn, never dropped."""

from __future__ import annotations

from ampwatch.server.pages import figures, heatmaps
from ampwatch.server.pages.columns import LayerMatrix, StepColumns, decode_values


def steps(items: list[dict]) -> list[StepColumns]:
    return [StepColumns.from_items("rank 0", items)]


def test_wire_values_keep_missing_apart_from_nan():
    values, present = decode_values([1.0, None, "NaN", "Infinity", "-Infinity"])
    assert present.tolist() == [True, False, True, True, True]
    assert values[3] == float("inf") and values[4] == float("-inf")


def test_loss_scale_is_log2_with_skipped_steps_marked():
    items = [{"step": s, "loss_scale": 2.0 ** (16 - s), "skipped": True} for s in range(3)]
    items.append({"step": 3, "loss_scale": 2.0 ** 13, "skipped": False})
    fig = figures.loss_scale_figure(steps(items))
    line, skipped = fig.data
    assert list(line.y) == [16, 15, 14, 13]
    assert list(skipped.x) == [0, 1, 2] and skipped.marker.color == figures.CRITICAL
    assert "2<sup>16</sup>" in fig.layout.yaxis.ticktext


def test_nonfinite_grad_norms_are_markers_not_gaps():
    items = [{"step": 0, "grad_norm": 1.5}, {"step": 1, "grad_norm": "Infinity"},
             {"step": 2, "grad_norm": "NaN"}, {"step": 3, "grad_norm": None}]
    fig = figures.grad_norm_figure(steps(items))
    line, bad = fig.data
    assert list(line.x) == [0] and list(bad.x) == [1, 2]
    assert list(bad.text) == ["+inf", "NaN"]
    assert fig.layout.yaxis.type == "log"


def test_names_are_escaped_for_plotly():
    fig = figures.loss_figure([StepColumns.from_items("<b>x</b>", [{"step": 0, "loss": 1}])])
    assert fig.data[0].name == "&lt;b&gt;x&lt;/b&gt;"


def test_heatmap_marks_the_first_offender_in_forward_order():
    matrix = LayerMatrix.from_twin({
        "layers": ["head", "embed", "mid"], "step_start": [0, 10, 20], "step_end": [9, 19, 29],
        "values": [[1.0, "Infinity", "NaN"], [0.5, 0.5, None], [2.0, "Infinity", 3.0]],
    })
    layers = {"items": [{"index": 0, "forward_index": 2}, {"index": 1, "forward_index": 0},
                        {"index": 2, "forward_index": 1}]}
    order = heatmaps.forward_order(layers)
    assert order == [1, 2, 0]
    offender = heatmaps.first_offender(matrix, order)
    assert (offender.layer, offender.step_start, offender.value) == ("mid", 10, "+inf")
    fig = heatmaps.layer_heatmap_figure(matrix, order, quantity="grad norm", offender="mid")
    names = [trace.name for trace in fig.data]
    assert names == ["grad norm", "inf", "NaN", "first non-finite of a layer", "first offender"]
    assert fig.layout.annotations[0].text == "first offender: mid"
