"""The spike marks of the run page's loss chart and the spike heatmaps of the layers page
(docs/spikes.md). Pure `data -> Figure` helpers the views call; kept apart from
figures.py and heatmaps.py so the two pages only gain a call each."""

from __future__ import annotations

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.kinds import FindingKind
from ampwatch.server.pages import figures, heatmaps
from ampwatch.server.pages.columns import LayerMatrix
from ampwatch.server.pages.plot import Figure

SPIKE_COLOUR = figures.CRITICAL
HEATMAPS = {  # twin key -> (matrix metric, what its colour bar says)
    "update_ratio": ("update_ratio", "update / weight"),
    "attn_max_logit": ("attn_max_logit", "max attention logit"),
}


def spike_findings(findings: dict) -> list[dict]:
    """The run's `loss_spike` findings (open and resolved) in step order."""
    spikes = [f for items in findings.values() for f in items
              if f["kind"] == FindingKind.LOSS_SPIKE and f["step"] is not None]
    return sorted(spikes, key=lambda f: f["step"])


def mark_spikes(fig: Figure, findings: dict, incidents: list[dict]) -> Figure:
    """A dotted line at each spike's first step, labelled with its likely cause (the layer
    it names, in the label's hover); a spike
    that joined another cause's incident (a layer overflowing) is that cause's symptom,
    told on its card, and is not labelled with a cause of its own here."""
    own = {i["id"] for i in incidents if i.get("cause") == Cause.LOSS_SPIKE}
    for spike in spike_findings(findings):
        if spike.get("incident") is not None and spike["incident"] not in own:
            continue
        where = f" ({spike['layer']})" if spike["layer"] else ""
        # the cause's code fits the chart's height; the layer it names is in its hover
        fig.add_vline(x=spike["step"], line={"color": SPIKE_COLOUR, "dash": "dot", "width": 1},
                      annotation={"text": figures.label(spike["code"]), "textangle": -90,
                                  "hovertext": figures.label(f"{spike['code']}{where}"),
                                  "font": {"size": 10, "color": SPIKE_COLOUR}},
                      annotation_position="top left")
    return fig


def spike_heatmaps(twin: dict, span: tuple[int, int] | None) -> dict[str, Figure]:
    """The layers page's update-ratio and attention-logit heatmaps (blank with a note
    where the run sent none)."""
    out = {}
    for key, (_, quantity) in HEATMAPS.items():
        matrix = LayerMatrix.from_twin(twin[key])
        out[f"{key}_heatmap"] = figures.share_x(
            heatmaps.layer_heatmap_figure(matrix, quantity=quantity), span)
    return out
