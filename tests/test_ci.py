"""CI installs pinned releases: .ci/run and the README's test command install with
.ci/constraints.txt, and it pins every package the `dev` extra names (.ci/newest checks
the newest releases apart)."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PINNED_INSTALL = 'pip install -q torch==2.13.0 -c .ci/constraints.txt -e ".[dev]"'


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dev_requirements() -> set[str]:
    """The packages `.[dev]` names: the dependencies, the dev extra and the ampwatch[...]
    extras it pulls in."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {"": project["dependencies"], **project["optional-dependencies"]}
    names, todo, seen = set(), ["", "dev"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for line in extras[extra]:
            requirement = Requirement(line)
            if requirement.name == "ampwatch":
                todo += [name for name in requirement.extras if name not in seen]
            else:
                names.add(canonical(requirement.name))
    return names


def pins() -> dict[str, str]:
    """The constraints file's lines as {canonical name: the whole line}."""
    lines = (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
    return {canonical(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]): line
            for line in (line.split("#", 1)[0].strip() for line in lines) if line}


def test_ci_and_the_readme_install_with_the_constraints() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    [ci_command] = [line for line in run.splitlines() if "pip install" in line]
    assert PINNED_INSTALL in ci_command
    assert ci_command in readme  # verbatim, as .ci/run says


def test_every_dev_requirement_is_pinned_exactly() -> None:
    names = dev_requirements()
    assert {"torch", "transformers", "accelerate", "lightning", "diffusers", "torchao",
            "triton", "pytest"} <= names
    pinned = pins()
    for name in sorted(names):
        assert name in pinned, f"{name} is not in .ci/constraints.txt"
        assert re.fullmatch(r"[\w.-]+==[\w.]+", pinned[name]), pinned[name]
    assert not [line for line in pinned.values() if "+" in line]  # no local labels (+cpu)


def test_the_newest_releases_check_is_executable() -> None:
    newest = ROOT / ".ci" / "newest"
    assert newest.stat().st_mode & 0o111
    assert "tests/integrations" in newest.read_text()
