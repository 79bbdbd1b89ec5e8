"""Symbolic-shape queries, scalars and random tensors."""
from __future__ import annotations

import math


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


# Runtime checks that torch.export leaves in the graph: the shapes and dtypes they check are
# fixed at export, and data-dependent ones cannot stop a compiled program, so they lower to nothing.
@lowers(aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten._assert_async.msg,
        aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default, aten._linalg_check_errors.default)
def assertion(ctx, *args, **kwargs):
    return None
