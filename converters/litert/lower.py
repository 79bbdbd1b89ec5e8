"""From a captured ATen graph to the TFLite graph IR, one builder per node."""
from __future__ import annotations

import dataclasses
import operator

import numpy as np
import torch
from torch.fx.node import map_arg

from torchtpu_export.capture import CapturedProgram
from torchtpu_export.fxnodes import op_name, require_rules, user_source_line
from torchtpu_export.errors import ConversionError, TteError, UnsupportedOpError
from torchtpu_export.safetensors_io import to_numpy

from .ir import Graph, Tensor
from .dims import canon, source_of, symbol, symbol_ranges
from .registry import BUILDERS, NOT_SUPPORTED, BuildContext, Missing, io_dtype, ir_shape, numpy_dtype

# Nodes that compute nothing the model returns.
IGNORED = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
           torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten._linalg_check_errors.default}


@dataclasses.dataclass
class AtenProgram:
    """A captured program being prepared for lowering: its graph (a copy) and the values known now.

    ``constants`` maps nodes to their torch value: the weights, and whatever the
    passes computed ahead of time (folded batch norms, constant subgraphs).
    """

    name: str
    graph: torch.fx.Graph
    constants: dict[torch.fx.Node, torch.Tensor]
    inputs: list[torch.fx.Node]
    captured: CapturedProgram
    io_dtypes: str = "auto"  # see registry.io_dtype
    quant: object = None  # quantize.GraphQuant, handed to the graph

    @classmethod
    def from_capture(cls, name: str, cap: CapturedProgram, io_dtypes: str = "auto", quant=None) -> "AtenProgram":
        graph = torch.fx.Graph()
        env: dict = {}
        out = graph.graph_copy(cap.graph, env)
        graph.output(out)
        by_name = {old.name: new for old, new in env.items()}  # the copy may rename nodes
        constants = {by_name[p]: cap.weights[w] for p, w in cap.weight_placeholders.items() if p in by_name}
        inputs = [by_name[p] for p in cap.input_placeholders]
        return cls(name, graph, constants, inputs, cap, io_dtypes, quant)


def check_supported(prog: AtenProgram) -> None:
    """Raises UnsupportedOpError naming the most used op of the graph that has no builder."""
    nodes = [n for n in live_nodes(prog) if n.op == "call_function" and n not in prog.constants
             and n.target is not operator.getitem and n.target not in IGNORED and not _is_symbolic(n)]
    require_rules(nodes, lambda op: op in BUILDERS, target="litert", reasons=NOT_SUPPORTED,
                  default_reason="no TFLite builder is registered for it")


def live_nodes(prog: AtenProgram) -> list[torch.fx.Node]:
    """The nodes the outputs depend on, in graph order; a known constant hides its inputs."""
    nodes = list(prog.graph.nodes)
    live: set = set()
    stack = [n for n in nodes if n.op == "output"]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        if n in prog.constants:
            continue
        stack.extend(n.all_input_nodes)
    return [n for n in nodes if n in live]


def constant_tensor(node: torch.fx.Node, value: torch.Tensor, name: str | None = None) -> Tensor:
    a = to_numpy(value)
    dtype = numpy_dtype(value.dtype)
    if a.dtype != dtype:
        if a.dtype.kind in "iu" and dtype.kind in "iu" and a.size:
            info = np.iinfo(dtype)
            # int64 sentinels (e.g. a mask fill of INT64_MIN) saturate instead of wrapping
            a = np.clip(a, info.min, info.max)
        a = a.astype(dtype)
    return Tensor(name or node.name, a.shape, dtype, np.require(a, requirements="C"))


def lower(prog: AtenProgram) -> Graph:
    """The TFLite graph of ``prog``: inputs and outputs named as captured, ops from the builders."""
    check_supported(prog)
    graph = Graph(prog.name)
    graph.quant = prog.quant
    ctx = BuildContext(graph)
    env: dict = ctx.env
    cap = prog.captured
    # Every captured input is a signature input, used or not; 64-bit inputs are cast on entry.
    for spec, node in zip(cap.inputs, prog.inputs):
        val = node.meta["val"]
        graph.inputs.append(Tensor(spec.name, _input_shape(val.shape, node), io_dtype(val.dtype, prog.io_dtypes)))
        graph.input_names.append(spec.name)
    graph.ranges = {symbol(name): rng for name, rng in symbol_ranges(cap).items()}
    # each symbol's sample size, read where the model will read it at run time
    symbols = set().union(*(d.free_symbols for t in graph.inputs for d in t.shape if not isinstance(d, int)))
    for sym in sorted(symbols, key=str):
        found = source_of(sym, graph.inputs)
        if found is None:
            raise UnsupportedOpError("dynamic input dims", target="litert", reason=f"the dynamic dim {sym} appears "
                                     "in the inputs only inside expressions LiteRT cannot solve for it")
        t, axis, a, b = found
        graph.hints[sym] = (int(cap.sample_inputs[graph.inputs.index(t)].shape[axis]) - b) // a
    for node, t in zip(prog.inputs, graph.inputs):
        ctx.node = node
        env[node] = ctx.cast(t, numpy_dtype(node.meta["val"].dtype))
    for node in live_nodes(prog):
        if node in env:
            continue
        ctx.node = node
        if _is_symbolic(node):
            env[node] = _sym_value(node)
        elif node in prog.constants:
            value = prog.constants[node]
            env[node] = constant_tensor(node, value) if isinstance(value, torch.Tensor) else value
        elif node.op == "placeholder":
            env[node] = None  # a non-tensor input that torch.export specialised
        elif node.op == "call_function":
            env[node] = build_node(ctx, node, env)
        elif node.op == "output":
            _set_outputs(ctx, graph, [env[o] if isinstance(o, torch.fx.Node) else o for o in node.args[0]], cap,
                         prog.io_dtypes)
        else:
            raise UnsupportedOpError(f"{node.op} {node.target}", target="litert",
                                     reason="graph node kind not supported", source=user_source_line(node))
    return graph


