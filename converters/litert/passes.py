"""The conversion pipeline: every pass, in the order it runs.

The first passes rewrite the captured ATen program (their values are torch
tensors, computed once by torch itself); ``lower`` turns it into the TFLite
graph IR; the rest rewrite that graph. Each pass takes and returns its
program; each is linear in the graph's size (the layout pass adds a max-flow
over the activations, which is near-linear on these graphs).
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from .dims import all_static
from .ir import Graph, Op, Tensor, shape_input
from .layout import ELEMENTWISE, REDUCERS, assign_nhwc_layout
from .lower import AtenProgram, live_nodes, lower
from .quantize import calibrate_activations, fold_quantize_dequantize, quantize_activations, quantize_weights

aten = torch.ops.aten


# ---- on the ATen program -------------------------------------------------------------------

_CONVS = {aten.convolution.default, aten.conv2d.default, aten.conv1d.default, aten.conv3d.default}
# batch-norm overload -> index of its eps argument
_BATCH_NORMS = {aten._native_batch_norm_legit_no_training.default: 6, aten.batch_norm.default: 7}


def _conv_parts(node):
    # (weight node, bias node or None, transposed, groups) of a convolution node.
    if node.target is aten.convolution.default:
        x, w, b, stride, padding, dilation, transposed, out_pad, groups = node.args
        return w, b, transposed, groups
    args = list(node.args) + [None] * 7
    groups = node.kwargs.get("groups", args[6] if args[6] is not None else 1)
    return args[1], args[2] if len(node.args) > 2 else node.kwargs.get("bias"), False, groups


def fold_batch_norm(prog: AtenProgram) -> AtenProgram:
    """Inference batch norms right after a convolution or linear layer become part of its weights."""
    consts = prog.constants
    for bn in list(prog.graph.nodes):
        if bn.op != "call_function" or bn.target not in _BATCH_NORMS:
            continue
        producer = bn.args[0]
        if not isinstance(producer, torch.fx.Node) or len(producer.users) != 1:
            continue
        if bn.target is aten.batch_norm.default and bn.args[5]:
            continue  # training-mode batch norm uses batch statistics
        w_bn, b_bn, mean, var = bn.args[1:5]
        eps = bn.args[_BATCH_NORMS[bn.target]]
        if any(p is not None and p not in consts for p in (w_bn, b_bn, mean, var)) or mean is None:
            continue
        if producer.target in _CONVS:
            w, b, transposed, groups = _conv_parts(producer)
            channel_axis = 1 if transposed else 0
            if transposed and groups != 1:
                continue
        elif producer.target is aten.linear.default:
            w, b = producer.args[1], producer.args[2] if len(producer.args) > 2 else None
            channel_axis = 0
            if len(producer.meta["val"].shape) != 2:
                continue  # BatchNorm1d over (N, C, L) normalises another dim than the linear's output
        else:
            continue
        if w not in consts or (b is not None and b not in consts):
            continue
        scale = consts[var].double().add(eps).rsqrt()
        if w_bn is not None:
            scale = scale * consts[w_bn].double()
        shift = -consts[mean].double() * scale
        if b_bn is not None:
            shift = shift + consts[b_bn].double()
        weight = consts[w]
        shape = [1] * weight.dim()
        shape[channel_axis] = -1
        # per-channel factors in float64, the (large) weight scaled once in its own dtype
        new_w = weight * scale.to(weight.dtype).reshape(shape)
        bias = consts[b].double() if b is not None else torch.zeros_like(shift)
        new_b = (bias * scale + shift).to(weight.dtype)
        with prog.graph.inserting_before(producer):
            w_node = prog.graph.get_attr(f"{producer.name}_bn_weight")
            b_node = prog.graph.get_attr(f"{producer.name}_bn_bias")
        w_node.meta["val"], b_node.meta["val"] = new_w, new_b
        consts[w_node], consts[b_node] = new_w, new_b
        args = list(producer.args)
        args[1] = w_node
        if len(args) > 2:
            args[2] = b_node
            producer.args = tuple(args)
        else:
            producer.args = tuple(args)
            producer.kwargs = {**producer.kwargs, "bias": b_node}
        out = bn if bn.target is aten.batch_norm.default else \
            next((u for u in bn.users if u.target is operator.getitem and u.args[1] == 0), None)
        if out is not None:
            out.replace_all_uses_with(producer)
    return prog


# Results not worth storing: constants are folded only while they stay about as small as their inputs.
_FOLD_MIN_BYTES = 1 << 16
_NEVER_FOLD = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
               aten.new_empty.default}


def fold_constants(prog: AtenProgram) -> AtenProgram:
    """Nodes whose inputs are all known are computed now, by torch, and stored as constants."""
    consts = prog.constants
    for node in live_nodes(prog):
        if node.op != "call_function" or node in consts:
            continue
        if node.target is operator.getitem:
            src = node.args[0]
            if src in consts and isinstance(consts[src], (tuple, list)):
                consts[node] = consts[src][node.args[1]]
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or node.target in _NEVER_FOLD \
                or torch.Tag.nondeterministic_seeded in node.target.tags:
            continue
        if any(n not in consts for n in node.all_input_nodes):
            continue
        vals = node.meta.get("val")
        outs = vals if isinstance(vals, (tuple, list)) else [vals]
        if not all(isinstance(o, torch.Tensor) and not _symbolic(o) for o in outs):
            continue
        in_bytes = sum(consts[n].numel() * consts[n].element_size() for n in node.all_input_nodes
                       if isinstance(consts[n], torch.Tensor))
        out_bytes = sum(o.numel() * o.element_size() for o in outs)
        if out_bytes > max(in_bytes, _FOLD_MIN_BYTES):
            continue
        args = torch.fx.node.map_arg(node.args, consts.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, consts.__getitem__)
        try:
            with torch.no_grad():
                value = node.target(*args, **kwargs)
        except Exception:  # a builder will handle it at run time instead
            continue
        consts[node] = value
    return prog


def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(d, torch.SymInt) for d in t.shape)


# ---- on the TFLite graph -------------------------------------------------------------------

def _perm(op: Op) -> tuple:
    return tuple(int(p) for p in op.inputs[1].data)


def _drop_ops(g: Graph, fold) -> Graph:
    """The walk of the passes that remove ops. Each op first reads its inputs through the replacements
    made so far; then ``fold(op)`` returns None to keep it, a tensor that stands for its output from
    now on (the op is dropped), or True to drop it because it moved its result elsewhere itself."""
    alias: dict[int, Tensor] = {}
    kept = []
    for op in g.ops:
        op.inputs = [alias.get(id(t), t) if t is not None else None for t in op.inputs]
        replacement = fold(op)
        if replacement is None:
            kept.append(op)
        elif replacement is not True:
            alias[id(op.outputs[0])] = replacement
    g.ops = kept
    g.outputs = [alias.get(id(t), t) for t in g.outputs]
    return g


def compose_transposes(g: Graph) -> Graph:
    """A TRANSPOSE of a TRANSPOSE reads the first one's input; one that undoes the other vanishes."""
    producer: dict[int, Op] = {}
    outputs = {id(t) for t in g.outputs}

    def fold(op):
        if op.code == "TRANSPOSE" and op.inputs[1].is_const:
            src = producer.get(id(op.inputs[0]))
            if src is not None and src.code == "TRANSPOSE" and src.inputs[1].is_const:
                p1, p2 = _perm(src), _perm(op)
                c = tuple(p1[k] for k in p2)
                y = op.outputs[0]
                if c == tuple(range(len(c))) and not y.channels_last and id(y) not in outputs:
                    return src.inputs[0]
                op.inputs = [src.inputs[0], Tensor(op.inputs[1].name, (len(c),), np.int32, np.asarray(c, np.int32))]
        for t in op.outputs:
            producer[id(t)] = op
        return None

    return eliminate_dead_code(_drop_ops(g, fold))


