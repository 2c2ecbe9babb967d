"""The zoo's architectures, each built from a config (no download) at a size a CPU trains
in a few seconds, with a batch maker whose batches it learns (a few fixed batches cycled;
token sequences count up, so a batch of other tokens is foreign to the model).

Each `Arch` makes the model, its batch for a step (the root module's keyword arguments;
HF models take `labels` and return their loss) and names its attention modules as the
test sees them (by class: the truth does not ask the agent)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH, CYCLE = 64, 16, 4, 4


def _tokens(step: int) -> torch.Tensor:
    """Sequences counting up from a random start (the next token is learnable)."""
    gen = torch.Generator().manual_seed(step % CYCLE)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    return (start + torch.arange(SEQ)) % VOCAB


def _causal(step: int) -> dict[str, Any]:
    ids = _tokens(step)
    return {"input_ids": ids, "labels": ids}


def gpt2(tied: bool = True) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, tie_word_embeddings=tied))


def llama(attn: str = "sdpa") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation=attn))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=SEQ))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def _seq2seq(step: int) -> dict[str, Any]:
    ids = _tokens(step)
    return {"input_ids": ids, "labels": ids.flip(-1)}


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=4, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _images(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step % CYCLE)
    return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
            "labels": torch.randint(0, 4, (BATCH,), generator=gen)}


class Denoiser(nn.Module):
    """diffusers' UNet2DModel with its noise-prediction loss, so the root module's forward
    returns the loss a bundle replays."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers import UNet2DModel
        self.unet = UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
            attention_head_dim=8)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                noise: torch.Tensor) -> torch.Tensor:
        predicted = self.unet(sample + noise, timestep).sample
        return nn.functional.mse_loss(predicted.float(), noise.float())


def _noisy(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step % CYCLE)
    return {"sample": torch.randn(BATCH, 3, 8, 8, generator=gen),
            "timestep": torch.randint(0, 1000, (BATCH,), generator=gen),
            "noise": torch.randn(BATCH, 3, 8, 8, generator=gen) * 0.5}


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Any]]
    attention: tuple[str, ...]  # class names of its attention modules


GPT2 = Arch("gpt2", gpt2, _causal, ("GPT2Attention",))
GPT2_UNTIED = Arch("gpt2_untied", lambda: gpt2(tied=False), _causal, ("GPT2Attention",))
LLAMA = Arch("llama", llama, _causal, ("LlamaAttention",))
LLAMA_EAGER = Arch("llama_eager", lambda: llama("eager"), _causal, ("LlamaAttention",))
QWEN2 = Arch("qwen2", qwen2, _causal, ("Qwen2Attention",))
BERT = Arch("bert", bert, _causal, ("BertSelfAttention",))
T5 = Arch("t5", t5, _seq2seq, ("T5Attention",))
VIT = Arch("vit", vit, _images, ("ViTAttention", "ViTSelfAttention"))
UNET = Arch("unet", Denoiser, _noisy, ("Attention",))
ARCHS = (GPT2, LLAMA, LLAMA_EAGER, QWEN2, BERT, T5, VIT, UNET)


def loss_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


# issue 58's families: each a transformers class from a config, 2 layers, small hidden
def mixtral() -> nn.Module:
    """A mixture of experts with a router (`block_sparse_moe.gate`)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_local_experts=4, num_experts_per_tok=2))


def mamba() -> nn.Module:
    """A state-space model: no attention at all."""
    from transformers import MambaConfig, MambaForCausalLM
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                        num_hidden_layers=2, expand=2, conv_kernel=4))


def gemma2() -> nn.Module:
    """Soft-capped attention and output logits, tied embeddings, norms that upcast inside."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
        sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        tie_word_embeddings=True, attn_implementation="eager"))


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, decoder_start_token_id=2, pad_token_id=1))


def convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification
    return ConvNextForImageClassification(ConvNextConfig(
        num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
        num_labels=4, image_size=16))


def mistral() -> nn.Module:
    """A sliding-window decoder (window 8 of 16 tokens)."""
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        sliding_window=8, attn_implementation="eager"))


def gemma() -> nn.Module:
    """Norms that upcast inside: GemmaRMSNorm takes its variance of `x.float()` and casts
    the result back, so under fp16 autocast it returns fp16 but computes in fp32."""
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=SEQ,
        attn_implementation="eager"))


MIXTRAL = Arch("mixtral", mixtral, _causal, ("MixtralAttention",))
MAMBA = Arch("mamba", mamba, _causal, ())
GEMMA2 = Arch("gemma2", gemma2, _causal, ("Gemma2Attention",))
BART = Arch("bart", bart, _seq2seq, ("BartAttention",))
CONVNEXT = Arch("convnext", convnext, _images, ())
MISTRAL = Arch("mistral", mistral, _causal, ("MistralAttention",))
GEMMA = Arch("gemma", gemma, _causal, ("GemmaAttention",))
FAMILIES = (MIXTRAL, MAMBA, GEMMA2, BART, CONVNEXT, MISTRAL, GEMMA)
