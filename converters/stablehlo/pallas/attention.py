"""Flash attention: softmax(q k^T * scale + mask) v in one pass over k/v blocks.

q is (batch, heads, q_len, head_dim); k and v are (batch, kv_heads, kv_len,
head_dim) with heads a multiple of kv_heads (GQA/MQA: each q head reads its
kv head through the BlockSpec index map, so repeated k/v never exist). The
running max, running sum and output accumulate in float32 scratch; inputs
and outputs are float32 or bfloat16. ``causal`` is torch's top-left aligned
mask (query i sees keys j <= i); ``mask`` is additive (float) or boolean
(True = attend) and broadcasts to (batch, heads, q_len, kv_len). Rows whose
every key is masked out give 0, like torch's math attention.

Padding is exact: padded query rows are sliced off, padded keys are masked
inside the kernel, padded head-dim columns are zeros (they add nothing to
q k^T and produce output columns that are sliced off).

Decode steps (a few query tokens against a long KV cache) fold the q heads that
share a kv head into the rows of one block (``AttentionPlan.decode``): each k/v
block is read once per kv head, and larger k/v blocks amortise the grid steps.

Why this kernel beside JAX's (``jax.experimental.pallas.ops.tpu``): splash
attention (used for causal and unmasked attention, see splash.py) takes static
masks only and lengths its blocks divide; flash_attention takes a full
(B, H, L, S) bias and no GQA; paged and ragged-paged attention need page
tables and per-sequence lengths. This kernel covers what exported PyTorch models
carry and those do not: runtime boolean and additive masks broadcast over
batch, heads and rows (padding masks, a KV cache's valid positions), lengths
and head dims that need padding, rows with every key masked (0, as torch), and
decode steps over a contiguous cache.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import LANES, Unfit, dtype_unfit, interpreting, round_up, static_shape, sublanes, traced_in_32_bit

HEAD_DIMS = (64, 128, 256)
MIN_KV_LEN = LANES
MAX_PAD_FRACTION = 0.25  # padding kv_len may add at most this much work in kernels="auto"


DECODE_MAX_Q = 16  # up to this many query tokens, a step is decode-shaped (see AttentionPlan.decode)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    block_q: int
    block_k: int
    q_len: int
    padded_q: int  # kernel rows after padding (decode: groups * q_len rows, padded)
    kv_len: int
    padded_kv: int
    head_dim: int
    padded_head_dim: int
    groups: int  # q heads per kv head
    # Decode-shaped (a few query tokens against a long cache): the q heads that share a kv head
    # are folded into the rows of one block, so each k/v block is read once per kv head instead
    # of once per q head, and one token is not padded to a full sublane tile per head.
    decode: bool = False

    @property
    def q_rows(self) -> int:
        return self.q_len * self.groups if self.decode else self.q_len

    def describe(self) -> str:
        parts = [f"block_q={self.block_q}", f"block_k={self.block_k}"]
        folded = self.decode and self.groups > 1
        if folded:
            parts.insert(0, f"decode: {self.groups} q heads per kv head as rows")
        for name, n, p in (("q rows" if folded else "q_len", self.q_rows, self.padded_q),
                           ("kv_len", self.kv_len, self.padded_kv), ("head_dim", self.head_dim, self.padded_head_dim)):
            if p != n:
                parts.append(f"{name} {n}->{p}")
        if self.groups > 1 and not self.decode:
            parts.append(f"gqa {self.groups}:1")
        return ", ".join(parts)


def plan_attention(q_shape, k_shape, v_shape, dtype, mask_shape=None, *, force: bool = False) -> AttentionPlan | Unfit:
    """Block sizes and padding for these shapes, or why the kernel does not take them.

    ``force`` (``kernels="pallas"``) accepts padding that ``auto`` finds too costly.
    """
    if not static_shape(q_shape, k_shape, v_shape, mask_shape or ()):
        return Unfit("dynamic shapes (the kernel's grid is fixed at export)")
    if not (len(q_shape) == len(k_shape) == len(v_shape) == 4):
        return Unfit(f"q is {len(q_shape)}-D; the kernel takes 4-D (batch, heads, seq, head_dim)")
    bad = dtype_unfit(dtype)
    if bad:
        return bad
    b, h, lq, d = q_shape
    bk_, hkv, s, dk = k_shape
    if bk_ != b or tuple(v_shape[:3]) != tuple(k_shape[:3]) or dk != d:
        return Unfit(f"q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)} differ in batch, kv shape or head_dim")
    if v_shape[3] != d:
        return Unfit(f"value head_dim {v_shape[3]} differs from the query's {d}")
    if hkv == 0 or h % hkv:
        return Unfit(f"{h} query heads are not a multiple of {hkv} kv heads")
    if mask_shape is not None and len(mask_shape) > 4:
        return Unfit(f"mask is {len(mask_shape)}-D")
    if lq == 0 or s == 0:
        return Unfit("empty sequence")
    if d > HEAD_DIMS[-1]:
        return Unfit(f"head_dim {d} > {HEAD_DIMS[-1]} (the q/k/v blocks would not fit in VMEM)")
    dp = next(x for x in HEAD_DIMS if x >= d)
    soft = []
    if dp != d:
        soft.append(f"head_dim {d} pads to {dp} ({dp / d:.1f}x the work)")
    sp = round_up(s, LANES)
    if s < MIN_KV_LEN:
        soft.append(f"kv_len {s} < {MIN_KV_LEN}: one 128-lane block would be mostly padding")
    elif (sp - s) / s > MAX_PAD_FRACTION:
        soft.append(f"kv_len {s} pads to {sp} (+{100 * (sp - s) / s:.0f}% work)")
    if soft and not force:
        return Unfit("; ".join(soft), forcible=True)
    sub = sublanes(dtype)
    groups = h // hkv
    decode = lq <= DECODE_MAX_Q
    if decode:
        # few rows per step: larger k/v blocks amortise the per-step cost (2 x 2 buffers of
        # block_k x head_dim stay within a few MiB of VMEM)
        rows = lq * groups
        block_k = next(x for x in (2048, 1024, 512, 256, 128) if sp % x == 0 and x * dp * 4 <= 1 << 20)
        block_q = round_up(rows, sub) if rows <= 256 else 256
        return AttentionPlan(block_q, block_k, lq, round_up(rows, block_q), s, sp, d, dp, groups, decode=True)
    block_k = next(x for x in (512, 256, 128) if sp % x == 0)
    if lq <= 256:
        block_q = round_up(lq, sub)
    else:
        block_q = 256 if round_up(lq, 256) - lq <= lq // 8 else 128
    return AttentionPlan(block_q, block_k, lq, round_up(lq, block_q), s, sp, d, dp, groups)


@traced_in_32_bit
def flash_attention(q, k, v, mask=None, *, causal: bool = False, scale: float | None = None,
                    plan: AttentionPlan | None = None, interpret: bool | None = None):
    """Attention of q (B, H, L, D) over k, v (B, Hkv, S, D); see the module docstring."""
    if causal and mask is not None:
        raise ValueError("pass either causal=True or a mask, not both (as torch requires)")
    if plan is None:
        plan = plan_attention(q.shape, k.shape, v.shape, q.dtype, None if mask is None else mask.shape, force=True)
        if isinstance(plan, Unfit):
            raise ValueError(f"flash_attention cannot take these shapes: {plan.reason}")
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    bq, bk, lp, sp, dp = plan.block_q, plan.block_k, plan.padded_q, plan.padded_kv, plan.padded_head_dim
    groups = plan.groups
    if plan.decode:  # (B, Hkv, groups * L, D): a kv head's q heads are rows of one block
        q = q.reshape(b, hkv, groups * lq, d)
    q_heads, kv_per_q = (hkv, 1) if plan.decode else (h, groups)
    q = _pad(q, {2: lp, 3: dp})
    k = _pad(k, {2: sp, 3: dp})
    v = _pad(v, {2: sp, 3: dp})
    nq, nk = lp // bq, sp // bk

    # index maps use lax.div, not //: floor division lowers to sign ops Mosaic only has per TPU generation
    def last_kv_block(i):
        # the last kv block a causal q block reads; later ones are skipped (and not fetched)
        if not causal:
            return nk - 1
        last_row = jnp.int32(lq - 1) if plan.decode else i * bq + bq - 1
        return jnp.minimum(nk - 1, lax.div(last_row, jnp.int32(bk)))

    def kv_block(i, j):
        return jnp.minimum(j, last_kv_block(i)) if causal else j

    in_specs = [
        pl.BlockSpec((pl.squeezed, pl.squeezed, bq, dp), lambda bi, hi, i, j: (bi, hi, i, 0)),
        pl.BlockSpec((pl.squeezed, pl.squeezed, bk, dp),
                     lambda bi, hi, i, j: (bi, lax.div(hi, jnp.int32(kv_per_q)), kv_block(i, j), 0)),
        pl.BlockSpec((pl.squeezed, pl.squeezed, bk, dp),
                     lambda bi, hi, i, j: (bi, lax.div(hi, jnp.int32(kv_per_q)), kv_block(i, j), 0)),
    ]
    operands = [q, k, v]
    if mask is not None:
        mask, (mb, mh, mrows) = _prepare_mask(mask, plan, h, hkv)
        rows = bq if mrows else 1
        in_specs.append(pl.BlockSpec(
            (pl.squeezed, pl.squeezed, rows, bk),
            lambda bi, hi, i, j: (bi if mb else 0, hi if mh else 0, i if mrows else 0, kv_block(i, j))))
        operands.append(mask)
    kernel = functools.partial(_kernel, causal=causal, scale=scale, block_q=bq, block_k=bk, kv_len=plan.kv_len,
                               num_kv_blocks=nk, has_mask=mask is not None,
                               q_len=lq if plan.decode else None)
    out = pl.pallas_call(
        kernel,
        grid=(b, q_heads, nq, nk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((pl.squeezed, pl.squeezed, bq, dp), lambda bi, hi, i, j: (bi, hi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, q_heads, lp, dp), q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                        pltpu.VMEM((bq, dp), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=attention_cost(b, h, lq, plan.kv_len, d, q.dtype, causal, operands),
        interpret=interpreting(interpret),
        name="flash_attention",
    )(*operands)
    if plan.decode:
        return out[:, :, :groups * lq, :d].reshape(b, h, lq, d)
    return out[:, :, :lq, :d]


def attention_cost(b, h, lq, s, d, dtype, causal: bool, operands=()) -> pl.CostEstimate:
    """What the compiler's cost analysis counts for an attention kernel (a custom call is opaque to it)."""
    pairs = b * h * lq * s * (0.5 if causal and lq == s else 1.0)
    moved = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in operands)
    return pl.CostEstimate(flops=int(4 * pairs * d), transcendentals=int(pairs),
                           bytes_accessed=int(moved + b * h * lq * d * jnp.dtype(dtype).itemsize))


