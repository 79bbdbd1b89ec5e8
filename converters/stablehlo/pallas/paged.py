"""JAX's paged attention kernel (``jax.experimental.pallas.ops.tpu.paged_attention``) for a paged step's
decode (``tte::paged_attention`` with one query per row).

The kernel walks each row's page table and copies only the pages up to the row's length into VMEM (double
buffered), so a decode step reads the live tokens of each sequence, where the gather of the XLA rule reads
every page of every row's table. Its GQA is by head index (the q heads of a KV head in one block). It reads
keys and values as bfloat16 whatever their dtype, so it takes bfloat16 pools only (a float32 cache would lose
precision); it does not scale q (the call does). One query per row: prefill chunks take the XLA rule."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import LANES, Unfit, interpreting, static_shape, sublanes, traced_in_32_bit

MAX_BLOCK_TOKENS = 512  # positions per compute block (pages_per_compute_block x page), at most


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    pages_per_block: int
    groups: int

    def describe(self) -> str:
        return f"pages_per_compute_block={self.pages_per_block}" + (f", gqa {self.groups}:1" if self.groups > 1 else "")


def plan_paged(q_shape, k_shape, v_shape, table_shape, dtype) -> PagedPlan | Unfit:
    """The kernel's block when it covers a paged attention of these shapes, or why it does not: ``q [B, H, n,
    d]``, pools ``[Hkv, pages, page, d]``, ``table [B, T]``."""
    if not static_shape(q_shape, k_shape, v_shape, table_shape):
        return Unfit("dynamic shapes")
    b, h, n, d = q_shape
    hkv, _, page, dk = k_shape
    if n != 1:
        return Unfit(f"{n} queries per row (the kernel takes decode steps: one)")
    if tuple(k_shape) != tuple(v_shape) or dk != d:
        return Unfit("keys and values differ in shape or head_dim")
    if h % hkv:
        return Unfit(f"{h} query heads are not a multiple of {hkv} kv heads")
    if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
        return Unfit(f"a {jnp.dtype(dtype).name} cache (the kernel reads keys and values as bfloat16)")
    if d % LANES:
        return Unfit(f"head_dim {d} is not a multiple of {LANES}")
    if page % sublanes(jnp.bfloat16):
        return Unfit(f"pages of {page} positions (a multiple of {sublanes(jnp.bfloat16)} for bfloat16 tiles)")
    t = table_shape[1]
    block = max(p for p in range(1, t + 1) if t % p == 0 and p * page <= max(MAX_BLOCK_TOKENS, page))
    return PagedPlan(block, h // hkv)


def paged_cost(q_shape, k_shape, table_shape, dtype) -> dict:
    """What the compiler's cost analysis would count for the kernel: a Mosaic call is opaque to it and JAX's
    paged attention declares no estimate, so without this a program with the kernel counted its attention as
    free. Every page of every row's table is counted as read once (the figure the gather's rule is compiled
    for: the compiler knows no row's length; at run time the kernel reads only each row's live pages), the
    queries read and the output written."""
    b, h, n, d = q_shape
    hkv, _, page, _ = k_shape
    positions = table_shape[1] * page
    item = jnp.dtype(dtype).itemsize
    pairs = b * h * n * positions
    moved = 2 * b * h * n * d * item + 2 * b * hkv * positions * d * item + 4 * (b * table_shape[1] + b)
    return {"flops": int(4 * pairs * d), "transcendentals": int(pairs), "bytes_accessed": int(moved)}


def paged_attention(q, k_pages, v_pages, table, start, *, scale: float, plan: PagedPlan,
                    interpret: bool | None = None):
    """``q [B, H, 1, d]`` → ``[B, H, 1, d]``: each row's query against its positions ``0..start``."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as kernel

    @traced_in_32_bit
    def run(q, k_pages, v_pages, table, start):
        scaled = (q[:, :, 0].astype(jnp.float32) * scale).astype(q.dtype)
        out = kernel(scaled, k_pages, v_pages, start.astype(jnp.int32) + 1, table.astype(jnp.int32),
                     pages_per_compute_block=plan.pages_per_block)
        return out[:, :, None]

    if interpreting(interpret):
        with pltpu.force_tpu_interpret_mode():
            return jax.jit(run)(q, k_pages, v_pages, table, start)
    return run(q, k_pages, v_pages, table, start)
