"""Graph passes of the TPU target: fold hand-written hot-op patterns of core ATen into one node each.

A pass rewrites a captured graph in place and returns how many patterns it
folded. Each rewrite keeps the node's value (its FakeTensor) and replaces a
chain of nodes by one ATen op with the same meaning, which ``ops_hot.py``
lowers (to a Pallas kernel on tpu). ``PASSES`` runs in order.
"""
from __future__ import annotations

import torch
from torch import fx

from torchtpu_export.capture import CapturedProgram
from torchtpu_export.fxnodes import shape_of

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _shape(node) -> tuple | None:
    """The node's shape (symbolic dims as strings, comparable by name), or None for a non-tensor."""
    val = _val(node)
    return shape_of(val) if isinstance(val, torch.Tensor) else None


def _only_user(node, user) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1 and user in node.users


def _rename(node: fx.Node, name: str) -> None:
    """Names a rewritten node after its new op (kernel logs show node names), unless it is a graph
    output, whose name the ExportedProgram's signature holds."""
    if hasattr(node, "_rename") and not any(u.op == "output" for u in node.users):
        node._rename(name)


def _erase_unused(graph: fx.Graph, *nodes) -> None:
    """Erases the nodes (given consumers first) that nothing uses any more."""
    for n in nodes:
        if isinstance(n, fx.Node) and n.op == "call_function" and not n.users and n.graph is graph:
            graph.erase_node(n)


# ---- RMSNorm ---------------------------------------------------------------------------------