def _pad(x, sizes: dict):
    widths = [(0, sizes.get(i, n) - n) for i, n in enumerate(x.shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _prepare_mask(mask, plan: AttentionPlan, h: int, hkv: int):
    """The mask as float32 (B|1, heads|1, rows|1, S_padded) additive bias, and which of B, heads, rows it spans.

    Decode plans fold each kv head's ``groups`` q heads into rows, so a per-head mask becomes
    (B, Hkv, groups * L) rows, and a per-row mask is repeated for each q head of the group.
    """
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    if mask.dtype == jnp.bool_:
        mask = jnp.where(mask, 0.0, -jnp.inf)
    mask = mask.astype(jnp.float32)
    mb, mh, ml, _ = mask.shape
    lq, s = plan.q_len, plan.kv_len
    mask = jnp.broadcast_to(mask, (mb, mh, ml, s))
    if plan.decode and plan.q_rows > 1 and (mh != 1 or (ml != 1 and plan.groups > 1)):
        g = plan.groups
        mask = mask.reshape(mb, hkv if mh != 1 else 1, g if mh != 1 else 1, ml, s)
        mask = jnp.broadcast_to(mask, mask.shape[:2] + (g, lq, s)).reshape(mb, mask.shape[1], g * lq, s)
        ml = g * lq
    elif plan.decode and mh != 1:  # one row per kv head: heads become kv heads
        mask = mask.reshape(mb, hkv, ml, s)
    mh = mask.shape[1]
    mask = _pad(mask, {2: plan.padded_q if ml != 1 else 1, 3: plan.padded_kv})
    return mask, (mb != 1, mh != 1, ml != 1)


def _lanes_to(x, n):
    """(rows, 128) lane-replicated values widened or cut to (rows, n)."""
    if n == LANES:
        return x
    if n % LANES == 0:
        return jnp.tile(x, (1, n // LANES))
    return x[:, :n]


def _kernel(q_ref, k_ref, v_ref, *refs, causal, scale, block_q, block_k, kv_len, num_kv_blocks, has_mask,
            q_len):
    mask_ref = refs[0] if has_mask else None
    o_ref, m_ref, l_ref, acc_ref = refs[1:] if has_mask else refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # a causal kv block to the right of the diagonal contributes nothing (decode rows hold
    # positions 0..q_len-1 of each folded q head)
    last_row = (q_len - 1) if q_len is not None else i * block_q + block_q - 1
    run = (j * block_k <= last_row) if causal else True

    @pl.when(run)
    def _step():
        s = lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
        if mask_ref is not None:
            s = s + mask_ref[...]
        padded = kv_len != num_kv_blocks * block_k
        if causal or padded:
            cols = j * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            valid = cols < kv_len
            if causal:
                rows = i * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
                if q_len is not None:
                    rows = lax.rem(rows, jnp.int32(q_len))
                valid = jnp.logical_and(valid, cols <= rows)
            s = jnp.where(valid, s, -jnp.inf)
        softmax_update(s, v_ref[...], m_ref, l_ref, acc_ref)

    @pl.when(j == num_kv_blocks - 1)
    def _finish():
        softmax_finish(o_ref, l_ref, acc_ref)


def softmax_update(s, v, m_ref, l_ref, acc_ref):
    """One kv block of online softmax: scores ``s (rows, cols)`` in float32 (masked keys -inf) and values ``v
    (cols, d)`` into the running max and sum (``(rows, 128)``, lane-replicated) and output ``(rows, d)``."""
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # a row with no unmasked key yet keeps max -inf; subtract 0 instead so exp gives 0, not nan
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(s - _lanes_to(m_safe, s.shape[1]))
    alpha = jnp.exp(m_prev - m_safe)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_ref[...] = acc_ref[...] * _lanes_to(alpha, acc_ref.shape[1]) + pv


def softmax_finish(o_ref, l_ref, acc_ref):
    """The output of an online softmax: 0 for a row whose every key was masked, as torch gives."""
    l = l_ref[...]
    inv = jnp.where(l == 0.0, 0.0, 1.0 / jnp.where(l == 0.0, 1.0, l))
    o_ref[...] = (acc_ref[...] * _lanes_to(inv, acc_ref.shape[1])).astype(o_ref.dtype)
