"""Pairwise distances: cdist and pdist."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

import torch

from .registry import lowers

aten = torch.ops.aten


def _p_norm(diff, p, axis=-1):
    """torch's vector p-norm over ``axis`` (p = 0 counts non-zeros, p = inf is the max)."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(diff.dtype), axis=axis)
    if p == 1:
        return jnp.sum(a, axis=axis)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis))
    if math.isinf(p):
        return jnp.max(a, axis=axis)
    return jnp.power(jnp.sum(jnp.power(a, p), axis=axis), 1.0 / p)


# compute_mode: None/0 = matmul form for p=2 when either side has more than 25 rows, 1 = always, 2 = never
_MM_THRESHOLD = 25


@lowers(aten._cdist_forward.default)
def cdist_forward(ctx, x1, x2, p, compute_mode=None):
    rows1, rows2 = x1.shape[-2], x2.shape[-2]
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    use_mm = p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and
                                                (rows1 > _MM_THRESHOLD or rows2 > _MM_THRESHOLD)))
    if use_mm:
        # torch's _euclidean_dist: |a|^2 + |b|^2 - 2ab as one matmul, clamped at 0
        n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
        n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
        a = jnp.concatenate([-2 * x1, n1, jnp.ones_like(n1)], axis=-1)
        b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
        return jnp.sqrt(jnp.maximum(jnp.matmul(a, jnp.swapaxes(b, -1, -2)), 0))
    return _p_norm(x1[..., :, None, :] - x2[..., None, :, :], p)


@lowers(aten._pdist_forward.default)
def pdist_forward(ctx, x, p=2.0):
    n = x.shape[0]
    i, j = np.triu_indices(n, k=1)
    diff = jnp.take(x, jnp.asarray(i.astype(np.int32)), axis=0) - jnp.take(x, jnp.asarray(j.astype(np.int32)), axis=0)
    return _p_norm(diff, p)