def _squared(node):
    """x for ``x ** 2`` or ``x * x``."""
    if _is(node, aten.pow.Tensor_Scalar) and node.args[1] == 2:
        return node.args[0]
    if _is(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def fuse_rms_norm(graph: fx.Graph) -> int:
    """``x * rsqrt(mean(x**2, trailing dims, keepdim) + eps) [* w]`` -> ``aten.rms_norm(x, shape, w, eps)``."""
    count = 0
    for rsqrt in list(graph.nodes):
        if not _is(rsqrt, aten.rsqrt.default) or len(rsqrt.users) != 1:
            continue
        add = rsqrt.args[0]
        if not (_is(add, aten.add.Tensor) and _only_user(add, rsqrt) and add.kwargs.get("alpha", 1) == 1):
            continue
        mean, eps = add.args[:2]
        if isinstance(mean, (int, float)):
            mean, eps = eps, mean
        if not (_is(mean, aten.mean.dim) and isinstance(eps, (int, float)) and _only_user(mean, add)):
            continue
        sq, dims = mean.args[0], mean.args[1]
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        x = _squared(sq)
        xshape = _shape(x)
        if x is None or not _only_user(sq, mean) or not keepdim or mean.kwargs.get("dtype") is not None \
                or xshape is None or not _val(x).dtype.is_floating_point:
            continue
        nd = len(xshape)
        if not dims or sorted(d % nd for d in dims) != list(range(nd - len(dims), nd)):
            continue
        norm = next(iter(rsqrt.users))
        if not (_is(norm, aten.mul.Tensor) and {norm.args[0], norm.args[1]} == {x, rsqrt}):
            continue
        normalized = list(xshape[nd - len(dims):])
        if not all(isinstance(n, int) for n in normalized):
            continue
        final, weight = norm, None
        if len(norm.users) == 1:
            scaled = next(iter(norm.users))
            if _is(scaled, aten.mul.Tensor) and norm in scaled.args[:2]:
                w = scaled.args[1] if scaled.args[0] is norm else scaled.args[0]
                if w is not norm and _shape(w) is not None and list(_shape(w)) == normalized:
                    final, weight = scaled, w
        final.target, final.args, final.kwargs = aten.rms_norm.default, (x, normalized, weight, float(eps)), {}
        _erase_unused(graph, norm, rsqrt, add, mean, sq)
        _rename(final, "rms_norm")
        count += 1
    return count


# ---- GQA: k/v repeated per query head --------------------------------------------------------

def _repeat_interleaved(node):
    """(source, repeats, chain) when ``node`` is ``source.repeat_interleave(repeats, dim=1)`` of a 4-D tensor.

    Decomposed, both ``repeat_interleave`` and HF's ``x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)``
    capture as view(clone(expand(unsqueeze(x, 2)))); graphs that skip decomposition keep
    ``aten.repeat_interleave.self_int`` itself. A tiled ``repeat`` does not match.
    """
    if _is(node, aten.repeat_interleave.self_int):
        source, rep = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        shape = _shape(source)
        if shape is None or len(shape) != 4 or dim not in (1, -3) or not isinstance(rep, int):
            return None
        return source, rep, (node,)
    if not _is(node, *_VIEWS):
        return None
    expand = node.args[0]
    clone = None
    if _is(expand, aten.clone.default):
        clone, expand = expand, expand.args[0]
    if not _is(expand, aten.expand.default):
        return None
    lifted = expand.args[0]
    out, big, small = _shape(node), _shape(expand), _shape(lifted)
    if out is None or big is None or small is None or len(out) != 4 or len(big) != 5 or len(small) != 5:
        return None
    b, hkv, rep, s, d = big
    if not (isinstance(hkv, int) and isinstance(rep, int)) or small != (b, hkv, 1, s, d) \
            or out != (b, hkv * rep, s, d):
        return None
    if _is(lifted, aten.unsqueeze.default) and lifted.args[1] in (2, -3):
        source = lifted.args[0]
    elif _is(lifted, *_VIEWS):
        source = lifted.args[0]
    else:
        return None
    if _shape(source) != (b, hkv, s, d):
        return None
    return source, rep, (node, clone, expand, lifted)


def fold_repeated_kv_into_gqa(graph: fx.Graph) -> int:
    """``sdpa(q, repeat_interleave(k), repeat_interleave(v))`` -> ``sdpa(q, k, v, enable_gqa=True)``."""
    count = 0
    for node in list(graph.nodes):
        if not _is(node, aten.scaled_dot_product_attention.default) or node.kwargs.get("enable_gqa"):
            continue
        q, k, v = node.args[:3]
        rk, rv = _repeat_interleaved(k), _repeat_interleaved(v)
        if rk is None or rv is None or rk[1] != rv[1] or _shape(q) is None or len(_shape(q)) != 4 \
                or _shape(q)[1] != _shape(rk[0])[1] * rk[1]:
            continue
        node.args = (q, rk[0], rv[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        _erase_unused(graph, *rk[2], *rv[2])
        count += 1
    return count


# ---- int8 weight-only linear -----------------------------------------------------------------

def _dequantized(node):
    """(w, scale, chain) when ``node`` is ``w.to(float) * scale[:, None]`` with w int8 (N, K), scale (N,)."""
    if not _is(node, aten.mul.Tensor):
        return None
    for conv, col in (node.args[:2], node.args[1::-1]):
        if not _is(conv, aten._to_copy.default, aten.to.dtype) or _val(conv.args[0]) is None \
                or _val(conv.args[0]).dtype != torch.int8 or _shape(conv.args[0]) is None:
            continue
        w = conv.args[0]
        n = _shape(w)[0]
        if len(_shape(w)) != 2 or _shape(col) != (n, 1):
            continue
        if _is(col, aten.unsqueeze.default) and col.args[1] in (1, -1) or _is(col, *_VIEWS):
            scale = col.args[0]
            if _shape(scale) == (n,):
                return w, scale, (node, conv, col)
    return None


def _dequantized_transpose(node):
    """(w, scale, chain) when ``node`` is ``(w.to(float) * scale[:, None]).T``."""
    if not (_is(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        return None
    found = _dequantized(node.args[0])
    return None if found is None else (found[0], found[1], (node, *found[2]))


def fuse_int8_weight_matmul(graph: fx.Graph) -> int:
    """``x @ (w_int8.to(dtype) * scale[:, None]).T [+ bias]`` -> ``aten._weight_int8pack_mm(x, w, scale) [+ bias]``."""
    count = 0
    for node in list(graph.nodes):
        if _is(node, aten.mm.default):
            bias, x, wt = None, *node.args[:2]
        elif _is(node, aten.addmm.default) and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
            bias, x, wt = node.args[:3]
        elif _is(node, aten.linear.default):  # graphs that skip decomposition keep F.linear whole
            x, w_expr = node.args[:2]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            found = _dequantized(w_expr)
            wt = None
        else:
            continue
        if wt is not None:
            found = _dequantized_transpose(wt)
        if found is None:
            continue
        w, scale, chain = found
        dtype = _val(node).dtype
        if _val(x).dtype != dtype or _val(scale).dtype != dtype or dtype not in (torch.float32, torch.bfloat16,
                                                                                   torch.float16):
            continue
        if bias is None:
            node.target, node.args, node.kwargs = aten._weight_int8pack_mm.default, (x, w, scale), {}
            _rename(node, "weight_int8pack_mm")
        else:
            with graph.inserting_before(node):
                mm = graph.call_function(aten._weight_int8pack_mm.default, (x, w, scale), name="weight_int8pack_mm")
            mm.meta = {k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")}
            node.target, node.args, node.kwargs = aten.add.Tensor, (mm, bias), {}
        _erase_unused(graph, *chain)
        count += 1
    return count


PASSES = [fuse_rms_norm, fold_repeated_kv_into_gqa, fuse_int8_weight_matmul]


def fuse_hot_ops(captured: CapturedProgram) -> dict[str, int]:
    """Runs ``PASSES`` over the captured graph in place; returns the rewrites per pass."""
    graph = captured.graph
    counts = {p.__name__: p(graph) for p in PASSES}
    if any(counts.values()):
        graph.lint()
        captured.exported.graph_module.recompile()
    return counts
