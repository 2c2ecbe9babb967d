"""A tiny causal transformer language model for the spike suite, and its training data.

One or two pre-LN blocks whose attention calls `scaled_dot_product_attention` (the path
modern models take), optional qk-layernorm, an untied output layer. The data is a
learnable next-token task (each sequence counts up from a random start by a random
stride, modulo the vocabulary, with a little noise: predicting it needs attention), so
the loss falls steadily and a spike stands out.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 32
SEQ = 16
D_MODEL = 32
HEADS = 2


class Attention(nn.Module):
    """Causal self-attention through `F.scaled_dot_product_attention`; `qk_norm` puts a
    LayerNorm on queries and keys (per head), which bounds their product."""

    def __init__(self, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = HEADS  # names it an attention block (agent/layers.py): a layer
        self.q = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.k = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.v = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.out = nn.Linear(D_MODEL, D_MODEL, bias=False)
        head_dim = D_MODEL // HEADS
        self.q_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim) if qk_norm else nn.Identity()

    def split(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, HEADS, D_MODEL // HEADS).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.split(self.q(x)))
        k = self.k_norm(self.split(self.k(x)))
        v = self.split(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, qk_norm: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention(qk_norm)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(),
                                 nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Linear):
    """The output layer, with one more parameter: `shift`, added to every logit through the
    bias (so under bf16 autocast the shifted logits are rounded to bf16). Cross-entropy
    cannot see a shift of every logit; z-loss can."""

    def __init__(self) -> None:
        super().__init__(D_MODEL, VOCAB)
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias + self.shift)


class TinyLM(nn.Module):
    def __init__(self, qk_norm: bool = False, blocks: int = 1, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.Sequential(*[Block(qk_norm) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = Head()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def batch(step: int, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of step `step`: sequences counting up from a random start by a
    random stride of 1 to 3 (so the next token needs the one before: attention), with 10%
    of the tokens replaced at random."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 4, (size, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(tokens.shape, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=gen), tokens)
    return tokens[:, :-1], tokens[:, 1:]
