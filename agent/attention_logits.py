"""The largest attention logit of an attention call, and the output logits' largest
magnitude and log-partition, each on a bounded sample so the cost stays small.

Attention: of the first sequence in the batch, up to `ROWS` query rows (evenly spaced)
against every key, in up to `HEADS` heads (evenly spaced): `q k^T * scale`, its largest
magnitude. The mask is not applied (a masked logit is still a product the softmax would
see without the mask; its magnitude grows with the same weights). For
`nn.MultiheadAttention` the queries and keys are projected here with the module's own
weights; a `scaled_dot_product_attention` call hands them over projected.

Output: up to `ROWS * 4` rows of the logits (the last dimension is the vocabulary): the
largest |logit| and the mean over rows of `logsumexp` (the log-partition, log Z, that z-loss
pulls towards 0). Device ops only; nothing synchronises the device.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ROWS = 64
HEADS = 4
OUTPUT_ROWS = ROWS * 4


def _spread(n: int, limit: int, device: torch.device) -> torch.Tensor | None:
    """Up to `limit` evenly spaced indices of range(n); None when all of them."""
    if n <= limit:
        return None
    return torch.linspace(0, n - 1, limit, device=device).round().long()


def _pick(t: torch.Tensor, dim: int, limit: int) -> torch.Tensor:
    index = _spread(t.shape[dim], limit, t.device)
    return t if index is None else t.index_select(dim, index)


def sdpa_max_logit(query: torch.Tensor, key: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor | None:
    """|q k^T| * scale, largest over the sample; `query` (..., H, L, E), `key` (..., Hk, S, E)
    as `scaled_dot_product_attention` takes them (Hk may divide H: grouped queries)."""
    if (query.dim() < 2 or key.dim() != query.dim() or not query.is_floating_point()
            or not query.numel() or not key.numel()):
        return None
    while query.dim() > 3:  # the first sequence of every batch dimension
        query, key = query[0], key[0]
    if query.dim() == 2:  # one head, unbatched
        query, key = query.unsqueeze(0), key.unsqueeze(0)
    group = max(1, query.shape[0] // max(1, key.shape[0]))  # query heads per key head
    heads = _spread(query.shape[0], HEADS, query.device)
    if heads is None:
        heads = torch.arange(query.shape[0], device=query.device)
    else:
        query = query.index_select(0, heads)
    key = key.index_select(0, heads // group)
    query = _pick(query, 1, ROWS)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    logits = torch.matmul(query.float(), key.float().transpose(-2, -1))
    return logits.abs().amax() * scale


def scores_dtype(query: torch.Tensor, key: torch.Tensor) -> torch.dtype:
    """The dtype q k^T is computed from: autocast's where it is on for the query's device
    (it casts the inputs of the projections, of matmul and of scaled_dot_product_attention;
    float64 it leaves alone), else the wider of the query's and the key's. Host only."""
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (query.dtype, key.dtype):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(query.dtype, key.dtype)


def mha_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(query, key) of an `nn.MultiheadAttention` call (a forward pre-hook's arguments)."""
    query = args[0] if args else kwargs.get("query")
    key = args[1] if len(args) > 1 else kwargs.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    return query, key


def mha_max_logit(module: nn.MultiheadAttention, query: torch.Tensor,
                  key: torch.Tensor) -> torch.Tensor | None:
    """The same for an `nn.MultiheadAttention` call, from its inputs (`mha_inputs`): the
    sampled queries and all keys projected with the module's weights."""
    if query.dim() == 3:  # the first sequence of the batch
        query, key = (query[0], key[0]) if module.batch_first else (query[:, 0], key[:, 0])
    embed, heads = module.embed_dim, module.num_heads
    if module._qkv_same_embed_dim:
        w_q, w_k = module.in_proj_weight[:embed], module.in_proj_weight[embed: 2 * embed]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    b_q, b_k = (None, None) if bias is None else (bias[:embed], bias[embed: 2 * embed])
    query = _pick(query, 0, ROWS)
    q = nn.functional.linear(query.float(), w_q.float(), None if b_q is None else b_q.float())
    k = nn.functional.linear(key.float(), w_k.float(), None if b_k is None else b_k.float())
    head_dim = embed // heads
    # (rows, E) -> (heads, rows, head_dim), as the module splits them
    q = q.view(q.shape[0], heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], heads, head_dim).transpose(0, 1)
    return sdpa_max_logit(q, k)


def output_stats(logits: torch.Tensor) -> torch.Tensor | None:
    """(largest |logit|, mean log-partition) of up to OUTPUT_ROWS rows, as a (2,) float64
    tensor; None for a tensor that is not logits (fewer than 2 dimensions or classes)."""
    if (not isinstance(logits, torch.Tensor) or not logits.is_floating_point()
            or logits.dim() < 2 or logits.shape[-1] < 2 or not logits.numel()):
        return None
    rows = _pick(logits.detach().reshape(-1, logits.shape[-1]), 0, OUTPUT_ROWS).float()
    return torch.stack([rows.abs().amax(), torch.logsumexp(rows, dim=-1).mean()]).double()
