"""Hot ops: attention, norms, int8 weight-only matmul. XLA rules for every platform, Pallas on tpu.

Capture keeps ``KEEP_WHOLE`` as single nodes and ``fusion.py`` folds the
usual hand-written patterns into them, so each hot op reaches this file as
one node. On ``tpu`` a rule asks the kernel's ``plan_*`` whether the node's
shapes fit, then uses the kernel or the default (XLA) rule, and logs which
and why in ``ctx.kernel_log`` (the manifest's ``kernels``). ``kernels="xla"``
never uses a kernel; ``kernels="pallas"`` raises where a kernel cannot apply.
"""
from __future__ import annotations

import math
import operator

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu_export.capture import op_name, user_source_line
from torchtpu_export.errors import UnsupportedOpError

from .pallas import Unfit
from .pallas.attention import flash_attention, plan_attention
from .pallas.int8_matmul import int8_matmul, plan_int8_matmul
from .pallas.norm import layer_norm, plan_norm, rms_norm
from .registry import LOWERINGS, lowers

aten = torch.ops.aten

# Composite ops torch would decompose that this target keeps as one node.
# (aten.native_layer_norm and aten._weight_int8pack_mm are core ATen already.)
KEEP_WHOLE = [aten.scaled_dot_product_attention.default, aten.rms_norm.default]


def use_kernel(ctx, kernel: str, fit) -> bool:
    """Whether the node lowers to ``kernel`` (fit is its plan or an Unfit); logs the choice."""
    entry = {"node": ctx.node.name, "op": op_name(ctx.node.target)}
    if ctx.sharded:
        # XLA cannot partition a Mosaic kernel; it would need a shard_map per kernel
        fit = Unfit("the program is sharded over a mesh, and Pallas kernels are not partitioned automatically")
    if ctx.kernels == "xla":
        entry["reason"] = "kernels='xla'"
    elif isinstance(fit, Unfit):
        if ctx.kernels == "pallas":
            raise UnsupportedOpError(
                op_name(ctx.node.target), target="stablehlo (tpu, kernels='pallas')",
                reason=f"the Pallas {kernel} kernel cannot take node {ctx.node.name}: {fit.reason}",
                source=user_source_line(ctx.node),
                hint="export with kernels='auto' to lower such nodes with XLA")
        entry["reason"] = fit.reason
    else:
        entry["kernel"] = f"pallas.{kernel}"
        entry["detail"] = fit.describe()
    ctx.kernel_log.append(entry)
    return "kernel" in entry


def _default(op):
    return LOWERINGS[op][None]


def _shape(x) -> tuple:
    return tuple(x.shape)


# ---- scaled_dot_product_attention ------------------------------------------------------------

def _check_dropout(ctx, dropout_p):
    if dropout_p:
        raise UnsupportedOpError(op_name(ctx.node.target), target="stablehlo",
                                 reason=f"dropout_p={dropout_p}: attention dropout is random at inference too",
                                 source=user_source_line(ctx.node), hint="pass dropout_p=0.0 when not training")


@lowers(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    _check_dropout(ctx, dropout_p)
    out_dtype = ctx.out_dtype()
    e = q.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    lq, s = q.shape[-2], k.shape[-2]
    out_shape = q.shape[:-1] + v.shape[-1:]
    grouped = enable_gqa and q.shape[-3] != k.shape[-3]
    if grouped:
        # (..., Hkv, rep, L, E) against (..., Hkv, 1, S, E): each kv head serves rep query heads
        hkv = k.shape[-3]
        rep = q.shape[-3] // hkv
        q = q.reshape(q.shape[:-3] + (hkv, rep) + q.shape[-2:])
        k, v = k[..., None, :, :], v[..., None, :, :]
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
    out = jnp.einsum("...qk,...kd->...qd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(out_shape).astype(out_dtype)


@lowers(aten.scaled_dot_product_attention.default, platform="tpu")
def scaled_dot_product_attention_tpu(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                     enable_gqa=False):
    _check_dropout(ctx, dropout_p)
    fit = plan_attention(_shape(q), _shape(k), _shape(v), q.dtype,
                         None if attn_mask is None else _shape(attn_mask), force=ctx.kernels == "pallas")
    if not isinstance(fit, Unfit) and fit.groups > 1 and not enable_gqa:
        fit = Unfit("q and k/v head counts differ without enable_gqa")
    if use_kernel(ctx, "flash_attention", fit):
        return flash_attention(q, k, v, attn_mask, causal=bool(is_causal), scale=scale, plan=fit)
    return scaled_dot_product_attention(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                        enable_gqa=enable_gqa)


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


@lowers(aten.rms_norm.default, platform="tpu")
def rms_norm_tpu(ctx, x, normalized_shape, weight=None, eps=None):
    fit = plan_norm(_shape(x), len(normalized_shape), x.dtype, force=ctx.kernels == "pallas")
    if use_kernel(ctx, "rms_norm", fit):
        return rms_norm(x, weight, _eps(eps, x.dtype), normalized_ndim=len(normalized_shape),
                        out_dtype=ctx.out_dtype(), plan=fit)
    return rms_norm_xla(ctx, x, normalized_shape, weight, eps)


@lowers(aten.native_layer_norm.default, platform="tpu")
def native_layer_norm_tpu(ctx, x, normalized_shape, weight, bias, eps):
    fit = plan_norm(_shape(x), len(normalized_shape), x.dtype, force=ctx.kernels == "pallas")
    if not use_kernel(ctx, "layer_norm", fit):
        return _default(aten.native_layer_norm.default)(ctx, x, normalized_shape, weight, bias, eps)
    out = layer_norm(x, weight, bias, eps, normalized_ndim=len(normalized_shape), plan=fit)
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
    fit = plan_norm(_shape(x), len(normalized_shape), x.dtype, force=ctx.kernels == "pallas")
    if not use_kernel(ctx, "layer_norm", fit):
        return _default(aten.layer_norm.default)(ctx, x, normalized_shape, weight, bias, eps)
    return layer_norm(x, weight, bias, eps, normalized_ndim=len(normalized_shape), plan=fit)


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
    fit = plan_int8_matmul(_shape(x2), _shape(w), x.dtype, w.dtype, force=ctx.kernels == "pallas")
    if use_kernel(ctx, "int8_matmul", fit):
        out = int8_matmul(x2, w, scales, out_dtype=ctx.out_dtype(), plan=fit)
        return out.reshape(lead + (w.shape[0],)) if x.ndim != 2 else out
    return weight_int8pack_mm(ctx, x, w, scales)


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
    fit = plan_int8_matmul(_shape(x2), _shape(q), x.dtype, q.dtype, force=ctx.kernels == "pallas")
    if not use_kernel(ctx, "int8_matmul", fit):
        return None
    out = int8_matmul(x2, q, scales.astype(x.dtype), out_dtype=ctx.out_dtype(), plan=fit)
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