def simplify_moves(g: Graph) -> Graph:
    """TRANSPOSEs that only move size-1 dims become RESHAPEs; chains of RESHAPEs become one."""
    producer: dict[int, Op] = {}
    ops = []
    for op in g.ops:
        if op.code == "TRANSPOSE" and op.inputs[1].is_const:
            perm, x = _perm(op), op.inputs[0]
            kept = [p for p in perm if x.shape[p] != 1]
            shape = shape_input(op.outputs[0].shape, x) if kept == sorted(kept) else None
            if shape is not None:
                ops += shape[1]
                op.code = "RESHAPE"
                op.inputs = [x, shape[0]]
        if op.code == "RESHAPE":
            # a dynamic target keeps its run-time operand, which computes this very output shape
            shape = shape_input(op.outputs[0].shape)
            target = shape[0] if shape is not None else op.inputs[1]
            src = producer.get(id(op.inputs[0]))
            if src is not None and src.code == "RESHAPE":
                op.inputs = [src.inputs[0], target]
            else:
                op.inputs = [op.inputs[0], target]
        for t in op.outputs:
            producer[id(t)] = op
        ops.append(op)
    g.ops = ops
    return eliminate_dead_code(g)


def drop_kept_dims(g: Graph) -> Graph:
    """A reduction that keeps its reduced dims, read only by a RESHAPE dropping them, drops them itself."""
    producer = g.producers()
    users = g.consumers()
    outputs = {id(t) for t in g.outputs}

    def fold(op):
        if op.code == "RESHAPE":
            red = producer.get(id(op.inputs[0]))
            if red is not None and red.code in REDUCERS and red.options.get("keepDims") and red.inputs[1].is_const \
                    and len(users.get(id(op.inputs[0]), [])) == 1 and id(op.inputs[0]) not in outputs:
                x = red.inputs[0]
                axes = {int(a) % x.rank for a in np.asarray(red.inputs[1].data).reshape(-1)}
                dropped = tuple(d for i, d in enumerate(x.shape) if i not in axes)
                if dropped == op.outputs[0].shape:
                    red.options["keepDims"] = False
                    red.outputs = [op.outputs[0]]
                    return True
        return None

    return _drop_ops(g, fold)


