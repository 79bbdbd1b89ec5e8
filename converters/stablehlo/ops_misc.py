"""Symbolic-shape queries, scalars and random tensors."""
from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp

import torch

from .registry import lowers

aten = torch.ops.aten


@lowers(aten.sym_size.int)
def sym_size(ctx, x, dim):
    return x.shape[dim]


@lowers(aten.sym_numel.default)
def sym_numel(ctx, x):
    return math.prod(x.shape)


@lowers(aten.sym_stride.int)
def sym_stride(ctx, x, dim):
    # our values are contiguous
    return math.prod(x.shape[dim % x.ndim + 1:])


@lowers(aten.sym_storage_offset.default)
def sym_storage_offset(ctx, x):
    return 0


@lowers(aten.sym_is_contiguous.default)
def sym_is_contiguous(ctx, x, memory_format=None):
    return True


@lowers(aten._local_scalar_dense.default)
def local_scalar_dense(ctx, x):
    return x.reshape(())


# Random ops draw from a fixed key: the program is a pure function, and torch's generator
# cannot be reproduced, so only the distribution matches eager.
def _key(ctx):
    return jax.random.key(zlib.crc32(ctx.node.name.encode()))


@lowers(aten.rand.default)
def rand(ctx, size, **kwargs):
    return jax.random.uniform(_key(ctx), tuple(size), ctx.out_dtype())


@lowers(aten.randn.default)
def randn(ctx, size, **kwargs):
    return jax.random.normal(_key(ctx), tuple(size), ctx.out_dtype())


@lowers(aten.randperm.default)
def randperm(ctx, n, **kwargs):
    return jax.random.permutation(_key(ctx), n).astype(ctx.out_dtype())


# Runtime checks that torch.export leaves in the graph: the shapes and dtypes they check are
# fixed at export, and data-dependent ones cannot stop a compiled program, so they lower to nothing.
@lowers(aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten._assert_async.msg,
        aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default, aten._linalg_check_errors.default)
def assertion(ctx, *args, **kwargs):
    return None
