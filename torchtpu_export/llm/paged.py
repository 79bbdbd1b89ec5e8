"""Attention over a paged KV cache, as one op of its own: ``tte::paged_attention``.

A paged step (``llm.contract.paged_inputs``) keeps every layer's keys and values in one pool of pages ``[kv_heads,
pages, page, dim]`` shared by the batch's rows; row ``b``'s position ``p`` is slot ``p % page`` of pool page
``page_table[b, p // page]``. Attention reads a row's pages in sequence order, causally: query ``i`` of row ``b``
(at position ``start[b] + i``) sees the positions up to its own. As one op, each target lowers it its own way
(``converters/stablehlo``: the pages gathered on every platform; on tpu kernels that read only each row's live
pages, JAX's paged attention kernel for rows of one query and ours for rows of several). A packed mixed step
(``llm.contract.mixed_inputs``) calls it twice per layer: its decode tokens as rows of one query each, then its
prompt tokens' blocks as a row each. Here: its definition and torch's own computation (the gather), which the
export's checks run."""
from __future__ import annotations

import torch

OP = "tte.paged_attention.default"  # the converters' name for it


def gather_pages(pool, table):
    """``pool [kv_heads, pages, page, dim]`` → each row's pages in sequence order ``[B, kv_heads, T * page, dim]``
    (``table [B, T]``)."""
    heads, _, page, dim = pool.shape
    b, t = table.shape
    return pool[:, table.to(torch.int64)].permute(1, 0, 2, 3, 4).reshape(b, heads, t * page, dim)


@torch.library.custom_op("tte::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor, page_table: torch.Tensor,
                    start: torch.Tensor, scale: float) -> torch.Tensor:
    """``query [B, heads, n, dim]`` (heads a multiple of the pool's KV heads, head ``h`` reading KV head
    ``h // (heads / kv_heads)``), ``key_pages`` / ``value_pages [kv_heads, pages, page, dim]``, ``page_table
    [B, T]``, ``start [B]`` (the position of each row's first query) → ``[B, heads, n, value dim]``."""
    b, heads, n, _ = query.shape
    k, v = gather_pages(key_pages, page_table), gather_pages(value_pages, page_table)
    positions = start.to(torch.int64)[:, None] + torch.arange(n)  # [B, n]
    visible = torch.arange(k.shape[2])[None, None, :] <= positions[:, :, None]  # [B, n, T * page]
    groups = k.shape[1]
    q = query.reshape(b, groups, heads // groups * n, query.shape[-1])
    mask = visible[:, None, None].expand(b, 1, heads // groups, n, k.shape[2]).reshape(b, 1, -1, k.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(q, k.to(query.dtype), v.to(query.dtype), attn_mask=mask,
                                                           scale=scale)
    return out.reshape(b, heads, n, v.shape[-1])


@paged_attention.register_fake
def _(query, key_pages, value_pages, page_table, start, scale):
    return query.new_empty((*query.shape[:-1], value_pages.shape[-1]))
