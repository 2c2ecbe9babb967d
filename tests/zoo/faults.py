"""The zoo's seeded faults (tests/zoo/loop.py trains them; test_faults.py and
bench/zoo_table.py judge them)."""

from __future__ import annotations

import torch

from tests.zoo import models
from tests.zoo.loop import Fault, foreign_tokens, nan_input, weights

BACKWARD_AT, FORWARD_AT, NAN_AT, GROWTH_FROM, BAD_BATCH_AT = 40, 20, 20, 20, 60

# issue 44's case: block 1's MLP input weight x1e4; every forward output stays finite, the
# activation's backward (tanh-GELU, x^3 overflowing fp16) is the first to go non-finite
GPT2_BACKWARD = Fault("gpt2_backward_overflow", models.GPT2,
                      "transformer.h.1.mlp.c_fc's weight x1e4 at step 40 (tied lm_head)",
                      inject=weights("transformer.h.1.mlp.c_fc.weight", 1e4, BACKWARD_AT),
                      steps=70)
GPT2_UNTIED_BACKWARD = Fault(
    "gpt2_untied_backward_overflow", models.GPT2_UNTIED,
    "the same, with tie_word_embeddings=False", inject=GPT2_BACKWARD.inject, steps=70)
# T5's classic: its feed-forward output overflows fp16
T5_FORWARD = Fault("t5_ff_overflow", models.T5,
                   "encoder.block.1's feed-forward wo weight x2e5 at step 20",
                   inject=weights("encoder.block.1.layer.1.DenseReluDense.wo.weight", 2e5,
                                  FORWARD_AT), steps=30)
VIT_NAN = Fault("vit_nan_input", models.VIT, "a NaN pixel at step 20",
                inject=nan_input("pixel_values", NAN_AT), steps=30)
# the high-LR regime's mechanism, pushed directly: layer 1's q and k projections grow 6% a
# step, so its attention logits grow 12% a step
LLAMA_ATTENTION = Fault(
    "llama_attention_growth", models.LLAMA, "layer 1's q/k projections x1.06 a step from 20",
    inject=lambda i, model, batch: _grow(
        weights("model.layers.1.self_attn.q_proj.weight", 1.06, GROWTH_FROM, True),
        weights("model.layers.1.self_attn.k_proj.weight", 1.06, GROWTH_FROM, True),
        i, model, batch),
    steps=90, dtype=torch.bfloat16, scaler=False)
# the output logits drifting: the untied LM head grows 6% a step
LLAMA_OUTPUT = Fault("llama_output_growth", models.LLAMA, "lm_head weight x1.1 a step from 20",
                     inject=weights("lm_head.weight", 1.1, GROWTH_FROM, True), steps=90,
                     dtype=torch.bfloat16, scaler=False)
GPT2_BAD_BATCH = Fault("gpt2_bad_batch", models.GPT2, "one batch of foreign tokens at step 60",
                       inject=foreign_tokens(BAD_BATCH_AT, models.VOCAB), steps=90,
                       dtype=torch.bfloat16, scaler=False, lr=1e-2)


def _grow(first, second, i, model, batch):  # noqa: ANN001, ANN202 - two injections at once
    return second(i, model, first(i, model, batch))


HEALTHY = {arch.name: Fault(f"{arch.name}_healthy", arch, "no fault", steps=30)
           for arch in (models.GPT2, models.LLAMA, models.BERT, models.T5, models.VIT,
                        models.UNET)}