def _same_pads(n: int, k: int, s: int, d: int) -> tuple[int, int, int]:
    # TFLite SAME padding for one spatial dim: (output size, pad before, pad after).
    out = -(-n // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
    return out, total // 2, total - total // 2


_WINDOWED = {"CONV_2D": ("strideH", "strideW"), "DEPTHWISE_CONV_2D": ("strideH", "strideW"),
             "MAX_POOL_2D": ("strideH", "strideW")}


def use_same_padding(g: Graph) -> Graph:
    """A PAD feeding a VALID conv (or a -inf PADV2 feeding a max pool) that equals SAME padding becomes SAME."""
    producer = g.producers()
    users = g.consumers()
    outputs = {id(t) for t in g.outputs}
    for op in g.ops:
        if op.code not in _WINDOWED or op.options.get("padding") != 1:
            continue
        pad = producer.get(id(op.inputs[0]))
        if pad is None or len(users.get(id(op.inputs[0]), [])) != 1 or id(op.inputs[0]) in outputs:
            continue
        if op.code == "MAX_POOL_2D":
            if pad.code != "PADV2" or not pad.inputs[2].is_const or \
                    float(pad.inputs[2].data) > float(np.finfo(np.float32).min) / 2:
                continue
        elif pad.code != "PAD":
            continue
        spec = pad.inputs[1].data if pad.inputs[1].is_const else None
        x = pad.inputs[0]
        if spec is None or x.rank != 4 or spec[0].any() or spec[3].any() or not all_static(x.shape[1:3]):
            continue
        if op.code == "MAX_POOL_2D":
            kernel = (op.options["filterHeight"], op.options["filterWidth"])
            dil = (1, 1)
        else:
            f = op.inputs[1].shape
            kernel = (f[1], f[2])
            dil = (op.options.get("dilationHFactor", 1), op.options.get("dilationWFactor", 1))
        strides = (op.options["strideH"], op.options["strideW"])
        ok = True
        for i in range(2):
            out, before, after = _same_pads(x.shape[1 + i], kernel[i], strides[i], dil[i])
            if (before, after) != tuple(int(v) for v in spec[1 + i]) or out != op.outputs[0].shape[1 + i]:
                ok = False
        if ok:
            op.inputs[0] = x
            op.options["padding"] = 0
    return eliminate_dead_code(g)


def use_depthwise_conv(g: Graph) -> Graph:
    """A CONV_2D whose groups are its input channels becomes DEPTHWISE_CONV_2D."""
    for op in g.ops:
        if op.code != "CONV_2D":
            continue
        x, f = op.inputs[0], op.inputs[1]
        c, o = x.shape[3], f.shape[0]
        if f.shape[3] != 1 or c == 1 or o % c or not f.is_const:
            continue
        op.code = "DEPTHWISE_CONV_2D"
        data = np.require(np.transpose(f.data, (3, 1, 2, 0)), requirements="C")  # (O, kh, kw, 1) -> (1, kh, kw, O)
        op.inputs[1] = Tensor(f.name, data.shape, f.dtype, data)
        op.options = {"padding": op.options["padding"], "strideH": op.options["strideH"],
                      "strideW": op.options["strideW"], "depthMultiplier": o // c,
                      "dilationHFactor": op.options.get("dilationHFactor", 1),
                      "dilationWFactor": op.options.get("dilationWFactor", 1),
                      "fusedActivationFunction": op.options.get("fusedActivationFunction", 0)}
    return g


def use_fully_connected(g: Graph) -> Graph:
    """BATCH_MATMUL by a constant matrix becomes FULLY_CONNECTED; a constant bias ADD after it joins it."""
    for op in g.ops:
        if op.code == "BATCH_MATMUL" and op.inputs[1].is_const and op.inputs[1].rank == 2 \
                and op.inputs[0].dtype.kind == "f" and not op.options.get("adjX"):
            w = op.inputs[1].data
            w = w if op.options.get("adjY") else w.T
            op.code = "FULLY_CONNECTED"
            op.inputs = [op.inputs[0], Tensor(op.inputs[1].name, w.shape, w.dtype, np.require(w, requirements="C")), None]
            op.options = {"keepNumDims": True} if op.inputs[0].rank > 2 else {}
    producer = g.producers()
    users = g.consumers()
    outputs = {id(t) for t in g.outputs}

    def fold(op):
        if op.code == "ADD" and not op.options.get("fusedActivationFunction"):
            a, b = op.inputs
            fc = producer.get(id(a))
            if fc is not None and fc.code == "FULLY_CONNECTED" and (len(fc.inputs) < 3 or fc.inputs[2] is None) \
                    and b.is_const and b.size == fc.inputs[1].shape[0] and b.shape[-1:] == (b.size,) \
                    and len(users.get(id(a), [])) == 1 and id(a) not in outputs \
                    and op.outputs[0].shape == a.shape and not fc.options.get("fusedActivationFunction"):
                bias = np.require(b.data.reshape(-1), requirements="C")
                fc.inputs = fc.inputs[:2] + [Tensor(b.name, bias.shape, b.dtype, bias)]
                return a
        return None

    return _drop_ops(g, fold)


# Folding copies the weights it scales (once per conversion: ir.derived), so it stops at
# FOLD_COPY_BUDGET bytes of copies: a large model (an LLM's norms before every projection) converts in
# about the memory its weights take, and keeps those norms' MULs, a pass over activations that costs
# little next to the matmuls.
FOLD_COPY_BUDGET = 64 << 20


def _scaled_columns(w: np.ndarray, vec: np.ndarray) -> np.ndarray | None:
    from .ir import derived, derived_bytes
    if derived_bytes("scaled") + w.nbytes > FOLD_COPY_BUDGET:
        return None
    return derived("scaled", w, vec.tobytes(), lambda: np.require(
        (w * vec.astype(w.dtype)[None, :]).astype(w.dtype, copy=False), requirements="C"))


def fold_affine_into_fully_connected(g: Graph) -> Graph:
    """``x * c`` and ``x + c`` (c constant along the last axis) read only by FULLY_CONNECTED layers become
    part of their weights and biases: a norm's scale and shift cost nothing before a linear layer."""
    users = g.consumers()
    outputs = {id(t) for t in g.outputs}
    dead: set[int] = set()
    for op in reversed(g.ops):
        if op.code not in ("MUL", "ADD") or op.options.get("fusedActivationFunction") or len(op.inputs) != 2:
            continue
        x, c = op.inputs
        if x.is_const:
            x, c = c, x
        y = op.outputs[0]
        if not c.is_const or x.is_const or x.dtype != np.float32 or y.shape != x.shape or id(y) in outputs:
            continue
        k = x.shape[-1] if x.rank else 0
        if not k or c.size not in (1, k) or (c.size == k and c.shape[-1:] != (k,)):
            continue
        fcs = users.get(id(y), [])
        if not fcs or any(u.code != "FULLY_CONNECTED" or u.inputs[0] is not y or not u.inputs[1].is_const
                          or any(t is y for t in u.inputs[1:]) or len(users.get(id(u.inputs[1]), [])) != 1
                          or (len(u.inputs) > 2 and u.inputs[2] is not None and not u.inputs[2].is_const)
                          for u in fcs):
            continue  # a weight another op also reads (tied embeddings) stays as it is
        vec = np.broadcast_to(c.data.reshape(-1), (k,)).astype(np.float64)
        if op.code == "MUL":
            scaled = [_scaled_columns(fc.inputs[1].data, vec) for fc in fcs]
            if any(w is None for w in scaled):
                continue  # past the copy budget: the MUL stays (one pass over activations, no copy of weights)
        for j, fc in enumerate(fcs):
            w = fc.inputs[1].data
            if op.code == "MUL":
                fc.inputs[1] = Tensor(fc.inputs[1].name, w.shape, w.dtype, scaled[j])
            else:
                bias = fc.inputs[2].data.astype(np.float64) if len(fc.inputs) > 2 and fc.inputs[2] is not None \
                    else np.zeros(w.shape[0])
                new_b = (bias + w.astype(np.float64) @ vec).astype(w.dtype)
                fc.inputs = fc.inputs[:2] + [Tensor(f"{fc.inputs[1].name}/bias", new_b.shape, w.dtype, new_b)]
            fc.inputs[0] = x
            users.setdefault(id(x), []).append(fc)
        users[id(x)] = [u for u in users[id(x)] if u is not op]
        dead.add(id(op))
    g.ops = [op for op in g.ops if id(op) not in dead]
    return g


_FUSIBLE = {"ADD", "SUB", "MUL", "DIV", "CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "TRANSPOSE_CONV",
            "AVERAGE_POOL_2D", "MAX_POOL_2D", "CONCATENATION"}
# TANH is never fused although the schema allows it: LiteRT's CPU kernels ignore a fused TANH
# (ADD, MUL and CONV_2D return the input unchanged) or reject it (FULLY_CONNECTED), and XNNPACK
# refuses such ops (checked with ai-edge-litert 2.3.0).
_ACTIVATIONS = {"RELU": 1, "RELU_N1_TO_1": 2, "RELU6": 3}


def fuse_activations(g: Graph) -> Graph:
    """RELU, RELU6, RELU_N1_TO_1 after an op that can fuse them become its fused activation."""
    producer = g.producers()
    users = g.consumers()
    outputs = {id(t) for t in g.outputs}

    def fold(op):
        if op.code in _ACTIVATIONS and op.inputs[0].dtype == np.float32:
            x = op.inputs[0]
            src = producer.get(id(x))
            if src is not None and src.code in _FUSIBLE and not src.options.get("fusedActivationFunction") \
                    and len(users.get(id(x), [])) == 1 and id(x) not in outputs and len(src.outputs) == 1:
                src.options["fusedActivationFunction"] = _ACTIVATIONS[op.code]
                return x
        return None

    return _drop_ops(g, fold)


# Ops whose results are never negative (fused activations by code: RELU 1, RELU6 3).
_NONNEGATIVE = {"RELU", "RELU6", "RELU_0_TO_1", "LOGISTIC", "ABS", "SQRT", "EXP"}


def pad_max_pool_with_zeros(g: Graph) -> Graph:
    """A max pool's -inf padding (PADV2, not delegated to XNNPACK) is a zero PAD when its input is never negative."""
    producer = g.producers()
    users = g.consumers()
    for op in g.ops:
        if op.code != "PADV2" or not op.inputs[2].is_const:
            continue
        if float(op.inputs[2].data.reshape(-1)[0]) > float(np.finfo(np.float32).min) / 2:
            continue
        if any(u.code != "MAX_POOL_2D" for u in users.get(id(op.outputs[0]), [])):
            continue
        src = producer.get(id(op.inputs[0]))
        if src is not None and (src.code in _NONNEGATIVE or src.options.get("fusedActivationFunction") in (1, 3)):
            op.code = "PAD"
            op.inputs = op.inputs[:2]
    return g


def eliminate_dead_code(g: Graph) -> Graph:
    """Ops whose results nothing reads are removed."""
    live = {id(t) for t in g.outputs}
    kept = []
    for op in reversed(g.ops):
        if any(id(t) in live for t in op.outputs):
            kept.append(op)
            live.update(id(t) for t in op.inputs if t is not None)
    g.ops = kept[::-1]
    return g


def name_outputs(g: Graph) -> Graph:
    """Every signature output is its own tensor, written by an op and named as the signature says."""
    inputs = {id(t) for t in g.inputs}
    seen: set[int] = set()
    outs = []
    for t, name in zip(g.outputs, g.output_names):
        if t.is_const or id(t) in inputs or id(t) in seen:
            copy = Tensor(name, t.shape, t.dtype)
            shape, shape_ops = shape_input(t.shape, t)
            g.ops += shape_ops
            g.ops.append(Op("RESHAPE", [t, shape], [copy]))
            t = copy
        t.name = name
        seen.add(id(t))
        outs.append(t)
    g.outputs = outs
    return g


# Ops whose output shape LiteRT derives from their inputs' shapes alone (the rest read shapes from
# tensors: from constants they do so when preparing the model; from run-time values only when
# invoked, which leaves the output "dynamic").
_SHAPE_FROM_SHAPES = ELEMENTWISE | {
    "FULLY_CONNECTED", "BATCH_MATMUL", "CONV_2D", "DEPTHWISE_CONV_2D", "CONV_3D", "CONCATENATION", "SOFTMAX",
    "LOG_SOFTMAX", "GATHER", "EMBEDDING_LOOKUP", "MAX_POOL_2D", "AVERAGE_POOL_2D", "CUMSUM", "SELECT", "PACK",
    "UNPACK", "SPLIT", "DEPTH_TO_SPACE", "SPACE_TO_DEPTH", "L2_NORMALIZATION"}
_SHAPE_FROM_CONSTANTS = REDUCERS | {
    "RESHAPE", "TRANSPOSE", "SLICE", "STRIDED_SLICE", "PAD", "PADV2", "MIRROR_PAD", "BROADCAST_TO", "TILE",
    "REVERSE_V2", "ARG_MAX", "ARG_MIN", "SPLIT_V", "RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR", "TRANSPOSE_CONV"}


def copy_dynamic_outputs(g: Graph) -> Graph:
    """With dynamic inputs, an output whose shape LiteRT only learns while running gets a CAST to its own type.

    LiteRT's CompiledModel cannot bind an output buffer to such a "dynamic" tensor (it fails, or
    leaves the buffer unwritten: checked with ai-edge-litert 2.3.0); the copy's shape is planned
    from its input like any other op's.
    """
    if not any(t.dynamic for t in g.inputs):
        return g
    producer = g.producers()
    outs = []
    for t, name in zip(g.outputs, g.output_names):
        op = producer.get(id(t))
        params = op.inputs[:1] if op is not None and op.code == "TRANSPOSE_CONV" else op.inputs[1:] if op else []
        settled = op is None or op.code in _SHAPE_FROM_SHAPES or (
            op.code in _SHAPE_FROM_CONSTANTS and all(x is None or x.is_const for x in params))
        if not settled:
            inner = Tensor(f"{name}/dynamic", t.shape, t.dtype)
            for other in g.ops:
                other.inputs = [inner if x is t else x for x in other.inputs]
            op.outputs = [inner if o is t else o for o in op.outputs]
            g.ops.append(Op("CAST", [inner], [t]))
        outs.append(t)
    g.outputs = outs
    return g


# The pipeline, in order. Entries before ``lower`` take and return an AtenProgram, the rest a Graph.
PIPELINE = [
    fold_batch_norm,
    fold_constants,
    lower,
    compose_transposes,
    assign_nhwc_layout,
    simplify_moves,
    drop_kept_dims,
    use_same_padding,
    use_depthwise_conv,
    use_fully_connected,
    fold_affine_into_fully_connected,
    fuse_activations,
    pad_max_pool_with_zeros,
    eliminate_dead_code,
    # quantization (quant_config, or pt2e pairs in the model): on the final float graph
    fold_quantize_dequantize,
    calibrate_activations,
    quantize_activations,
    quantize_weights,
    eliminate_dead_code,
    name_outputs,
    copy_dynamic_outputs,
]
# Passes that skip_passes may not leave out: the graph would not be the model, or not the one asked for.
REQUIRED = {lower, fold_quantize_dequantize, calibrate_activations, quantize_activations, quantize_weights}


def run_pipeline(prog: AtenProgram, skip: tuple = ()) -> Graph:
    """Runs every pass of PIPELINE (except those named in ``skip``) on ``prog``."""
    value = prog
    for p in PIPELINE:
        if p.__name__ not in skip:
            value = p(value)
    return value

