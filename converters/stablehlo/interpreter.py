"""An FX interpreter that turns a captured core-ATen graph into a JAX function."""
from __future__ import annotations

import math
import operator
from typing import Callable

import jax.numpy as jnp
import numpy as np
import torch
from torch.fx.node import map_arg

from torchtpu_export.capture import CapturedProgram
from torchtpu_export.fxnodes import draws_random, op_name, require_rules, user_source_line
from torchtpu_export.errors import ConversionError, UnsupportedOpError

from .registry import LoweringContext, Ragged, lookup

# Python-level ops that appear in graphs with symbolic shapes.
_PY_OPS = {
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
    operator.neg, operator.pow, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.and_, operator.or_, math.ceil, math.floor, math.sqrt,
    torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sqrt,
}


def check_supported(captured: CapturedProgram, platform: str) -> None:
    """Raises UnsupportedOpError for the first op of the graph that has no lowering."""
    nodes = [n for n in captured.graph.nodes
             if n.op == "call_function" and n.target not in _PY_OPS and n.target is not operator.getitem]
    require_rules(nodes, lambda op: lookup(op, platform) is not None, target=f"stablehlo ({platform})",
                  default_reason="no lowering is registered for it")


def _expected_dtype(ctx: LoweringContext, val):
    return ctx.dtype(val.dtype) if isinstance(val, torch.Tensor) else None


def _conform(ctx: LoweringContext, node, result):
    """Casts a rule's result to the dtype torch says the node has."""
    meta = node.meta.get("val")
    if isinstance(result, Ragged):
        return Ragged(_conform(ctx, node, result.values), result.count)
    if isinstance(meta, torch.Tensor) and hasattr(result, "dtype"):
        want = _expected_dtype(ctx, meta)
        if result.dtype != np.dtype(want):
            result = result.astype(want)
    elif isinstance(meta, (tuple, list)) and isinstance(result, (tuple, list)):
        result = type(result)(
            r.astype(_expected_dtype(ctx, m)) if isinstance(m, torch.Tensor) and hasattr(r, "dtype")
            and r.dtype != np.dtype(_expected_dtype(ctx, m)) else r
            for r, m in zip(result, meta))
    return result


def uses_random(captured: CapturedProgram) -> bool:
    """Whether the program draws random numbers (then its function takes a PRNG key after the inputs)."""
    return any(draws_random(n) for n in captured.graph.nodes)



def to_jax_function(captured: CapturedProgram, ctx: LoweringContext, weight_names: dict | None = None,
                    dequantize: dict | None = None) -> Callable:
    """``fn(weights: dict, *inputs) -> list of outputs``; ``weight_names`` maps captured names to artifact names.

    A program with random ops (:func:`uses_random`) takes one more input after the model's: a
    threefry PRNG key as ``uint32[2]``, from which each random op draws its own stream. The runner
    passes a fresh key per call, so the values change from call to call as torch's do.

    ``dequantize`` maps an artifact weight name to ``(scale name, axis)``: that weight is stored
    quantized and is rebuilt as ``values * scale`` where the program reads it, which XLA fuses
    into the consuming matmul. Inputs enter and outputs leave in their declared dtypes even when
    the program computes in another (``ctx.dtype`` maps them, e.g. to bfloat16).

    Outputs whose row count depends on the data (``Ragged``) come out padded, and their counts
    are appended after the outputs; tracing records ``fn.ragged_outputs`` (output index ->
    position of its count).
    """
    check_supported(captured, ctx.platform)
    weight_names = weight_names or {name: name for name in captured.weights}
    input_index = {name: i for i, name in enumerate(captured.input_placeholders)}
    nodes = list(captured.graph.nodes)
    dequantize = dequantize or {}

    def _weight(weights, name, node):
        if name not in dequantize:
            return weights[name]
        scale_name, axis = dequantize[name]
        q = weights[name]
        ctx.quantized_weights[node.name] = (q, weights[scale_name], axis)
        shape = [1] * q.ndim
        shape[axis] = -1
        compute = ctx.dtype(torch.float32)
        return q.astype(compute) * weights[scale_name].astype(compute).reshape(shape)

    def _declared(value, node):
        meta = node.meta.get("val")
        if isinstance(meta, torch.Tensor) and hasattr(value, "dtype"):
            return ctx.cast(value, ctx.io_dtype(meta.dtype))
        return value

    random = uses_random(captured)

    def fn(weights, *inputs):
        env: dict = {}
        ctx.quantized_weights = {}
        if random:
            *inputs, key = inputs
            ctx.start_random(key)
        for node in nodes:
            if node.op == "placeholder":
                if node.name in captured.weight_placeholders:
                    env[node] = _weight(weights, weight_names[captured.weight_placeholders[node.name]], node)
                elif node.name in input_index:
                    x = inputs[input_index[node.name]]
                    env[node] = ctx.cast(x, ctx.dtype(node.meta["val"].dtype))
                else:  # a non-tensor input that torch.export specialised
                    env[node] = None
            elif node.op == "call_function":
                env[node] = _run_node(ctx, node, env)
            elif node.op == "output":
                outs = [_declared(env[o], o) if isinstance(o, torch.fx.Node) else jnp.asarray(o)
                        for o in node.args[0]]
                if captured.output_order is not None:  # the user's outputs, then the buffers' new values
                    outs = [outs[i] for i in captured.output_order]
                counts = [(i, o.count) for i, o in enumerate(outs) if isinstance(o, Ragged)]
                fn.ragged_outputs = {i: len(outs) + k for k, (i, _) in enumerate(counts)}
                return [o.values if isinstance(o, Ragged) else o for o in outs] + [c for _, c in counts]
            else:
                raise UnsupportedOpError(f"{node.op} {node.target}", target="stablehlo",
                                         reason="graph node kind not supported", source=user_source_line(node))
        raise ConversionError("graph has no output node")

    fn.ragged_outputs = {}
    return fn


def _run_node(ctx: LoweringContext, node, env):
    args = map_arg(node.args, env.__getitem__)
    kwargs = map_arg(node.kwargs, env.__getitem__)
    ragged = [a for a in node.all_input_nodes if isinstance(env[a], Ragged)]
    if ragged:
        return _use_ragged(node, env[ragged[0]], ragged[0], args)
    if node.target is operator.getitem or node.target in _PY_OPS:
        return node.target(*args, **kwargs)
    rule = lookup(node.target, ctx.platform)
    ctx.node = node
    try:
        result = rule(ctx, *args, **kwargs)
    except (UnsupportedOpError, ConversionError):
        raise
    except Exception as e:
        raise ConversionError(
            f"lowering {op_name(node.target)} failed: {type(e).__name__}: {e}"
            + (f"\n  at {user_source_line(node)}" if user_source_line(node) else ""),
            hint="this is a bug in torchtpu-export; rerun with --debug and report it") from e
    return _conform(ctx, node, result)


def _use_ragged(node, value: Ragged, producer, args):
    """A node reading a data-dependent-length value: only its size can be used inside the program."""
    if node.target is torch.ops.aten.sym_size.int:
        return value.count if args[1] == 0 else value.values.shape[args[1]]
    raise UnsupportedOpError(op_name(node.target), target="stablehlo", source=user_source_line(node),
                       reason=f"it reads the result of {op_name(producer.target)}, whose row count depends on the "
                              "input's values; such a result can only be returned by the program")
