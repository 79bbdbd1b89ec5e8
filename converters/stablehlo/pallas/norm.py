"""Fused RMSNorm and LayerNorm over the last dim: one read of x, one write, float32 inside.

x is viewed as (rows, D); a block holds whole rows, so each row's statistics
come from one block. The grid covers the rows with blocks of ``block_rows``
(all rows, or a multiple of the sublane tile); the last block may stick out
past the array: rows are independent, and Pallas drops writes outside it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import LANES, Unfit, dtype_unfit, interpreting, round_up, sublanes, traced_in_32_bit

BLOCK_BYTES = 1 << 20  # per input block; x and y blocks are double-buffered
MAX_DIM = 1 << 16  # 8 rows of 64K float32 are 2 MiB per block


@dataclasses.dataclass(frozen=True)
class NormPlan:
    rows: int
    dim: int
    block_rows: int

    def describe(self) -> str:
        return f"block_rows={self.block_rows}, rows={self.rows}, dim={self.dim}"


def plan_norm(shape, normalized_ndim: int, dtype, *, force: bool = False) -> NormPlan | Unfit:
    """Block sizes for normalising the last ``normalized_ndim`` dims of ``shape``, or why not."""
    if not all(isinstance(d, int) for d in shape):
        return Unfit("dynamic shapes (the kernel's grid is fixed at export)")
    bad = dtype_unfit(dtype)
    if bad:
        return bad
    if normalized_ndim < 1 or normalized_ndim > len(shape):
        return Unfit(f"normalizes {normalized_ndim} dims of a {len(shape)}-D input")
    dim = math.prod(shape[len(shape) - normalized_ndim:])
    rows = math.prod(shape[:len(shape) - normalized_ndim])
    if rows == 0 or dim == 0:
        return Unfit("empty input")
    if dim > MAX_DIM:
        return Unfit(f"normalized size {dim} > {MAX_DIM} (a block of whole rows would not fit in VMEM)")
    if dim % LANES and not force:
        return Unfit(f"normalized size {dim} is not a multiple of {LANES}: blocks would be lane-sparse",
                     forcible=True)
    sub = sublanes(dtype)
    per_block = max(sub, BLOCK_BYTES // (round_up(dim, LANES) * 4) // sub * sub)
    per_block = min(per_block, 1024)
    # all rows in one block when they fit: a block equal to the array is valid at any row count
    return NormPlan(rows, dim, rows if rows <= per_block else per_block)


def rms_norm(x, weight, eps: float, *, normalized_ndim: int = 1, out_dtype=None, plan: NormPlan | None = None,
             interpret: bool | None = None):
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last ``normalized_ndim`` dims, in float32."""
    return _norm(x, weight, None, eps, normalized_ndim, out_dtype, plan, interpret, centered=False)


def layer_norm(x, weight, bias, eps: float, *, normalized_ndim: int = 1, out_dtype=None,
               plan: NormPlan | None = None, interpret: bool | None = None):
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last ``normalized_ndim`` dims, in float32."""
    return _norm(x, weight, bias, eps, normalized_ndim, out_dtype, plan, interpret, centered=True)


@traced_in_32_bit
def _norm(x, weight, bias, eps, normalized_ndim, out_dtype, plan, interpret, *, centered):
    if plan is None:
        plan = plan_norm(x.shape, normalized_ndim, x.dtype, force=True)
        if isinstance(plan, Unfit):
            raise ValueError(f"norm kernel cannot take this input: {plan.reason}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    rows, dim, br = plan.rows, plan.dim, plan.block_rows
    operands = [x.reshape(rows, dim)]
    specs = [pl.BlockSpec((br, dim), lambda i: (i, 0))]
    for p in (weight, bias):
        if p is not None:
            operands.append(p.reshape(1, dim))
            specs.append(pl.BlockSpec((1, dim), lambda i: (0, 0)))
    kernel = functools.partial(_kernel, eps=float(eps), centered=centered, has_weight=weight is not None,
                               has_bias=bias is not None)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(rows, br),),
        in_specs=specs,
        out_specs=pl.BlockSpec((br, dim), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, dim), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=(8 if centered else 6) * rows * dim, transcendentals=rows,
            bytes_accessed=rows * dim * (jnp.dtype(x.dtype).itemsize + jnp.dtype(out_dtype).itemsize)
            + sum(dim * jnp.dtype(p.dtype).itemsize for p in operands[1:])),
        interpret=interpreting(interpret),
        name="layer_norm" if centered else "rms_norm",
    )(*operands)
    return out.reshape(x.shape)


def _kernel(x_ref, *refs, eps, centered, has_weight, has_bias):
    o_ref = refs[-1]
    x = x_ref[...].astype(jnp.float32)
    if centered:
        x = x - jnp.mean(x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    if has_weight:
        y = y * refs[0][...].astype(jnp.float32)
    if has_bias:
        y = y + refs[int(has_weight)][...].astype(jnp.float32)
    o_ref[...] = y.astype(o_ref.dtype)
