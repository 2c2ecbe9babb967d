"""An app made for one test does not outlive it: the test process used to end at about
2 GB resident because every test's app (about 4 MB) stayed reachable from FastAPI's
module-level caches of endpoint callables (tests/conftest.py releases them after each
test). The two tests run in file order: the first keeps a weak reference to its app,
the second checks that nothing else does."""

from __future__ import annotations

import gc
import weakref

_made: list[weakref.ref] = []


def test_a_test_makes_an_app_and_uses_it(api, app) -> None:
    assert api.get("/api/v1/health").status_code == 200
    assert api.get("/docs").status_code == 200  # the docs endpoints that closed over it
    _made.append(weakref.ref(app))


def test_the_app_is_gone_once_its_test_is_over() -> None:
    assert _made, "the test before this one did not run"
    gc.collect()
    assert [ref for ref in _made if ref() is not None] == []
