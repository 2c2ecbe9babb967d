"""Regenerate issue 58's verdict table in docs/diagnosis.md (between its markers): train
every family's seeded fault and healthy control of tests/zoo/ on a fresh local server and
write, per family, the truth (the test's own: the step it broke the input, changed the
learning rate or began scaling a weight, and the layer), the top incident card ampwatch
showed, the cards at warning or worse on the healthy control, and whether they agree.

    python bench/zoo_families.py                  # every family (about 40 s on 2 CPUs)
    python bench/zoo_families.py gemma mixtral    # only these families' rows are redone
    python bench/zoo_families.py --out -          # prints the table instead
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from tests.conftest import LiveServer  # noqa: E402
from tests.diagnosis.scenarios import WAIT  # noqa: E402
from tests.zoo import faults  # noqa: E402
from tests.zoo.loop import Fault, Truth, train  # noqa: E402

BEGIN, END = "<!-- zoo-families:begin -->", "<!-- zoo-families:end -->"
HEADER = ("| family | fault | truth (step, layer, cause) | top card (step, layer, cause) | "
          "cards on the healthy control | right |\n|---|---|---|---|---|---|")
# the layer each growth or jump was seeded in (faults.py), read by the truth below
SEEDED = {faults.GEMMA2_LATE_GROWTH.name: ("model.layers.1.mlp.down_proj", faults.LATE_GROWTH_FROM),
          faults.MIXTRAL_QK.name: ("model.layers.1.self_attn", faults.GROWTH_FROM),
          faults.BART_QK.name: ("model.encoder.layers.0.self_attn", faults.GROWTH_FROM),
          faults.MIXTRAL_ROUTER.name: ("model.layers.0.mlp.gate", faults.GROWTH_FROM),
          faults.GEMMA_JUMP.name: ("model.layers.1.mlp.down_proj", faults.FORWARD_AT)}


def truth_of(fault: Fault, truth: Truth) -> tuple[int | None, str | None, str]:
    """(step, layer, cause) from the loop's own state."""
    if fault.lr_jump is not None:
        return fault.lr_jump[0], None, "loss_spike"
    bad = next((i for i, s in enumerate(truth.steps) if s.input_bad), None)
    if bad is not None:
        return bad, None, "nonfinite_input"
    layer, step = SEEDED[fault.name]
    return step, layer, "weight_jump"


def cards(server: LiveServer, fault: Fault) -> tuple[Truth, list[dict]]:
    """The run's incident cards, as the API orders them (open, most severe first)."""
    run_id, truth = train(fault, server.url)
    response = httpx.get(f"{server.url}/api/v1/runs/{run_id}/incidents", params=WAIT,
                         timeout=120)
    response.raise_for_status()
    return truth, response.json()["items"]


def problems(items: list[dict]) -> list[dict]:
    return [i for i in items if i["severity"] in ("warning", "critical")]


def told(card: dict) -> str:
    where = f"`{card['layer']}`" if card["layer"] else "no layer"
    return f"{card['step']}, {where}, {card['cause']} ({card['severity']})"


def names(card: dict, step: int | None, layer: str | None, cause: str) -> bool:
    """Whether the card tells the truth: its cause and layer, and its first step (a loss
    spike's learning-rate change: the step its headline names)."""
    if (card["layer"], card["cause"]) != (layer, cause):
        return False
    return card["step"] == step or (cause == "loss_spike"
                                    and f"at step {step}" in (card["headline"] or ""))


def row(server: LiveServer, fault: Fault, healthy: Fault) -> str:
    truth, items = cards(server, fault)
    step, layer, cause = truth_of(fault, truth)
    _, control = cards(server, healthy)
    shown, false = problems(items), problems(control)
    # the top card: the first at warning or worse, else the first with a known cause (a
    # slow growth caught before anything broke is a note)
    top = next(iter(shown), None) or next((i for i in items if i["cause"]), None)
    right = (top is not None and names(top, step, layer, cause) and len(shown) <= 1
             and not false)
    want = f"{step}, `{layer}`, {cause}" if layer else f"{step}, no layer, {cause}"
    return (f"| {fault.arch.name} | {fault.what} | {want} | {told(top) if top else 'none'} | "
            f"{'; '.join(told(c) for c in false) or 'none'} | "
            f"{'yes' if right else '**no**'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="family names (default: all)")
    parser.add_argument("--out", default=str(REPO / "docs" / "diagnosis.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = [f for f in faults.FAMILY_FAULTS
              if not args.families or f.arch.name in args.families]
    path = Path(args.out) if args.out != "-" else None
    text = path.read_text() if path else ""
    kept = {}  # the rows of families not rerun, by (family, fault)
    if path and BEGIN in text:
        for line in text.split(BEGIN)[1].split(END)[0].splitlines():
            cells = line.split(" | ")
            if line.startswith("| ") and not line.startswith(("| family", "|---")):
                kept[(cells[0][2:], cells[1])] = line
    with tempfile.TemporaryDirectory(prefix="ampwatch-families-") as root:
        os.environ["AMPWATCH_SPOOL_DIR"] = str(Path(root) / "spool")
        os.environ.setdefault("AMPWATCH_ANALYSIS_WAIT_S", "30")
        server = LiveServer(f"sqlite:///{Path(root) / 'zoo.db'}", Path(root) / "server.log")
        server.start()
        try:
            for fault in chosen:
                began = time.monotonic()
                kept[(fault.arch.name, fault.what)] = row(
                    server, fault, faults.FAMILY_HEALTHY[fault.arch.name])
                print(f"{fault.name}: {time.monotonic() - began:.0f} s", file=sys.stderr)
        finally:
            server.stop()
    order = [(f.arch.name, f.what) for f in faults.FAMILY_FAULTS]
    table = "\n".join([BEGIN, HEADER, *(kept[k] for k in order if k in kept), END])
    if path is None:
        print(table)
        return
    if BEGIN in text:
        text = re.sub(f"{re.escape(BEGIN)}.*?{re.escape(END)}", lambda _: table, text,
                      flags=re.S)
    else:
        raise SystemExit(f"{args.out} has no {BEGIN} marker")
    path.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
