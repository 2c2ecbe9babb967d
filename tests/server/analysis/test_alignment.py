"""Misaligned layers: exact dimensions, padded values, parameter share, per-dtype rules."""

from __future__ import annotations

import pytest

from ampwatch.server.analysis.alignment import detect_misaligned_layers
from ampwatch.server.analysis.context import LayerInfo
from ampwatch.server.analysis.window import Window
from ampwatch.server.store.series import StepSeries
from tests.server.analysis.factories import (
    SETTINGS,
    activations,
    context,
    drafts_by_key,
    linear,
    series,
    step,
)

EMPTY = StepSeries.empty(3)


def model():
    return [
        LayerInfo(0, "wte", "Embedding", 50257 * 256,
                  {"num_embeddings": 50257, "embedding_dim": 256}, 0),
        linear(1, "proj", 256, 64),
        linear(2, "head", 64, 127),
    ]


def detect(layers, dtype="float16", data=EMPTY, **env):
    run = context(layers, {"autocast_dtype": dtype, **env})
    return drafts_by_key(detect_misaligned_layers(Window(data, run), SETTINGS))


def test_flags_exactly_the_misaligned_dimensions_with_padded_values():
    drafts = detect(model())
    # an untied embedding is a lookup, not a matmul: its vocabulary is not flagged
    assert set(drafts) == {"misaligned_layer:head:out_features"}
    head = drafts["misaligned_layer:head:out_features"]
    assert head.layer == "head"
    # FLOPs per token: proj 256 x 64, head 64 x 127
    share = round(64 * 127 / (256 * 64 + 64 * 127), 4)
    assert head.evidence == {
        "type": "Linear", "dimension": "out_features", "value": 127, "multiple": 8,
        "padded": 128, "optimal": 128, "dtype": "float16", "param_count": 64 * 127 + 127,
        "flops_share": share}
    assert "128" in head.message and "matmul FLOPs" in head.message
    assert head.severity == "warning"  # a third of the matmul work, whatever its params


def test_severity_follows_the_share_of_matmul_flops_not_of_parameters():
    # the embedding holds most parameters but does no matmul
    layers = [LayerInfo(0, "emb", "Embedding", 1001 * 64,
                        {"num_embeddings": 1001, "embedding_dim": 64}, 0),
              linear(1, "up", 64, 127), linear(2, "down", 127, 64)]
    drafts = detect(layers)
    assert set(drafts) == {"misaligned_layer:up:out_features",
                           "misaligned_layer:down:in_features"}
    assert {d.severity for d in drafts.values()} == {"warning"}
    # the same odd layer fed 4 tokens beside a layer fed 512 does a small share of the work
    layers = [linear(0, "big", 64, 1024, token_count=512), linear(1, "odd", 1024, 127,
                                                                  token_count=4)]
    odd = detect(layers)["misaligned_layer:odd:out_features"]
    assert odd.severity == "info" and odd.evidence["flops_share"] < 0.02


def test_a_tied_lm_head_reports_the_vocabulary_once():
    layers = [LayerInfo(0, "wte", "Embedding", 50257 * 768,
                        {"num_embeddings": 50257, "embedding_dim": 768}, 0),
              linear(1, "mlp", 768, 768),
              LayerInfo(2, "lm_head", "Linear", 0,
                        {"in_features": 768, "out_features": 50257, "tied_to": "wte"}, 2)]
    drafts = detect(layers)
    assert set(drafts) == {"misaligned_layer:lm_head:out_features"}
    head = drafts["misaligned_layer:lm_head:out_features"]
    assert head.evidence["padded"] == 50264 and head.evidence["optimal"] == 50304
    assert head.evidence["tied_embedding"] == "wte" and head.severity == "warning"
    assert "'wte'" in head.message and "vocabulary" in head.message


@pytest.mark.parametrize(("dtype", "env", "multiple"), [
    ("bfloat16", {}, 8),
    ("float8_e4m3fn", {}, 16),
    ("int8", {}, 16),
    ("float32", {"allow_tf32": True}, 4),
])
def test_alignment_follows_the_compute_dtype(dtype, env, multiple):
    layers = [linear(0, in_features=72, out_features=12), linear(1, in_features=96,
                                                                  out_features=100)]
    drafts = detect(layers, dtype, **env)
    expected = {f"misaligned_layer:fc{i}:{dim}"
                for i, dims in enumerate([(72, 12), (96, 100)])
                for dim, value in zip(("in_features", "out_features"), dims, strict=True)
                if value % multiple}
    assert set(drafts) == expected
    assert all(d.evidence["multiple"] == multiple for d in drafts.values())


def test_plain_fp32_and_unknown_dtype_raise_nothing():
    assert detect(model(), "float32") == {}
    run = context(model(), {"autocast_dtype": None})
    result = detect_misaligned_layers(Window(EMPTY, run), SETTINGS)
    assert result.drafts == [] and not result.covered("misaligned_layer:head:out_features")


def test_attention_head_size_and_token_count():
    layers = [LayerInfo(0, "attn", "MultiheadAttention", 4 * 96 * 96,
                        {"embed_dim": 96, "num_heads": 8}, 0),
              LayerInfo(1, "blocks", "Block", 0, {"token_count": 1001}, 1)]
    drafts = detect(layers)
    assert set(drafts) == {"misaligned_layer:attn:head_dim",
                           "misaligned_layer:blocks:token_count"}
    assert drafts["misaligned_layer:attn:head_dim"].evidence["padded"] == 16
    assert drafts["misaligned_layer:blocks:token_count"].evidence["padded"] == 1008


def test_dtype_from_steps_and_time_share():
    steps = [step(s, n_layers=3, autocast_dtype="bfloat16") for s in range(10)]
    steps[5]["activations"] = activations([1.0, 1.0, 1.0], "bfloat16", [1.0, 1.0, 2.0])
    run = context(model(), {"autocast_dtype": None})
    drafts = drafts_by_key(detect_misaligned_layers(Window(series(steps, 3), run), SETTINGS))
    assert drafts["misaligned_layer:head:out_features"].evidence["time_share"] == 0.5
    assert drafts["misaligned_layer:head:out_features"].evidence["dtype"] == "bfloat16"
