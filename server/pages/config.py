"""A run's config as the pages show it: flattened on the run page, diffed on compare."""

from __future__ import annotations

import json


def flat_config(config: dict | None, prefix: str = "") -> dict[str, str]:
    """A run's config with nested keys dotted ("optimizer.lr"), values as JSON writes
    them, keys sorted."""
    flat: dict[str, str] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flat_config(value, f"{name}.")
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value,
                                                                         ensure_ascii=False)
    return dict(sorted(flat.items()))


def config_diff(runs: list[dict]) -> tuple[list[tuple[str, list[str | None]]], int]:
    """The config keys whose values differ between the compared runs (None: a run without
    that key), and how many keys they share with one value."""
    configs = [flat_config(run.get("config")) for run in runs]
    keys = sorted(set().union(*configs)) if configs else []
    differ = [(key, [c.get(key) for c in configs]) for key in keys
              if len({c.get(key) for c in configs}) > 1]
    return differ, len(keys) - len(differ)