def _is_symbolic(node: torch.fx.Node) -> bool:
    # a node computing a size (sym_size, or arithmetic on sizes), not a tensor
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat))


def _sym_value(node: torch.fx.Node):
    val = node.meta["val"]
    if not isinstance(val, torch.SymInt):
        raise UnsupportedOpError(op_name(node.target), target="litert", source=user_source_line(node),
                                 reason=f"it computes a symbolic {type(val).__name__}, which LiteRT cannot hold")
    try:
        return canon(val)
    except TypeError as e:
        raise UnsupportedOpError(op_name(node.target), target="litert", reason=str(e),
                                 source=user_source_line(node)) from None


def _input_shape(shape, node) -> tuple:
    try:
        return ir_shape(shape)
    except TypeError as e:
        raise UnsupportedOpError("dynamic input dims", target="litert", reason=str(e),
                                 source=user_source_line(node)) from None


def _dynamic_dims(node: torch.fx.Node) -> list[str]:
    # the dynamic dims of a node's tensor arguments and results
    found: list[str] = []
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    for v in vals:
        for t in v if isinstance(v, (tuple, list)) else [v]:
            if isinstance(t, torch.Tensor):
                found += [str(d) for d in t.shape if isinstance(d, torch.SymInt) and str(d) not in found
                          and not str(d).lstrip("-").isdigit()]
    return found


def build_node(ctx: BuildContext, node: torch.fx.Node, env: dict):
    """The IR value of one ``call_function`` node, its arguments read from ``env``, by its builder."""
    args = map_arg(node.args, env.__getitem__)
    kwargs = map_arg(node.kwargs, env.__getitem__)
    if node.target is operator.getitem:
        return args[0][args[1]]
    if node.target in IGNORED:
        return None
    missing = _missing_args(args, kwargs)
    if missing:
        raise UnsupportedOpError(op_name(node.target), target="litert",
                                 reason=f"it reads {missing[0].what}, which the litert target cannot compute",
                                 source=user_source_line(node))
    empty = _empty_result(ctx, node)
    if empty is not None:
        return empty
    rule = BUILDERS[node.target]
    try:
        result = rule(ctx, *args, **kwargs)
    except TteError:
        raise
    except TypeError as e:
        dynamic = _dynamic_dims(node)
        if not dynamic:
            raise _bug(node, e) from e
        # a builder needed a number where the shape is symbolic (sympy refuses int() and undecidable comparisons)
        raise UnsupportedOpError(op_name(node.target), target="litert", source=user_source_line(node),
                                 reason=f"its TFLite lowering needs static sizes, and {', '.join(dynamic)} "
                                        f"{'is' if len(dynamic) == 1 else 'are'} dynamic here ({e})",
                                 hint="make these dims static (leave them out of dynamic_shapes)") from e
    except Exception as e:
        raise _bug(node, e) from e
    return result


def _empty_result(ctx: BuildContext, node: torch.fx.Node):
    # a result without elements has no values to compute: a constant of its (static) shape, so that no
    # kernel meets a zero-size dim (XNNPACK fails to reshape to one, MIRROR_PAD rejects it)
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape) or val.numel():
        return None
    return ctx.const(np.zeros(tuple(val.shape), ctx.out_dtype()))


def _bug(node, e: Exception) -> ConversionError:
    src = user_source_line(node)
    return ConversionError(f"building {op_name(node.target)} failed: {type(e).__name__}: {e}"
                           + (f"\n  at {src}" if src else ""),
                           hint="this is a bug in torchtpu-export; rerun with --debug and report it")


def _missing_args(args, kwargs) -> list:
    found = []

    def visit(a):
        if isinstance(a, Missing):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
    visit(args)
    visit(kwargs)
    return found


def _set_outputs(ctx: BuildContext, graph: Graph, values: list, cap: CapturedProgram, io_dtypes: str) -> None:
    ctx.node = None
    seen: set[int] = set()
    for spec, v in zip(cap.outputs, values):
        want = np.dtype(io_dtype(getattr(torch, spec.dtype), io_dtypes))
        if isinstance(v, Missing):
            raise UnsupportedOpError(spec.name, target="litert",
                                     reason=f"the model returns {v.what}, which the litert target cannot compute")
        if not isinstance(v, Tensor):
            v = ctx.const(np.asarray(v if not isinstance(v, torch.Tensor) else to_numpy(v)))
        if v.dtype != want:
            out = ctx.tensor(v.shape, want, name=spec.name)
            ctx.op("CAST", [v], outputs=[out])
            v = out
        elif v.is_const or id(v) in seen or any(v is t for t in graph.inputs):
            # a signature output must be a tensor of its own that an op writes
            out = ctx.tensor(v.shape, v.dtype, name=spec.name)
            ctx.op("RESHAPE", [v, ctx.shape_operand(v.shape, infer=True)], outputs=[out])
            v = out
        else:
            v.name = spec.name
        seen.add(id(v))
        graph.outputs.append(v)
        graph.output_names.append(spec.name)

