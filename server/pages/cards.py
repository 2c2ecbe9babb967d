"""The overview's problem cards: one per incident (root cause), ordered by severity and
then by the first step of its leading signal, titled by what it is (a risk as a risk)
and its first step, with links to a window of steps centred on it and to its layer."""

from __future__ import annotations

import re
from urllib.parse import quote, urlencode

from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.draft import SEVERITY_RANK
from ampwatch.server.findings.bisect_verdicts import incident_bundles
from ampwatch.server.findings.incidents import SYMPTOMS
from ampwatch.server.findings.member_words import told_in_card

LINK_WINDOW = 200  # steps a link to a step opens around it


def step_window(first: int, last: int, run_last: int | None) -> tuple[int, int]:
    """The steps a link to steps `first`..`last` opens: centred on them, LINK_WINDOW
    wide or a little wider than the span, shifted (not cut) to stay inside the run's
    steps 0..`run_last`."""
    width = max(LINK_WINDOW, (last - first) + LINK_WINDOW // 2)
    start = (first + last) // 2 - width // 2
    end = start + width
    if run_last is not None and end > max(run_last, last):
        start, end = start - (end - max(run_last, last)), max(run_last, last)
    if start < 0:
        start, end = 0, end - start
        if run_last is not None:
            end = min(end, max(run_last, last))
    return start, end


def step_href(path: str, first: int, last: int | None, run_last: int | None,
              **query: object) -> str:
    """A link to `path` showing the window around steps `first`..`last`, marked at `first`."""
    start, end = step_window(first, first if last is None else last, run_last)
    pairs = {**{k: v for k, v in query.items() if v is not None},
             "start": start, "end": end, "mark": first}
    return f"{path}?{urlencode(pairs)}"


# findings that follow from another cause rather than signal one (zero gradients behind
# an overflowing layer): a card is ordered by its other findings' first step
SYMPTOM_KINDS = SYMPTOMS
LEADING_STEP = re.compile(r"^Step [\d,]+: ")


def incident_panel(twin: dict) -> dict:
    """The overview's findings panel: one card per incident (root cause), split into
    problems (open, warning or critical), handled ones (marked handled, quiet since:
    shown struck through under the problems), notes (open, info) and resolved ones, each
    ordered by severity, then cards of symptoms alone last, then by the first step of
    its leading signal. Each card
    carries its findings (for their messages), a title that names its first step, and
    links: its steps (a window centred on them, marked), its layer's own view and, for
    misaligned layers, the Layers page's table. Every count shown is the length of a
    list here."""
    findings = {f["id"]: f for items in twin["findings"].values() for f in items}
    run = twin["run"]
    run_id, run_last = run["id"], run.get("last_step")
    path = f"/runs/{quote(run_id)}"
    layer_index = twin.get("layer_index", {})
    cards: dict[str, list[dict]] = {"problems": [], "handled": [], "notes": [], "resolved": []}
    bundles = incident_bundles(twin["incidents"], twin.get("bundles") or [])
    for incident in twin["incidents"]:
        members = [{**findings[i], "message": told_in_card(findings[i], incident["cause"],
                                                           incident["headline"])}
                   for i in incident["findings"] if i in findings]
        if not members:
            continue
        rank = incident["rank"] if run["n_ranks"] > 1 else None
        card = {**incident, "members": members, "message": members[0]["message"],
                "title": card_title(incident, members, run),
                "lead_step": lead_step(incident, members),
                "href": (f"{path}/layers#misaligned"
                         if incident["cause"] == Cause.MISALIGNED else None),
                "bundle": bundles.get(incident["id"])}
        if incident["step"] is not None:
            card["step_href"] = step_href(path, incident["step"], incident["last_step"],
                                          run_last, rank=rank)
        card["timeline"] = [{**entry, "href": None if entry["step"] is None else
                             step_href(path, entry["step"], entry["step"], run_last, rank=rank)}
                            for entry in incident["timeline"]]
        index = layer_index.get(incident["layer"])
        if index is not None:
            card["layer_href"] = (step_href(f"{path}/layers/{index}", incident["step"],
                                            incident["last_step"], run_last,
                                            rank=incident["rank"])
                                  if incident["step"] is not None else
                                  f"{path}/layers/{index}?rank={incident['rank']}")
        group = ("handled" if incident["status"] == "handled" else
                 "resolved" if incident["status"] != "open" else
                 "problems" if incident["problem"] else "notes")
        cards[group].append(card)
    for group in cards.values():
        group.sort(key=lambda c: (-SEVERITY_RANK[c["severity"]], symptoms_only(c["members"]),
                                  c["lead_step"] is None, c["lead_step"] or 0, c["id"]))
    return cards


def symptoms_only(members: list[dict]) -> bool:
    """A card of symptoms alone (zero gradients) follows the cards with a signal of their
    own: while grouping has not folded it into its cause, the cause reads first."""
    return all(f["kind"] in SYMPTOM_KINDS for f in members)


def lead_step(incident: dict, members: list[dict]) -> int | None:
    """The first step of the incident's leading signal: of its findings that are not
    symptoms of another cause, else of all of them."""
    signals = [f["step"] for f in members
               if f["kind"] not in SYMPTOM_KINDS and f["step"] is not None]
    return min(signals, default=incident["step"])


def card_title(incident: dict, members: list[dict], run: dict) -> str:
    """What the card's heading says: the incident's headline (the API's and `ampwatch
    show`'s words: a risk reads "approaching fp16's maximum" in all three) or its
    finding's message; with the incident's first step in front, so that the title and the
    step range agree."""
    text = LEADING_STEP.sub("", incident["headline"] or members[0]["message"])
    if incident["step"] is None:
        return text
    return f"Step {incident['step']:,}: {text}"


