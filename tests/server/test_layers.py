"""The server's layers (docs/architecture.md, "Inside the server"): imports point down,
http/api/pages -> services -> store, schemas and models, and the top level stays small."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
PREFIX = "ampwatch.server."
# what each lower layer may import of the server (besides its own package)
ALLOWED = {
    "store": {"store", "models", "db", "errors", "fields", "schemas"},
    "schemas": {"schemas", "fields"},
    "services": {"services", "store", "schemas", "models", "db", "errors", "fields",
                 "settings", "analysis", "findings", "worker", "responses", "budget"},
}
NEVER = {"pages": {"api"}, "api": {"pages"}, "findings": {"api", "pages", "http"},
         "analysis": {"api", "pages", "http", "services"}}


def server_imports(path: Path) -> set[str]:
    """The server modules `path` imports, as dotted names below ampwatch.server."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PREFIX):
                found.add(node.module.removeprefix(PREFIX))
            elif node.module == "ampwatch.server":
                found.update(alias.name for alias in node.names)
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((SERVER / package).rglob("*.py"))


def test_lower_layers_import_nothing_above_them():
    wrong = {f"{path.relative_to(SERVER)} -> {name}"
             for package, allowed in ALLOWED.items() for path in modules_of(package)
             for name in server_imports(path) if name.split(".")[0] not in allowed}
    assert not wrong, sorted(wrong)


def test_no_package_imports_across_its_wall():
    wrong = {f"{path.relative_to(SERVER)} -> {name}"
             for package, banned in NEVER.items() for path in modules_of(package)
             for name in server_imports(path) if name.split(".")[0] in banned}
    assert not wrong, sorted(wrong)


def test_every_middleware_lives_in_http():
    outside = {f"{path.relative_to(SERVER)}: {node.name}" for path in SERVER.rglob("*.py")
               if path.parent.name != "http"
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef) and node.name.endswith("Middleware")}
    assert not outside, sorted(outside)


def test_the_top_level_holds_at_most_20_modules():
    assert len(list(SERVER.glob("*.py"))) <= 20
