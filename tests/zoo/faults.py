"""The zoo's seeded faults (tests/zoo/loop.py trains them; test_faults.py and
bench/zoo_table.py judge them)."""

from __future__ import annotations

import torch

from tests.zoo import models
from tests.zoo.loop import Fault, foreign_tokens, nan_embeddings, nan_input, weights

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

# issue 58: the new families, each with its own seeded fault and a healthy control
POISON_AT, LR_JUMP_AT, LATE_GROWTH_FROM = 30, 30, 40
# a NaN in the input embeddings of a bf16 run with no scaler: its update is applied, every
# weight is NaN from the next step: one cause (the input), not a second card on the weights
MAMBA_NAN_EMBEDS = Fault("mamba_nan_embeddings", models.MAMBA,
                         "a NaN in the input embeddings at step 30 (bf16: the update applies)",
                         inject=nan_embeddings(POISON_AT), steps=40, dtype=torch.bfloat16,
                         scaler=False)
CONVNEXT_NAN = Fault("convnext_nan_input", models.CONVNEXT,
                     "a NaN pixel at step 30 (bf16: the update applies)",
                     inject=nan_input("pixel_values", POISON_AT), steps=40,
                     dtype=torch.bfloat16, scaler=False)
# the learning rate x50 while the loss still falls fast
MISTRAL_LR_JUMP = Fault("mistral_lr_jump", models.MISTRAL,
                        "the learning rate x50 at step 30, loss still falling fast",
                        lr_jump=(LR_JUMP_AT, 50.0), steps=50, dtype=torch.bfloat16,
                        scaler=False, lr=3e-3)
# the learning rate x10 at a rate low enough that no spike follows: a convnet, no attention
CONVNEXT_LR_RISE = Fault("convnext_lr_rise", models.CONVNEXT,
                         "the learning rate x10 at step 30, no loss spike",
                         lr_jump=(LR_JUMP_AT, 10.0), steps=50, dtype=torch.bfloat16,
                         scaler=False, lr=1e-4)
# a slow growth that starts late: the MLP's output projection x1.06 a step from step 40
GEMMA2_LATE_GROWTH = Fault(
    "gemma2_late_growth", models.GEMMA2, "layer 1's down_proj x1.06 a step from 40",
    inject=weights("model.layers.1.mlp.down_proj.weight", 1.06, LATE_GROWTH_FROM, True),
    steps=90, dtype=torch.bfloat16, scaler=False)
# q and k of one attention scaled together: one cause, one card
MIXTRAL_QK = Fault(
    "mixtral_qk_growth", models.MIXTRAL, "layer 1's q/k projections x1.06 a step from 20",
    inject=lambda i, model, batch: _grow(
        weights("model.layers.1.self_attn.q_proj.weight", 1.06, GROWTH_FROM, True),
        weights("model.layers.1.self_attn.k_proj.weight", 1.06, GROWTH_FROM, True),
        i, model, batch),
    steps=90, dtype=torch.bfloat16, scaler=False)
BART_QK = Fault(
    "bart_qk_growth", models.BART, "the encoder's q/k projections x1.06 a step from 20",
    inject=lambda i, model, batch: _grow(
        weights("model.encoder.layers.0.self_attn.q_proj.weight", 1.06, GROWTH_FROM, True),
        weights("model.encoder.layers.0.self_attn.k_proj.weight", 1.06, GROWTH_FROM, True),
        i, model, batch),
    steps=90, dtype=torch.bfloat16, scaler=False)
# the router's weights growing under fp16: its forward grows, its backward overflows
MIXTRAL_ROUTER = Fault(
    "mixtral_router_growth", models.MIXTRAL, "layer 0's router x1.15 a step from 20 (fp16)",
    inject=weights("model.layers.0.mlp.gate.weight", 1.15, GROWTH_FROM, True), steps=80)
# norms that upcast inside, under fp16 autocast with a GradScaler: one MLP weight x1e4;
# the scaler's backoffs that follow are the jump's, not a precision problem
GEMMA_JUMP = Fault("gemma_fp16_weight_jump", models.GEMMA,
                   "layer 1's down_proj weight x1e6 at step 20 (fp16, GradScaler)",
                   inject=weights("model.layers.1.mlp.down_proj.weight", 1e6, FORWARD_AT),
                   steps=40)
FAMILY_FAULTS = (MAMBA_NAN_EMBEDS, CONVNEXT_NAN, MISTRAL_LR_JUMP, GEMMA2_LATE_GROWTH,
                 MIXTRAL_QK, BART_QK, MIXTRAL_ROUTER, GEMMA_JUMP)
# bf16 without a scaler, but the family whose norms upcast inside in fp16 with one (where
# a norm judged by its output dtype was warned "computed in float16")
FAMILY_HEALTHY = {arch.name: (Fault(f"{arch.name}_healthy", arch, "no fault", steps=60)
                              if arch is models.GEMMA else
                              Fault(f"{arch.name}_healthy", arch, "no fault", steps=60,
                                    dtype=torch.bfloat16, scaler=False))
                  for arch in models.FAMILIES}
GEMMA_HEALTHY = FAMILY_HEALTHY["gemma"]


def gemma_with(norm: type) -> Fault:
    """Gemma's healthy control with every RMSNorm replaced by `norm(hidden)`."""
    def build() -> torch.nn.Module:
        model = models.gemma()
        for name, module in list(model.named_modules()):
            if type(module).__name__ == "GemmaRMSNorm":
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, norm(module.weight.numel()))
        return model
    arch = models.Arch("gemma_fp16_norms", build, models.GEMMA.batch, models.GEMMA.attention)
    return Fault("gemma_fp16_norms", arch, "norms without the upcast", steps=30)
