"""Builders written in torch ops: a function traced on a node's static shapes into core ATen, whose
nodes the other builders then lower in place (``@composite(aten.X.overload)``, and ``inline`` for a
builder that hands part of its work to such a function)."""
from __future__ import annotations

import operator

import numpy as np
import torch
from torch.fx.node import map_arg

from torchtpu_export.capture import decomposition_table
from torchtpu_export.fxnodes import op_name

from .ir import Tensor
from .lower import IGNORED, build_node, constant_tensor
from .registry import BUILDERS, BuildContext, keep_whole


def composite(*ops):
    """Registers a torch function as the TFLite builder of ``ops``: for each node it is traced on the
    node's (static) shapes into core ATen, and the other builders lower that graph in place.

    For ops TFLite has no builtin for, written once in torch ops TFLite has (a scan unrolled, a
    series, a fixed-iteration solver)::

        @composite(aten.cumprod.default)
        def cumprod(x, dim, dtype=None): ...
    """
    def register(fn):
        def rule(ctx, *args, **kwargs):
            return inline(ctx, fn, args, kwargs)
        rule.__name__ = rule.__qualname__ = fn.__name__
        rule.composite = fn
        for op in ops:
            BUILDERS[op] = rule
        return fn
    return register


_TORCH_DTYPE = {np.dtype(np.float32): torch.float32, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool,
                np.dtype(np.complex64): torch.complex64, np.dtype(np.uint32): torch.uint32,
                np.dtype(np.float16): torch.float16, np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8}


def inline(ctx: BuildContext, fn, args, kwargs):
    """Lowers ``fn(*args, **kwargs)`` (torch ops, traced on the tensors' static shapes and their
    dtypes in the model) through the other builders: the body of a :func:`composite`."""
    import torch.utils._pytree as pytree
    from torch.fx.experimental.proxy_tensor import make_fx

    outer = ctx.node
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    examples = []
    for i in slots:
        t = leaves[i]
        shape = ctx.static(t.shape, "its lowering is traced on static shapes")
        examples.append(torch.zeros(shape, dtype=_TORCH_DTYPE[t.dtype]))

    def traced(*tensors):
        values = list(leaves)
        for i, x in zip(slots, tensors):
            values[i] = x
        a, k = pytree.tree_unflatten(values, spec)
        return fn(*a, **k)

    gm = make_fx(torch.func.functionalize(traced, remove="mutations"),
                 decomposition_table=decomposition_table(keep_whole()), tracing_mode="fake")(*examples)
    env: dict = {}
    placeholders = iter(leaves[i] for i in slots)
    aten = torch.ops.aten
    # in-place view ops that decompositions inside the trace leave (a vector-matrix matmul's squeeze_):
    # on values they are their functional twins
    functional = {aten.squeeze_.dim: aten.squeeze.dim, aten.squeeze_.dims: aten.squeeze.dims,
                  aten.unsqueeze_.default: aten.unsqueeze.default, aten.transpose_.default: aten.transpose.int,
                  aten.t_.default: aten.t.default}
    for node in gm.graph.nodes:
        node.target = functional.get(node.target, node.target)
    try:
        for node in gm.graph.nodes:
            ctx.node = node
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":
                value = getattr(gm, node.target)
                env[node] = constant_tensor(node, value, name=f"{outer.name}/{node.name}")
            elif node.op == "call_function":
                if node.target is not operator.getitem and node.target not in IGNORED \
                        and node.target not in BUILDERS:
                    ctx.node = outer
                    raise ctx.unsupported(f"its lowering uses {op_name(node.target)}, which has no TFLite builder")
                env[node] = build_node(ctx, node, env)
            elif node.op == "output":
                result = map_arg(node.args[0], env.__getitem__)
    finally:
        ctx.node = outer
    val = outer.meta.get("val")
    if isinstance(val, (tuple, list)):
        return tuple(ctx.cast(r, ctx.out_dtype(i)) if isinstance(r, Tensor) else r for i, r in enumerate(result))
    if isinstance(result, (tuple, list)):
        (result,) = result
    return ctx.cast(result, ctx.out_dtype())
