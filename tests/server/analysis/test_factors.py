"""The ranking of settings by how well each alone separates unhealthy runs, on hand-made
runs (server/analysis/factors.py)."""

from __future__ import annotations

import random

from ampwatch.server.analysis.factors import RunSettings, flatten, rank_factors

LRS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)


def sweep(**derived) -> list[RunSettings]:
    """12 runs: each lr with seeds 0 and 1; lr >= 0.1 critical, but lr 0.1 seed 1
    (warning); `derived` keys are functions of lr."""
    runs = []
    for lr in LRS:
        for seed in (0, 1):
            outcome = "healthy" if lr < 0.1 else "warning" if (lr, seed) == (0.1, 1) else "critical"
            settings = {"lr": lr, "seed": seed, "optimizer": "adamw",
                        **{key: f(lr) for key, f in derived.items()}}
            runs.append(RunSettings(f"lr{lr}-s{seed}", outcome, settings))
    return runs


def by_key(factors):
    return {f.key: f for f in factors}


def test_the_key_that_breaks_training_ranks_first_with_its_threshold():
    factors = rank_factors(sweep())
    lr = factors[0]
    assert (lr.key, lr.kind, lr.threshold, lr.score) == ("lr", "numeric", 0.1, 1.0)
    assert lr.separates and lr.verdict == "separates exactly"
    assert lr.summary == ("lr >= 0.1: 4 of 4 unhealthy (3 critical, 1 warning); "
                          "lr < 0.1: 0 of 8 unhealthy")
    assert [(s.runs, s.warning, s.critical) for s in lr.sides] == [(4, 1, 3), (8, 0, 0)]


def test_a_seed_does_not_separate_and_says_so():
    seed = by_key(rank_factors(sweep()))["seed"]
    assert seed.score == 0 and not seed.separates
    assert seed.verdict.startswith("does not separate")


def test_a_key_with_one_value_ranks_last():
    factors = rank_factors(sweep())
    assert factors[-1].key == "optimizer" and factors[-1].kind == "constant"
    assert factors[-1].verdict == "one value in every run: cannot tell"


def test_a_value_per_run_splits_a_few_runs_by_luck_only():
    """Names unique to each run "explain" every outcome; shuffled outcomes do as well."""
    runs = [RunSettings(r.id, r.outcome, {**r.settings, "name": r.id}) for r in sweep()]
    name = by_key(rank_factors(runs))["name"]
    assert name.kind == "categorical" and name.score == 1.0
    assert not name.separates and name.chance == 1.0


def test_keys_that_move_together_are_confounded_and_credited_once():
    factors = rank_factors(sweep(warmup=lambda lr: lr * 100, width=lambda lr: -lr,
                                 schedule=lambda lr: "hot" if lr > 0.02 else "cold"))
    found = by_key(factors)
    assert factors[0].key == "lr"
    assert set(found["lr"].confounded_with) == {"warmup", "width"}
    assert found["warmup"].confounded_with == ["lr", "width"]
    assert not found["warmup"].credited and "moves with lr" in found["warmup"].verdict
    assert "either may be the cause" in found["lr"].verdict
    # schedule splits the runs another way: its own key, not confounded
    assert found["schedule"].confounded_with == [] and found["schedule"].credited
    credited = [f.key for f in factors if f.credited and f.kind != "constant"]
    assert credited.index("schedule") < [f.key for f in factors].index("warmup")


def test_a_monotone_but_not_one_to_one_key_is_confounded():
    """warmup = min(lr * 100, 5): a monotone function of lr that merges its top values."""
    found = by_key(rank_factors(sweep(warmup=lambda lr: min(lr * 100, 5))))
    assert "warmup" in found["lr"].confounded_with


def test_categorical_values_and_runs_without_the_key():
    runs = [RunSettings(str(i), "critical" if i % 3 == 0 else "healthy",
                        {"dtype": "fp16" if i % 3 == 0 else "bf16",
                         **({"clip": 1.0} if i % 2 else {})}) for i in range(12)]
    found = by_key(rank_factors(runs))
    dtype = found["dtype"]
    assert dtype.separates and dtype.values == ["fp16", "bf16"]
    assert dtype.summary == ("dtype = fp16: 4 of 4 unhealthy (4 critical); "
                             "dtype = bf16: 0 of 8 unhealthy")
    clip = found["clip"]  # one value where set: set or not is its split
    assert [s.label for s in clip.sides] == ["clip = 1.0", "clip not set"]


def test_nothing_to_separate_when_every_run_is_healthy():
    runs = [RunSettings(str(i), "healthy", {"lr": 10.0 ** -i}) for i in range(5)]
    lr = rank_factors(runs)[0]
    assert lr.chance is None and not lr.separates
    assert lr.verdict == "every run has the same outcome: nothing to separate"


def test_the_ranking_is_the_same_on_every_read():
    rng = random.Random(3)
    runs = [RunSettings(str(i), rng.choice(["healthy", "warning", "critical"]),
                        {"a": rng.random(), "b": rng.choice("xyz")}) for i in range(200)]
    first, again = rank_factors(runs), rank_factors(list(runs))
    assert [(f.key, f.score, f.chance) for f in first] == [(f.key, f.score, f.chance)
                                                           for f in again]


def test_flatten_dots_nested_keys_and_keeps_lists_as_values():
    assert flatten({"optimizer": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 1, "none": None},
                   "") == {"optimizer.lr": 0.1, "optimizer.betas": "[0.9,0.99]", "seed": 1}


def test_at_equal_scores_one_threshold_ranks_before_many_values():
    """Each host ran one lr and seed, twice: hosts separate as exactly as lr does, with
    twelve sides."""
    runs = [RunSettings(f"{r.id}-{i}", r.outcome, {**r.settings, "host": r.id})
            for i, r in enumerate(sweep() * 2)]
    found = rank_factors(runs)
    assert [f.key for f in found][:2] == ["lr", "host"]
    assert found[1].separates and found[1].confounded_with == []
