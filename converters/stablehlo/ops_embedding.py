"""Embedding bags: sum / mean / max over variable-length bags of embedding rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import torch

from .registry import lowers

aten = torch.ops.aten

_SUM, _MEAN, _MAX = 0, 1, 2


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(ctx, weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """torch's four outputs: (output, offset2bag, bag_size, max_indices), as torch's CPU kernel fills them.

    Bag b holds the indices from ``offsets[b]`` up to the next bag's offset; the last bag runs to
    the end of ``indices`` (with ``include_last_offset`` the final offset only closes the list).
    Indices equal to ``padding_idx`` are skipped.
    """
    starts = offsets[:-1] if include_last_offset else offsets
    bags = starts.shape[0]
    n = indices.shape[0]
    dt = ctx.out_dtype(0)
    # the bag of each index position
    bag = jnp.searchsorted(starts, jnp.arange(n, dtype=starts.dtype), side="right") - 1
    bag = jnp.clip(bag, 0, max(bags - 1, 0))
    keep = indices != padding_idx if padding_idx >= 0 else jnp.ones((n,), jnp.bool_)
    rows = jnp.take(weight, indices, axis=0).astype(dt)
    counts = jnp.zeros((bags,), jnp.int32).at[bag].add(keep.astype(jnp.int32))
    if mode == _MAX:
        low = jnp.asarray(-jnp.inf, dt)
        masked = jnp.where(keep[:, None], rows, low)
        out = jax.ops.segment_max(masked, bag, num_segments=bags)
        # the first position that attains the max, as a weight row index
        hit = (masked == out[bag]) & keep[:, None]
        pos = jnp.where(hit, jnp.arange(n)[:, None], n)
        first = jax.ops.segment_min(pos, bag, num_segments=bags)
        max_indices = jnp.where(counts[:, None] > 0, jnp.take(indices, jnp.clip(first, 0, n - 1)), 0)
        out = jnp.where(counts[:, None] > 0, out, 0)
    else:
        if per_sample_weights is not None:
            rows = rows * per_sample_weights.astype(dt)[:, None]
        rows = jnp.where(keep[:, None], rows, 0)
        out = jax.ops.segment_sum(rows, bag, num_segments=bags)
        if mode == _MEAN:
            out = out / jnp.maximum(counts, 1).astype(dt)[:, None]
        max_indices = None
    bag_size = counts if mode != _SUM else jnp.zeros((bags,), jnp.int32)
    if max_indices is None:
        max_indices = bag_size
    # offset2bag is left empty by torch's sum mode without padding_idx
    offset2bag = bag if ctx.out_shape(1)[0] == n else jnp.zeros(ctx.out_shape(1), jnp.int32)
    return out, offset2bag, bag_size, max_indices
