"""The detector registry holds every detector and every finding kind: a kind or a
detector that someone forgot to register fails here, not silently in production."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from ampwatch.server import analysis
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
