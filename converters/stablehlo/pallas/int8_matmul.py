"""Weight-only int8 matmul: ``x @ (w * scale[:, None]).T`` with w dequantised block by block in VMEM.

x is (M, K) float32 or bfloat16, w is (N, K) int8 (torch's Linear layout),
scale is (N,) per output channel. The weight stays int8 in HBM (a quarter of
the float32 bytes); each (block_n, block_k) tile is converted in VMEM, the
products accumulate in float32, and the per-channel scale is applied once at
the end (it factors out of the sum over K). Padding K with zeros adds nothing
to the sums; padded rows and columns of the result are sliced off.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import LANES, Unfit, dtype_unfit, interpreting, round_up, static_shape, sublanes, traced_in_32_bit


@dataclasses.dataclass(frozen=True)
class Int8MatmulPlan:
    m: int
    n: int
    k: int
    block_m: int
    block_n: int
    block_k: int

    @property
    def padded(self) -> tuple[int, int, int]:
        return round_up(self.m, self.block_m), round_up(self.n, LANES), round_up(self.k, LANES)

    def describe(self) -> str:
        text = f"block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k}"
        pm, pn, pk = self.padded
        pads = [f"{name} {a}->{b}" for name, a, b in (("m", self.m, pm), ("n", self.n, pn), ("k", self.k, pk))
                if a != b]
        return ", ".join([text, *pads])


def plan_int8_matmul(x_shape, w_shape, dtype, w_dtype, *, force: bool = False) -> Int8MatmulPlan | Unfit:
    """Block sizes for x (M, K) times int8 w (N, K), or why the kernel does not take them."""
    if not static_shape(x_shape, w_shape):
        return Unfit("dynamic shapes (the kernel's grid is fixed at export)")
    bad = dtype_unfit(dtype)
    if bad:
        return bad
    if jnp.dtype(w_dtype) != jnp.dtype(jnp.int8):
        return Unfit(f"weight dtype {jnp.dtype(w_dtype).name}, not int8")
    if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != w_shape[1]:
        return Unfit(f"x {tuple(x_shape)} and w {tuple(w_shape)} are not (M, K) and (N, K)")
    (m, k), n = x_shape, w_shape[0]
    if 0 in (m, n, k):
        return Unfit("empty operand")
    if (n % LANES or k % LANES) and not force:
        # the weight would be re-padded (copied) on every call
        return Unfit(f"weight {n}x{k} is not a multiple of {LANES} in both dims", forcible=True)
    pn, pk = round_up(n, LANES), round_up(k, LANES)
    block_m = min(256, round_up(m, sublanes(dtype)))
    block_n = next(b for b in (512, 256, 128) if pn % b == 0)
    block_k = next(b for b in (1024, 512, 256, 128) if pk % b == 0)
    return Int8MatmulPlan(m, n, k, block_m, block_n, block_k)


@traced_in_32_bit
def int8_matmul(x, w, scale, *, out_dtype=None, plan: Int8MatmulPlan | None = None, interpret: bool | None = None):
    """``x @ (w.astype(float) * scale[:, None]).T``, accumulated in float32."""
    if plan is None:
        plan = plan_int8_matmul(x.shape, w.shape, x.dtype, w.dtype, force=True)
        if isinstance(plan, Unfit):
            raise ValueError(f"int8_matmul cannot take these shapes: {plan.reason}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    pm, pn, pk = plan.padded
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    x = jnp.pad(x, ((0, pm - plan.m), (0, pk - plan.k))) if (pm, pk) != x.shape else x
    w = jnp.pad(w, ((0, pn - plan.n), (0, pk - plan.k))) if (pn, pk) != w.shape else w
    scale = scale.astype(jnp.float32).reshape(1, plan.n)
    scale = jnp.pad(scale, ((0, 0), (0, pn - plan.n))) if pn != plan.n else scale
    nk = pk // bk
    out = pl.pallas_call(
        functools.partial(_kernel, num_k_blocks=nk),
        grid=(pm // bm, pn // bn, nk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)),
                  pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((pm, pn), out_dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(
            flops=2 * pm * pn * pk, transcendentals=0,
            bytes_accessed=pm * pk * jnp.dtype(x.dtype).itemsize * (pn // bn) + pn * pk * (pm // bm)
            + pm * pn * jnp.dtype(out_dtype).itemsize),
        interpret=interpreting(interpret),
        name="int8_matmul",
    )(x, w, scale)
    return out[:plan.m, :plan.n]


def _kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, num_k_blocks):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    w = w_ref[...].astype(jnp.float32).astype(x.dtype)  # int8 values are exact in bfloat16
    acc_ref[...] += lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(kk == num_k_blocks - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] * s_ref[...]).astype(o_ref.dtype)
