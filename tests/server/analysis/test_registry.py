"""The detector registry holds every detector and every finding kind: a kind or a
detector that someone forgot to register fails here, not silently in production."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections import defaultdict

import pytest

from ampwatch.server import analysis
from ampwatch.server.analysis.draft import FindingDraft
from ampwatch.server.analysis.kinds import KINDS, FindingKind, Section
from ampwatch.server.analysis.registry import DETECTORS
from ampwatch.server.analysis.window import Window


def _detect_functions() -> dict[str, object]:
    """Every public `detect_*` function defined in a module of the analysis package."""
    found = {}
    for info in pkgutil.iter_modules(analysis.__path__):
        module = importlib.import_module(f"{analysis.__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("detect_") and inspect.isfunction(value) \
                    and value.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_detect_function_is_registered_with_the_one_signature():
    registered = {spec.detect for spec in DETECTORS}
    functions = _detect_functions()
    assert functions, "the scan found no detectors"
    for name, detect in functions.items():
        assert detect in registered, f"{name} is not in registry.DETECTORS: it never runs"
        params = list(inspect.signature(detect).parameters.values())
        assert [p.name for p in params] == ["window", "settings"], name
        assert params[0].annotation in (Window, "Window"), name


def test_every_kind_is_declared_once_and_raised_by_a_registered_detector():
    assert set(KINDS) == set(FindingKind)
    assert all(spec.kind == kind for kind, spec in KINDS.items())
    raised = {kind for spec in DETECTORS for kind in spec.kinds}
    assert raised == set(FindingKind), f"no detector raises {set(FindingKind) - raised}"


def _emitted_kinds() -> dict[str, set[FindingKind]]:
    """The kinds each analysis module's `FindingDraft(kind=...)` calls can emit, read from
    its source: a module constant or `FindingKind.X`; a kind passed in (a helper's
    parameter) may be any of the module's FindingKind constants."""
    emitted: dict[str, set[FindingKind]] = defaultdict(set)
    for info in pkgutil.iter_modules(analysis.__path__):
        module = importlib.import_module(f"{analysis.__name__}.{info.name}")
        constants = {v for v in vars(module).values() if isinstance(v, FindingKind)}
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == FindingDraft.__name__):
                continue
            (kind,) = [k.value for k in node.keywords if k.arg == "kind"]
            try:
                value = eval(ast.unparse(kind), vars(module))  # a name or FindingKind.X
            except NameError:  # a variable: one of the module's kinds
                emitted[module.__name__] |= constants
                continue
            assert isinstance(value, FindingKind), (module.__name__, ast.unparse(kind))
            emitted[module.__name__].add(value)
    return emitted


def test_detectors_emit_exactly_the_kinds_the_registry_says():
    """The registry's `kinds` is what each detector's module writes into its drafts: a
    detector that raises a kind the registry does not list (or lists one it never raises)
    fails here."""
    declared: dict[str, set[FindingKind]] = defaultdict(set)
    for spec in DETECTORS:
        declared[spec.detect.__module__].update(spec.kinds)
    emitted = _emitted_kinds()
    assert emitted, "the scan found no FindingDraft"
    assert set(emitted) <= set(declared), "drafts built outside a detector's module"
    assert dict(emitted) == dict(declared)
    assert set().union(*emitted.values()) == set(FindingKind)


def test_a_draft_holds_a_kind_member_and_refuses_an_unknown_kind():
    draft = FindingDraft(kind="nonfinite", key="k", severity="warning", message="m")  # type: ignore[arg-type]
    assert draft.kind is FindingKind.NONFINITE
    with pytest.raises(ValueError, match="no_such_kind"):
        FindingDraft(kind="no_such_kind", key="k", severity="warning", message="m")  # type: ignore[arg-type]


def test_every_kind_has_its_words():
    for spec in KINDS.values():
        assert spec.summary and spec.fix, spec.kind
        assert spec.section in Section


def test_openapi_lists_the_kinds_as_an_enum(api):
    schema = api.get("/openapi.json").json()
    kinds = sorted(str(k) for k in FindingKind)
    finding_kind = schema["components"]["schemas"]["FindingPublic"]["properties"]["kind"]
    ref = finding_kind["$ref"].rsplit("/", 1)[-1]
    assert sorted(schema["components"]["schemas"][ref]["enum"]) == kinds
    params = schema["paths"]["/api/v1/findings"]["get"]["parameters"]
    kind_param = next(p for p in params if p["name"] == "kind")
    for kind in kinds:
        assert f"`{kind}`" in kind_param["description"]
        assert api.get("/api/v1/findings", params={"kind": kind}).status_code == 200
    assert api.get("/api/v1/findings", params={"kind": "no_such_kind"}).status_code == 422


def test_the_architecture_doc_names_every_kind():
    """docs/architecture.md's table of kinds is the one a newcomer reads."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "architecture.md").read_text()
    missing = [kind for kind in FindingKind if f"`{kind}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
