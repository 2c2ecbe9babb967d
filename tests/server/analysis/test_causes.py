"""Incident causes are declared once (server/analysis/causes.py): every cause the code
names or emits is a member, and every member is named somewhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ampwatch.server.analysis import localize, nonfinite
from ampwatch.server.analysis.causes import Cause
from ampwatch.server.analysis.kinds import FROM_EVIDENCE, KINDS
from ampwatch.server.findings import incident_folds, incidents

SERVER = Path(__file__).resolve().parents[3] / "server"
DECLARED = {cause.value for cause in Cause}


def _strings(node: ast.AST | None) -> set[str]:
    """The string constants `node` is or holds (a tuple or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return set().union(*(_strings(item) for item in node.elts))
    return set()


def _names_cause(node: ast.AST) -> bool:
    """Whether `node` reads a cause: not a spike's label (`cause.label`) nor the layer of a
    (cause, layer) key (`cause[1]`)."""
    if isinstance(node, ast.Attribute) and node.attr == "label":
        return False
    if isinstance(node, ast.Subscript) and _strings(node.slice) == set() \
            and getattr(node.slice, "value", 0) != 0:
        return False
    return "cause" in ast.unparse(node).lower()


def cause_literals(tree: ast.AST) -> set[str]:
    """Strings in a cause's place: `cause=...`, `{"cause": ...}`, `x.cause == ...`,
    `evidence.get("cause") in (...)`."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("cause", "follows"):
            found |= _strings(node.value)
        elif isinstance(node, ast.Dict):
            found |= {v for key, value in zip(node.keys, node.values, strict=True)
                      if _strings(key) == {"cause"} for v in _strings(value)}
        elif isinstance(node, ast.Compare) and _names_cause(node.left):
            found |= set().union(*(_strings(c) for c in node.comparators))
    return found


def test_every_cause_the_source_names_is_declared():
    undeclared = {f"{path.relative_to(SERVER)}: {literal!r}"
                  for path in SERVER.rglob("*.py")
                  for literal in cause_literals(ast.parse(path.read_text()))
                  if literal not in DECLARED}
    assert not undeclared, sorted(undeclared)


def test_every_cause_the_tables_emit_is_declared():
    emitted = {spec.cause for spec in KINDS.values()} - {FROM_EVIDENCE, None}
    emitted |= {cause for spec in KINDS.values() for cause in spec.follows}
    emitted |= set(localize.CAUSES) | set(nonfinite.GROUPS) | set(incident_folds.AFTER_WEIGHTS)
    emitted |= set(incidents.SAME_CAUSE) | set(incidents.SAME_CAUSE.values())
    assert all(isinstance(cause, Cause) for cause in emitted), emitted - set(Cause)


def test_every_declared_cause_is_used():
    source = "\n".join(path.read_text() for path in SERVER.rglob("*.py")
                       if path.name != "causes.py")
    used = set(re.findall(r"\bCause\.([A-Z_]+)\b", source))
    assert used <= set(Cause.__members__), used - set(Cause.__members__)
    assert set(Cause.__members__) <= used, f"unused: {set(Cause.__members__) - used}"
