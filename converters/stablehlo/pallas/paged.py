"""Paged attention kernels for ``tte::paged_attention`` (a paged step's attention: rows of queries, each row
against its own pages of a shared pool, causally).

- **Decode** (one query per row): JAX's paged attention kernel (``jax.experimental.pallas.ops.tpu.
  paged_attention``). It walks each row's page table and copies only the pages up to the row's length into VMEM
  (double buffered), so a decode step reads the live tokens of each sequence, where the gather of the XLA rule
  reads every page of every row's table. Its GQA is by head index (the q heads of a KV head in one block). It
  reads keys and values as bfloat16 whatever their dtype, so it takes bfloat16 pools only (a float32 cache would
  lose precision); it does not scale q (the call does).
- **Blocks of queries** (a prompt chunk, a mixed step's blocks: several queries per row, each at its own
  position): ours, :func:`paged_blocks_attention`. JAX 0.10's ragged paged attention kernel would take these,
  but it wants keys and values interleaved in one pool, asks the local device for the TPU generation while it is
  lowered (so it cannot be exported from a host without a TPU) and does not run in Pallas' TPU interpret mode.
  Ours reads today's pools ``[kv_heads, pages, page, dim]``: a grid step fetches ``pages_per_step`` pages of a
  row's table through the BlockSpec index maps (the table and the rows' starts are scalar-prefetched), a row's
  pages past its last query's position are neither fetched (the index is clamped to the last live page, which
  the pipeline does not copy again) nor computed, and the q heads of a KV head are folded into the rows of one
  block, so each page is read once per KV head, as the decode kernel does. Online softmax in float32."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import LANES, Unfit, dtype_unfit, interpreting, round_up, static_shape, sublanes, traced_in_32_bit
from .attention import softmax_finish, softmax_update

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
        return Unfit(f"{n} queries per row (the kernel takes decode steps: one; blocks take paged_blocks)")
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


MAX_BLOCK_ROWS = 512  # folded query rows (q heads of a KV head x queries) per block
STEP_POSITIONS = 128  # positions a grid step reads (pages_per_step x page), at least one page


@dataclasses.dataclass(frozen=True)
class BlocksPlan:
    pages_per_step: int
    groups: int
    rows: int        # folded rows: groups x queries per row
    block_rows: int
    padded_rows: int

    def describe(self) -> str:
        return (f"pages_per_step={self.pages_per_step}, {self.rows} rows ({self.groups} q heads per kv head x "
                f"{self.rows // self.groups} queries) in blocks of {self.block_rows}")


def plan_paged_blocks(q_shape, k_shape, v_shape, table_shape, dtype) -> BlocksPlan | Unfit:
    """The block plan of :func:`paged_blocks_attention` for these shapes (``q [B, H, n, d]``, pools ``[Hkv,
    pages, page, d]``, ``table [B, T]``), or why it does not take them."""
    if not static_shape(q_shape, k_shape, v_shape, table_shape):
        return Unfit("dynamic shapes")
    b, h, n, d = q_shape
    hkv, _, page, dk = k_shape
    if n < 2:
        return Unfit("one query per row (decode steps take paged_attention)")
    if tuple(k_shape) != tuple(v_shape) or dk != d:
        return Unfit("keys and values differ in shape or head_dim")
    if h % hkv:
        return Unfit(f"{h} query heads are not a multiple of {hkv} kv heads")
    bad = dtype_unfit(dtype)
    if bad:
        return bad
    if d % LANES:
        return Unfit(f"head_dim {d} is not a multiple of {LANES}")
    if page % sublanes(dtype):
        return Unfit(f"pages of {page} positions (a multiple of {sublanes(dtype)} for {jnp.dtype(dtype).name} tiles)")
    rows = h // hkv * n
    block = min(round_up(rows, sublanes(dtype)), MAX_BLOCK_ROWS)
    return BlocksPlan(max(1, min(table_shape[1], STEP_POSITIONS // page)), h // hkv, rows, block,
                      round_up(rows, block))


def paged_blocks_attention(q, k_pages, v_pages, table, start, *, scale: float, plan: BlocksPlan,
                           interpret: bool | None = None):
    """``q [B, H, n, d]`` → ``[B, H, n, d]``: row ``b``'s query ``i`` (at position ``start[b] + i``) against its
    positions ``0..start[b] + i`` of the pools, read through ``table [B, T]``."""
    return _blocks(q, k_pages, v_pages, table.astype(jnp.int32), start.astype(jnp.int32), scale=float(scale),
                   plan=plan, interpret=interpreting(interpret))


@functools.partial(jax.jit, static_argnames=("scale", "plan", "interpret"))
@traced_in_32_bit
def _blocks(q, k_pages, v_pages, table, start, *, scale, plan: BlocksPlan, interpret):
    b, h, n, d = q.shape
    hkv, _, page, _ = k_pages.shape
    t = table.shape[1]
    ppb, br = plan.pages_per_step, plan.block_rows
    steps = -(-t // ppb)
    rows = q.reshape(b, hkv, plan.rows, d).astype(k_pages.dtype)
    if plan.padded_rows != plan.rows:
        rows = jnp.pad(rows, ((0, 0), (0, 0), (0, plan.padded_rows - plan.rows), (0, 0)))

    def page_map(c):
        def index(bi, hi, r, j, table_ref, start_ref):
            live = lax.div(start_ref[bi] + jnp.int32(n - 1), jnp.int32(page))  # the row's last live slot
            slot = jnp.minimum(jnp.minimum(j * ppb + c, live), jnp.int32(t - 1))
            return hi, table_ref[bi * t + slot], 0, 0
        return index

    page_spec = [pl.BlockSpec((pl.squeezed, pl.squeezed, page, d), page_map(c)) for c in range(ppb)]
    row_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, br, d), lambda bi, hi, r, j, *_: (bi, hi, r, 0))
    kernel = functools.partial(_blocks_kernel, ppb=ppb, page=page, n=n, block_rows=br, scale=scale, steps=steps)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, hkv, plan.padded_rows // br, steps),
            in_specs=[row_spec, *page_spec, *page_spec], out_specs=row_spec,
            scratch_shapes=[pltpu.VMEM((br, LANES), jnp.float32), pltpu.VMEM((br, LANES), jnp.float32),
                            pltpu.VMEM((br, d), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_blocks_attention",
    )(table.reshape(-1), start, rows, *([k_pages] * ppb), *([v_pages] * ppb))
    return out[:, :, :plan.rows].reshape(b, h, n, d)


def _blocks_kernel(table_ref, start_ref, q_ref, *refs, ppb, page, n, block_rows, scale, steps):
    k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * ppb:]
    bi, r, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    first = start_ref[bi]
    width = ppb * page

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(j * width <= first + (n - 1))  # pages past the row's last query are not read
    def _step():
        k = k_refs[0][...] if ppb == 1 else jnp.concatenate([x[...] for x in k_refs], axis=0)
        v = v_refs[0][...] if ppb == 1 else jnp.concatenate([x[...] for x in v_refs], axis=0)
        s = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        cols = j * width + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        folded = r * block_rows + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        s = jnp.where(cols <= first + lax.rem(folded, jnp.int32(n)), s, -jnp.inf)  # a page past a query: masked
        softmax_update(s, v, m_ref, l_ref, acc_ref)

    @pl.when(j == steps - 1)
    def _finish():
        softmax_finish(o_ref, l_ref, acc_ref)

