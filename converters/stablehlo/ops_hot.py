"""Hot ops: attention, norms, int8 weight-only matmul. XLA rules for every platform, Pallas on tpu.

Capture keeps ``KEEP_WHOLE`` as single nodes and ``fusion.py`` folds the
usual hand-written patterns into them, so each hot op reaches this file as
one node. On ``tpu`` a rule asks the kernel's ``plan_*`` whether the node's
shapes fit, then uses the kernel or the default (XLA) rule, and logs which
and why in ``ctx.kernel_log`` (the manifest's ``kernels``). ``kernels="xla"``
never uses a kernel; ``kernels="pallas"`` raises where a kernel cannot apply.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torchtpu_export.fxnodes import op_name, user_source_line
from torchtpu_export.errors import UnsupportedOpError

from .kernel_cost import LEFT_OUT
from .pallas import Unfit, compiler_rejects
from .pallas.attention import DECODE_MAX_Q, flash_attention, plan_attention
from .pallas.int8_matmul import int8_matmul, plan_int8_matmul
from .pallas.norm import layer_norm, plan_norm, rms_norm
from .pallas.paged import paged_attention, paged_blocks_attention, paged_cost, plan_paged, plan_paged_blocks
from .pallas.splash import plan_splash, splash_attention, splash_cost
from .registry import LOWERINGS, lowers

aten = torch.ops.aten

# Composite ops torch would decompose that this target keeps as one node.
# (aten.native_layer_norm and aten._weight_int8pack_mm are core ATen already.)
KEEP_WHOLE = [aten.scaled_dot_product_attention.default, aten.rms_norm.default]


@dataclasses.dataclass(frozen=True)
class Shards:
    """How a kernel runs per shard of a sharded program (``jax.shard_map`` over the program's mesh):
    each operand's and the output's partition spec, and the operands' per-shard shapes (for the plan
    and the compiler's check)."""

    in_specs: tuple
    out_specs: object
    local: tuple                # jax.ShapeDtypeStruct per operand: what one shard's kernel gets
    detail: str


@dataclasses.dataclass
class Candidate:
    """A kernel that may lower a node: its plan (or why it does not fit) and the call to make."""

    kernel: str
    fit: object                 # the kernel's plan, or an Unfit
    call: Callable              # call(*operands), static parameters bound
    operands: tuple
    key: tuple = ()             # what ``call`` binds besides the plan (causal, scale, eps, ...)
    cost: dict | None = None    # for kernels that declare no cost estimate to the compiler
    shards: Shards | None = None  # in a sharded program: how it runs per shard (None: it cannot)


def dispatch(ctx, *candidates: Candidate):
    """The first candidate that fits and that the TPU compiler accepts, called; None for the XLA rule.

    The choice, or why no kernel, goes to ``ctx.kernel_log`` (the manifest's ``kernels``).
    Where libtpu is installed, each kernel is compiled alone for ``ctx.kernel_topologies``
    first, so ``kernels="auto"`` never leaves a kernel in the program that the TPU compiler
    rejects; ``kernels="pallas"`` raises instead of falling back.
    """
    entry = {"node": ctx.node.name, "op": op_name(ctx.node.target)}
    reasons = []
    if ctx.kernels == "xla":
        reasons.append("kernels='xla'")
    else:
        for c in candidates:
            why = c.fit.reason if isinstance(c.fit, Unfit) else None
            if why is None and c.kernel in ctx.kernels_off:
                why = LEFT_OUT
            if why is None and ctx.sharded and c.shards is None:
                # XLA cannot partition a Mosaic kernel: it runs per shard (shard_map) or not at all
                why = "the program is sharded over a mesh, and this kernel has no per-shard form here"
            operands = c.operands if c.shards is None else c.shards.local
            if why is None and ctx.kernel_topologies:
                rejected = compiler_rejects(c.kernel, c.call, operands, (c.fit, *c.key), ctx.kernel_topologies)
                why = f"the TPU compiler rejects it ({rejected})" if rejected else None
            if why is None:
                entry.update(kernel=f"pallas.{c.kernel}", detail=c.fit.describe())
                call = c.call
                if c.shards is not None:
                    entry["detail"] += f"; per shard: {c.shards.detail}"
                    call = jax.shard_map(c.call, mesh=ctx.shard_mesh(), in_specs=c.shards.in_specs,
                                         out_specs=c.shards.out_specs, check_vma=False)
                if c.cost:
                    entry["cost"] = c.cost
                ctx.kernel_log.append(entry)
                return call(*c.operands)
            reasons.append(why if len(candidates) == 1 else f"{c.kernel}: {why}")
    if ctx.kernels == "pallas":
        raise UnsupportedOpError(
            op_name(ctx.node.target), target="stablehlo (tpu, kernels='pallas')",
            reason=f"no Pallas kernel can take node {ctx.node.name}: {'; '.join(reasons)}",
            source=user_source_line(ctx.node), hint="export with kernels='auto' to lower such nodes with XLA")
    entry["reason"] = "; ".join(reasons)
    ctx.kernel_log.append(entry)
    return None


def _default(op):
    return LOWERINGS[op][None]


def _local(x, shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _batch_axis(ctx, batch) -> str | None:
    # the data axis splits the batch where it divides (as the plan splits the inputs)
    n = ctx.mesh_axes.get("data", 1)
    return "data" if n > 1 and isinstance(batch, int) and batch % n == 0 else None


def _head_shards(ctx, q, k, v, mask=None) -> Shards | Unfit:
    """Attention per shard: q, k and v (B, H, L, D) split by head over ``model`` (tensor parallelism
    splits attention that way), the batch over ``data`` where it divides; a mask splits along."""
    from jax.sharding import PartitionSpec as P
    n = ctx.mesh_axes.get("model", 1)
    if q.ndim != 4 or k.ndim != 4:
        return Unfit(f"sharded: the per-shard kernel takes 4-D q/k/v, not {q.ndim}-D")
    h, hkv = q.shape[1], k.shape[1]
    if n > 1 and (h % n or hkv % n):
        return Unfit(f"sharded: {h} query and {hkv} KV heads do not divide over the model axis ({n} devices)")
    heads = "model" if n > 1 else None
    b = _batch_axis(ctx, q.shape[0])
    nb = ctx.mesh_axes.get("data", 1) if b else 1
    spec = P(b, heads)
    specs, local = [spec, spec, spec], [_local(x, (x.shape[0] // nb, x.shape[1] // (n if heads else 1)) + x.shape[2:])
                                        for x in (q, k, v)]
    if mask is not None:
        full = (1,) * (4 - mask.ndim) + tuple(mask.shape)  # as it broadcasts to (B, H, L, S)
        mb = b if full[0] == q.shape[0] else None
        mh = heads if full[1] == h else None
        if mask.ndim < 4 and (mb or mh):
            return Unfit("sharded: a mask of fewer than 4 dims that varies by batch or head")
        specs.append(P(mb, mh) if mask.ndim == 4 else P())
        local.append(_local(mask, (full[0] // (nb if mb else 1), full[1] // (n if mh else 1)) + full[2:]
                            if mask.ndim == 4 else mask.shape))
    return Shards(tuple(specs), spec, tuple(local),
                  f"{h // (n if heads else 1)} of {h} heads on each of {n} devices" + (f", batch over {nb}" if b else ""))


def _shape(x) -> tuple:
    return tuple(x.shape)


# ---- scaled_dot_product_attention ------------------------------------------------------------

@lowers(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    out_dtype = ctx.out_dtype()
    e = q.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    lq, s = q.shape[-2], k.shape[-2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    grouped = enable_gqa and q.shape[-3] != k.shape[-3]
    if grouped:
        # (..., Hkv, rep, L, E) against (..., Hkv, S, E): each kv head serves rep query heads. The rep axis
        # is a free axis of the contraction, never a broadcast of k and v (which XLA may materialize)
        hkv = k.shape[-3]
        rep = q.shape[-3] // hkv
        q = q.reshape(q.shape[:-3] + (hkv, rep) + q.shape[-2:])
        scores = jnp.einsum("...grqd,...gkd->...grqk", q, k, preferred_element_type=jnp.float32) * scale
    else:
        scores = jnp.einsum("...qd,...kd->...qk", q, k, preferred_element_type=jnp.float32) * scale
    if is_causal:
        scores = jnp.where(jnp.tril(jnp.ones((lq, s), jnp.bool_)), scores, -jnp.inf)
    if attn_mask is not None:
        mask = attn_mask.reshape((1,) * (len(out_shape) - attn_mask.ndim) + _shape(attn_mask))
        if grouped:
            heads = mask.shape[-3]
            mask = mask.reshape(mask.shape[:-3] + ((hkv, rep) if heads != 1 else (1, 1)) + mask.shape[-2:])
        if mask.dtype == jnp.bool_:
            scores = jnp.where(mask, scores, -jnp.inf)
        else:
            scores = scores + mask.astype(jnp.float32)
    # torch's math attention gives 0, not nan, for a row whose every key is masked out
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(row_max == -jnp.inf, 0.0, row_max))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(total == 0.0, 1.0, total)
    if dropout_p:   # training-mode attention dropout, from the program's PRNG key
        keep = jax.random.uniform(ctx.random_key(), weights.shape, jnp.float32) >= dropout_p
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0)
    out = jnp.einsum("...grqk,...gkd->...grqd" if grouped else "...qk,...kd->...qd", weights.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(out_shape).astype(out_dtype)


@lowers(aten.scaled_dot_product_attention.default, platform="tpu")
def scaled_dot_product_attention_tpu(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                     enable_gqa=False):
    if dropout_p:   # no kernel draws dropout: XLA's attention does
        return scaled_dot_product_attention(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                            enable_gqa=enable_gqa)
    force = ctx.kernels == "pallas"
    causal = bool(is_causal)
    ungrouped = Unfit("q and k/v head counts differ without enable_gqa") \
        if q.shape[-3] != k.shape[-3] and not enable_gqa else None
    shards = _head_shards(ctx, q, k, v, attn_mask) if ctx.sharded else None
    if isinstance(shards, Unfit):
        ungrouped, shards = ungrouped or shards, None
    # the kernels' plans are for what one shard's kernel sees
    lq, lk, lv, *lm = (_shape(x) for x in shards.local) if shards else \
        (_shape(q), _shape(k), _shape(v), *([] if attn_mask is None else [_shape(attn_mask)]))
    flash = ungrouped or plan_attention(lq, lk, lv, q.dtype, lm[0] if lm else None, force=force)
    operands = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
    candidates = [Candidate("flash_attention", flash,
                            functools.partial(_flash, causal=causal, scale=scale, plan=flash), operands,
                            (causal, scale), shards=shards)]
    if not isinstance(q.shape[-2], int) or q.shape[-2] > DECODE_MAX_Q:  # decode steps are ours: splash has none
        splash = ungrouped or plan_splash(lq, lk, lv, q.dtype, has_mask=attn_mask is not None)
        splash_shards = None if shards is None else Shards(shards.in_specs[:3], shards.out_specs, shards.local[:3],
                                                           shards.detail)
        candidates.insert(0, Candidate(
            "splash_attention", splash, functools.partial(splash_attention, causal=causal, scale=scale, plan=splash),
            (q, k, v), (causal, scale),
            None if isinstance(splash, Unfit) else splash_cost(_shape(q), _shape(k), q.dtype, causal),
            shards=splash_shards))
    out = dispatch(ctx, *candidates)
    if out is not None:
        return out
    return scaled_dot_product_attention(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                        enable_gqa=enable_gqa)


def _flash(q, k, v, mask=None, *, causal, scale, plan):
    return flash_attention(q, k, v, mask, causal=causal, scale=scale, plan=plan)


# ---- paged attention (torchtpu_export.llm.paged: a paged step's attention) -----------------------

PAGED_ATTENTION = "tte.paged_attention.default"


@lowers(PAGED_ATTENTION)
def paged_attention_xla(ctx, q, k_pages, v_pages, table, start, scale):
    """``q [B, H, n, d]`` against each row's pages of ``k_pages`` / ``v_pages [Hkv, pages, page, d]`` (``table
    [B, T]``), causally from position ``start [B]``: the pages gathered in sequence order (every page of the
    table), then grouped attention as ``scaled_dot_product_attention``'s rule computes it."""
    b, _, n, _ = q.shape
    hkv, _, page, _ = k_pages.shape
    t = table.shape[1]
    table = table.astype(jnp.int32)

    def gathered(pages):  # [Hkv, B, T, page, d] -> [B, Hkv, T * page, d]
        return jnp.take(pages, table, axis=1).transpose(1, 0, 2, 3, 4).reshape(b, hkv, t * page, pages.shape[-1])

    positions = start.astype(jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, n]
    visible = jnp.arange(t * page, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]  # never an empty row
    return scaled_dot_product_attention(ctx, q, gathered(k_pages).astype(q.dtype), gathered(v_pages).astype(q.dtype),
                                        visible[:, None], scale=scale, enable_gqa=True)


@lowers(PAGED_ATTENTION, platform="tpu")
def paged_attention_tpu(ctx, q, k_pages, v_pages, table, start, scale):
    """Decode rows (one query each): JAX's paged attention kernel; rows of several queries (prompt chunks, a
    mixed step's blocks): ours (``paged_blocks``). Neither declares its reads to the compiler: ``paged_cost``."""
    shapes = (_shape(q), _shape(k_pages), _shape(v_pages), _shape(table), k_pages.dtype)
    cost = paged_cost(_shape(q), _shape(k_pages), _shape(table), k_pages.dtype)
    operands = (q, k_pages, v_pages, table, start)
    candidates = []
    for name, plan_of, kernel in (("paged_attention", plan_paged, paged_attention),
                                  ("paged_blocks", plan_paged_blocks, paged_blocks_attention)):
        plan = plan_of(*shapes)
        candidates.append(Candidate(name, plan, functools.partial(kernel, scale=scale, plan=plan), operands, (scale,),
                                    None if isinstance(plan, Unfit) else cost))
    out = dispatch(ctx, *candidates)
    if out is not None:
        return out.astype(ctx.out_dtype())
    return paged_attention_xla(ctx, q, k_pages, v_pages, table, start, scale)


# ---- norms -----------------------------------------------------------------------------------

def _eps(eps, dtype):
    return float(jnp.finfo(dtype).eps) if eps is None else float(eps)


@lowers(aten.rms_norm.default)
def rms_norm_xla(ctx, x, normalized_shape, weight=None, eps=None):
    # torch's composite: normalise in float32 (for 16-bit inputs), round to x's dtype, then scale
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    acc = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else x.dtype
    xf = x.astype(acc)
    y = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + _eps(eps, x.dtype))).astype(x.dtype)
    if weight is not None:
        y = y * weight
    return y.astype(ctx.out_dtype())


def _norm_candidate(ctx, kernel: str, x, normalized_shape, weight, bias, eps, out_dtype=None) -> Candidate:
    """The norm kernel for this node; ``weight`` and ``bias`` may be None (bound, not operands)."""
    fit = plan_norm(_shape(x), len(normalized_shape), x.dtype, force=ctx.kernels == "pallas")
    nd = len(normalized_shape)
    params = [p for p in (weight, bias) if p is not None]
    has = (weight is not None, bias is not None)

    def call(x, *params):
        it = iter(params)
        w, b = (next(it) if has[0] else None), (next(it) if has[1] else None)
        if kernel == "rms_norm":
            return rms_norm(x, w, eps, normalized_ndim=nd, out_dtype=out_dtype, plan=fit)
        return layer_norm(x, w, b, eps, normalized_ndim=nd, out_dtype=out_dtype, plan=fit)

    shards = None
    if ctx.sharded:  # norms are replicated over the model axis: each device normalises its batch rows whole
        from jax.sharding import PartitionSpec as P
        b = _batch_axis(ctx, x.shape[0]) if x.ndim > nd else None
        nb = ctx.mesh_axes.get("data", 1) if b else 1
        shards = Shards((P(b), *[P()] * len(params)), P(b),
                        (_local(x, (x.shape[0] // nb,) + tuple(x.shape[1:])), *[_local(p, p.shape) for p in params]),
                        "the whole rows on every device" + (f", batch over {nb}" if b else ""))
        if b:
            fit = plan_norm(tuple(shards.local[0].shape), nd, x.dtype, force=ctx.kernels == "pallas")
    return Candidate(kernel, fit, call, (x, *params), (eps, nd, has, None if out_dtype is None else
                                                       jnp.dtype(out_dtype).name), shards=shards)


@lowers(aten.rms_norm.default, platform="tpu")
def rms_norm_tpu(ctx, x, normalized_shape, weight=None, eps=None):
    out = dispatch(ctx, _norm_candidate(ctx, "rms_norm", x, normalized_shape, weight, None, _eps(eps, x.dtype),
                                        ctx.out_dtype()))
    return out if out is not None else rms_norm_xla(ctx, x, normalized_shape, weight, eps)


@lowers(aten.native_layer_norm.default, platform="tpu")
def native_layer_norm_tpu(ctx, x, normalized_shape, weight, bias, eps):
    out = dispatch(ctx, _norm_candidate(ctx, "layer_norm", x, normalized_shape, weight, bias, float(eps)))
    if out is None:
        return _default(aten.native_layer_norm.default)(ctx, x, normalized_shape, weight, bias, eps)
    stats_used = any(u.target is not operator.getitem or u.args[1] != 0 for u in ctx.node.users)
    if not stats_used:  # inference reads only the output; mean and rstd would be dead code
        empty = jnp.zeros((0,), jnp.float32)
        return out, empty, empty
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    rstd = lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True) + eps)
    return out, mean, rstd


@lowers(aten.layer_norm.default, platform="tpu")
def layer_norm_tpu(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    # the composite op, as graphs that skip decomposition to core ATen carry it
    out = dispatch(ctx, _norm_candidate(ctx, "layer_norm", x, normalized_shape, weight, bias, float(eps)))
    return out if out is not None else _default(aten.layer_norm.default)(ctx, x, normalized_shape, weight, bias, eps)


# ---- int8 weight-only matmul -----------------------------------------------------------------

@lowers(aten._weight_int8pack_mm.default)
def weight_int8pack_mm(ctx, x, w, scales):
    acc = jnp.matmul(x, w.astype(x.dtype).T, preferred_element_type=jnp.float32)
    return (acc * scales.astype(jnp.float32)).astype(ctx.out_dtype())


@lowers(aten._weight_int8pack_mm.default, platform="tpu")
def weight_int8pack_mm_tpu(ctx, x, w, scales):
    # leading batch dims (F.linear kept whole) fold into M: the kernel takes (M, K) x (N, K)
    lead = x.shape[:-1]
    x2 = x.reshape((-1, x.shape[-1])) if x.ndim != 2 else x
    out = dispatch(ctx, _int8_candidate(ctx, x2, w, scales))
    if out is not None:
        return out.reshape(lead + (w.shape[0],)) if x.ndim != 2 else out
    return weight_int8pack_mm(ctx, x, w, scales)


def _int8_candidate(ctx, x2, w, scales) -> Candidate:
    fit = plan_int8_matmul(_shape(x2), _shape(w), x2.dtype, w.dtype, force=ctx.kernels == "pallas")
    out_dtype = ctx.out_dtype()
    return Candidate("int8_matmul", fit, functools.partial(int8_matmul, out_dtype=out_dtype, plan=fit), (x2, w, scales),
                     (jnp.dtype(out_dtype).name,))


# ---- weights quantized by the int8_weight_only recipe ----------------------------------------

def _quantized_weight(ctx, arg_index: int, transposed: bool):
    """(int8 [N, K], scales [N]) if the node's argument is a weight the int8_weight_only recipe stored
    quantized per output channel, reached directly (linear) or through one transpose (addmm/mm)."""
    node = ctx.node.args[arg_index] if arg_index < len(ctx.node.args) else None
    if transposed:
        if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
                and (node.target is aten.t.default or node.target is aten.permute.default
                     and list(node.args[1]) == [1, 0])):
            return None
        node = node.args[0]
    if not isinstance(node, torch.fx.Node) or node.name not in ctx.quantized_weights:
        return None
    q, scales, axis = ctx.quantized_weights[node.name]
    return (q, scales) if axis == 0 and q.ndim == 2 else None


def _int8_linear(ctx, x, q, scales, bias):
    lead = x.shape[:-1]
    x2 = x.reshape((-1, x.shape[-1]))
    out = dispatch(ctx, _int8_candidate(ctx, x2, q, scales.astype(x.dtype)))
    if out is None:
        return None
    out = out.reshape(lead + (q.shape[0],))
    return out if bias is None else out + bias.astype(out.dtype)


@lowers(aten.linear.default, platform="tpu")
def linear_tpu(ctx, x, w, bias=None):
    qw = _quantized_weight(ctx, 1, transposed=False)
    out = _int8_linear(ctx, x, *qw, bias) if qw else None
    return out if out is not None else _default(aten.linear.default)(ctx, x, w, bias)


@lowers(aten.addmm.default, platform="tpu")
def addmm_tpu(ctx, bias, x, w, *, beta=1, alpha=1):
    qw = _quantized_weight(ctx, 2, transposed=True) if beta == 1 and alpha == 1 else None
    out = _int8_linear(ctx, x, *qw, bias) if qw else None
    return out if out is not None else _default(aten.addmm.default)(ctx, bias, x, w, beta=beta, alpha=alpha)


@lowers(aten.mm.default, platform="tpu")
def mm_tpu(ctx, x, w):
    qw = _quantized_weight(ctx, 1, transposed=True)
    out = _int8_linear(ctx, x, *qw, None) if qw else None
    return out if out is not None else _default(aten.mm.default)(ctx, x, w)
