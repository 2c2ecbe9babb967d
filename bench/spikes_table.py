"""Regenerate the label table of docs/spikes.md: run the spike suite (tests/spikes/) on a
fresh local server and write, per scenario, the spike findings the truth calls for and
those the server raised, then each cause label's precision and recall over the suite.
Only the text between the table markers in docs/spikes.md is replaced.

    python bench/spikes_table.py            # rewrites the table in docs/spikes.md (~1 min)
    python bench/spikes_table.py --out -    # prints the table instead
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.conftest import LiveServer  # noqa: E402
from tests.spikes.scenarios import SCENARIOS, expected, observed, train_pinned  # noqa: E402

BEGIN, END = "<!-- spike-table: bench/spikes_table.py -->", "<!-- /spike-table -->"
SPIKE_KINDS = ("loss_spike", "spike_precursor", "optimizer_state")


def cell(findings: set) -> str:
    if not findings:
        return "none"
    layers: dict[tuple[str, str], list[str]] = {}
    for kind, code, layer in findings:
        layers.setdefault((kind, code), []).append(layer or "-")
    return "<br>".join(f"{kind} **{code}** ({', '.join(sorted(names))})"
                       for (kind, code), names in sorted(layers.items()))


def table() -> str:
    torch.set_num_threads(1)
    rows, hits, wanted, raised = [], Counter(), Counter(), Counter()
    healthy_alarms = 0
    with tempfile.TemporaryDirectory(prefix="ampwatch-spikes-") as root:
        os.environ["AMPWATCH_SPOOL_DIR"] = str(Path(root) / "spool")
        server = LiveServer(f"sqlite:///{Path(root) / 'spikes.db'}", Path(root) / "server.log")
        server.start()
        try:
            for scenario in SCENARIOS:
                run_id, truth = train_pinned(scenario, server.url)
                want, _ = expected(truth)
                serious, _ = observed(server.url, run_id)
                got = {f for f in serious if f[0] in SPIKE_KINDS}
                if not want:  # a healthy run: any warning or critical is a false alarm
                    healthy_alarms += len(serious)
                for kind, code, layer in want:
                    wanted[code] += 1
                    hits[code] += (kind, code, layer) in got
                for _, code, _ in got:
                    raised[code] += 1
                rows.append(f"| {scenario.name} | {scenario.mechanism} | {cell(want)} | "
                            f"{cell(got)} | {'yes' if want == got else '**no**'} |")
                print(f"{scenario.name}: {'ok' if want == got else 'MISMATCH'}", file=sys.stderr)
        finally:
            server.stop()
    labels = sorted(set(wanted) | set(raised))
    per_label = [f"| {code} | {wanted[code]} | {raised[code]} | {hits[code]} | "
                 f"{hits[code] / raised[code] if raised[code] else 1.0:.2f} | "
                 f"{hits[code] / wanted[code] if wanted[code] else 1.0:.2f} |" for code in labels]
    return "\n".join([
        BEGIN,
        "| scenario | pushed | expected (truth) | observed (server) | exact |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "| cause label | expected | raised | matching (kind, label, layer) | precision | recall |",
        "|---|---|---|---|---|---|",
        *per_label,
        "",
        f"Warning or critical findings of any kind on the healthy runs: {healthy_alarms}.",
        END,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "spikes.md"))
    args = parser.parse_args()
    text = table()
    if args.out == "-":
        print(text)
        return
    path = Path(args.out)
    doc = path.read_text()
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    path.write_text(doc[:start] + text + doc[end:])
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
