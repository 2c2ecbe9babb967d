"""The figure builders on hand-made twins: problems are drawn, never dropped."""

from __future__ import annotations

import numpy as np

from ampwatch.server.pages import figures, heatmaps, scale_chart
from ampwatch.server.pages.columns import LayerMatrix, StepColumns, decode_values


def steps(items: list[dict]) -> list[StepColumns]:
    return [StepColumns.from_items("rank 0", items)]


def test_wire_values_keep_missing_apart_from_nan():
    values, present = decode_values([1.0, None, "NaN", "Infinity", "-Infinity"])
    assert present.tolist() == [True, False, True, True, True]
    assert values[3] == float("inf") and values[4] == float("-inf")


def test_loss_scale_is_log2_with_skipped_streaks_shaded():
    items = [{"step": s, "loss_scale": 2.0 ** (16 - s), "skipped": True} for s in range(3)]
    items.append({"step": 3, "loss_scale": 2.0 ** 13, "skipped": False})
    items.append({"step": 4, "loss_scale": 2.0 ** 13, "skipped": True})
    fig = scale_chart.loss_scale_figure(steps(items))
    line, skipped, hover = fig.data
    assert list(hover["x"]) == [0, 1, 2, 4]  # each skipped step names its span on hover
    assert list(line["y"]) == [16, 15, 14, 13, 13]
    # two streaks (0-2 and 4) as two shaded spans of one trace, not five markers
    assert skipped["fill"] == "toself" and skipped["name"] == "skipped steps"
    assert [x for x in skipped["x"] if x is not None][::5] == [-0.5, 3.5]
    assert "2<sup>16</sup>" in fig.layout["yaxis"]["ticktext"]
    # the hover reads the scale as the stats tile does: 2^16, not 65536.00000
    assert list(line["text"]) == ["2^16", "2^15", "2^14", "2^13", "2^13"]
    assert line["hovertemplate"] == "scale %{text}"
    assert scale_chart.scale_words(np.array([3.0, 0.5])) == ["3", "2^-1"]
    assert scale_chart.streaks(np.array([0, 1, 2, 4, 7, 8]), np.ones(6, bool)) == [
        (0, 2), (4, 4), (7, 8)]


def test_loss_scale_ticks_are_whole_powers_of_two_with_even_spacing():
    items = [{"step": s, "loss_scale": 2.0 ** (16 - s), "skipped": s > 0} for s in range(166)]
    ticks = list(scale_chart.loss_scale_figure(steps(items)).layout["yaxis"]["tickvals"])
    # down to 2^-149, but the axis stops at 2^-24: what fell below is one row under it
    assert ticks == [-26, -16, -8, 0, 8, 16]  # 2^16, where the scale starts
    assert scale_chart.log2_ticks(0, 16) == [0, 4, 8, 12, 16]
    assert scale_chart.log2_ticks(10.2, 16) == [11, 12, 13, 14, 15, 16]


def test_a_scale_of_zero_keeps_the_full_step_range():
    items = [{"step": s, "loss_scale": 2.0 ** (16 - s) if s < 200 else 0.0, "skipped": True}
             for s in range(500)]
    fig = scale_chart.loss_scale_figure(steps(items))
    assert fig.layout["xaxis"]["range"] == [-0.5, 499.5]
    fallen = next(t for t in fig.data if t["name"] == "scale below 2^-24")
    assert len(fallen["x"]) == 500 - 41 and fig.layout["yaxis"]["ticktext"][0] == "0"  # 2^-24 at 40
    assert "fell to" in fig.layout["annotations"][0]["text"]


def test_grad_norm_ticks_read_as_people_write_them():
    items = [{"step": s, "grad_norm": 1.525879e-5 * (1 + s)} for s in range(4)]
    text = list(figures.grad_norm_figure(steps(items)).layout["yaxis"]["ticktext"])
    assert text and all("e-0" not in t and len(t) <= 5 for t in text), text
    assert [figures.human_number(v) for v in (1.525879e-5, 2e-5, 0.002, 50, 1e4, 2e6)] == [
        "1.53e-5", "2e-5", "0.002", "50", "10000", "2e6"]


def test_nonfinite_grad_norms_are_markers_not_gaps():
    items = [{"step": 0, "grad_norm": 1.5}, {"step": 1, "grad_norm": "Infinity"},
             {"step": 2, "grad_norm": "NaN"}, {"step": 3, "grad_norm": None}]
    fig = figures.grad_norm_figure(steps(items))
    line, bad = fig.data
    assert list(line["x"]) == [0] and list(bad["x"]) == [1, 2]
    assert list(bad["text"]) == ["+inf", "NaN"]
    assert fig.layout["yaxis"]["type"] == "log"


def test_names_are_escaped_for_plotly():
    fig = figures.loss_figure([StepColumns.from_items("<b>x</b>", [{"step": 0, "loss": 1}])])
    assert fig.data[0]["name"] == "&lt;b&gt;x&lt;/b&gt;"


def test_forward_order_puts_layers_never_seen_in_forward_last():
    layers = {"items": [{"index": 0, "forward_index": 2}, {"index": 1, "forward_index": 0},
                        {"index": 2, "forward_index": None}, {"index": 3, "forward_index": 1}]}
    assert heatmaps.forward_order(layers) == [1, 3, 0, 2]


def test_heatmap_marks_the_first_offender_in_forward_order():
    """Rows come in forward order (as the matrix queries return them): "mid" runs before
    "head", so its inf in bucket 10 is the first offender, not head's."""
    matrix = LayerMatrix.from_twin({
        "layers": ["embed", "mid", "head"], "step_start": [0, 10, 20], "step_end": [9, 19, 29],
        "values": [[0.5, 0.5, None], [2.0, "Infinity", 3.0], [1.0, "Infinity", "NaN"]],
    })
    offender = heatmaps.first_offender(matrix)
    assert (offender.layer, offender.step_start, offender.value) == ("mid", 10, "+inf")
    fig = heatmaps.layer_heatmap_figure(matrix, quantity="grad norm", offender="mid")
    names = [trace["name"] for trace in fig.data]
    # each overlay (a heatmap, no legend entry) with a legend square of its own colour
    assert names == ["grad norm", "inf", "inf", "NaN", "NaN", "first non-finite of a layer",
                     "first offender"]
    assert fig.layout["annotations"][0]["text"] == "first offender: mid"
