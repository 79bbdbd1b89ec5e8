"""JAX's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) where it covers the case.

Splash is JAX's maintained TPU attention kernel: block-sparse over a static mask (blocks the
mask removes are neither computed nor fetched), GQA by head index, block sizes tuned by the
JAX team. It takes static masks only (no runtime or additive mask), query and key lengths
that its blocks divide, and does not scale q. So causal (torch's top-left alignment) and
unmasked attention at such shapes go here; runtime masks, padded lengths and decode steps go
to our ``flash_attention`` (attention.py), which exists for exactly those.

The compiler cannot see inside a Pallas kernel, and splash declares no cost estimate:
``splash_cost`` is what the manifest records for it, so compiled statistics can add it.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from . import LANES, Unfit, dtype_unfit, interpreting, static_shape, traced_in_32_bit

BLOCKS = (512, 256, 128)
HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class SplashPlan:
    block_q: int
    block_kv: int
    groups: int

    def describe(self) -> str:
        text = f"block_q={self.block_q}, block_kv={self.block_kv}"
        return text + (f", gqa {self.groups}:1" if self.groups > 1 else "")


def plan_splash(q_shape, k_shape, v_shape, dtype, *, has_mask: bool) -> SplashPlan | Unfit:
    """Block sizes when splash covers these shapes, or why it does not."""
    if has_mask:
        return Unfit("a runtime mask (splash takes static masks only)")
    if not static_shape(q_shape, k_shape, v_shape):
        return Unfit("dynamic shapes")
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4):
        return Unfit("not 4-D (batch, heads, seq, head_dim)")
    bad = dtype_unfit(dtype)
    if bad:
        return bad
    b, h, lq, d = q_shape
    if tuple(k_shape[:3]) != tuple(v_shape[:3]) or k_shape[0] != b or k_shape[3] != d or v_shape[3] != d:
        return Unfit("q, k and v differ in batch, kv shape or head_dim")
    hkv, s = k_shape[1], k_shape[2]
    if hkv == 0 or h % hkv:
        return Unfit(f"{h} query heads are not a multiple of {hkv} kv heads")
    if d not in HEAD_DIMS:
        return Unfit(f"head_dim {d} is not one of {HEAD_DIMS}")
    if lq % LANES or s % LANES or not lq or not s:
        return Unfit(f"q_len {lq} and kv_len {s} are not multiples of {LANES}")
    return SplashPlan(next(x for x in BLOCKS if lq % x == 0), next(x for x in BLOCKS if s % x == 0), h // hkv)


def splash_cost(q_shape, k_shape, dtype, causal: bool) -> dict:
    b, h, lq, d = q_shape
    s = k_shape[2]
    pairs = b * h * lq * s * (0.5 if causal and lq == s else 1.0)
    item = jnp.dtype(dtype).itemsize
    moved = (2 * b * h * lq * d + 2 * b * k_shape[1] * s * d) * item
    return {"flops": int(4 * pairs * d), "transcendentals": int(pairs), "bytes_accessed": int(moved)}


@traced_in_32_bit
def splash_attention(q, k, v, *, causal: bool, scale: float | None, plan: SplashPlan, interpret: bool | None = None):
    """torch's ``scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` through splash."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, h, lq, d = q.shape
    s = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mask = sa.CausalMask((lq, s)) if causal else sa.FullMask((lq, s))
    sizes = sa.BlockSizes(block_q=plan.block_q, block_kv=plan.block_kv, block_kv_compute=plan.block_kv)
    kernel = sa.make_splash_mha_single_device(sa.MultiHeadMask([mask] * h), block_sizes=sizes,
                                              interpret=bool(interpreting(interpret)))
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return jax.vmap(kernel)(q, k, v)
