"""The numerics debugger: when a converted model disagrees with eager, find the first op that diverges.

``tte.debug(model, args, target="litert")`` (CLI: ``torchtpu-export debug MODEL --target litert``)
captures the model once, runs the captured graph in torch eager recording every intermediate
tensor, then converts the same graph with every intermediate exposed as an extra output and
compares them in graph order. The first node whose value is off (beyond ``rtol`` relative to
that value's scale, exact for integers) while its inputs agree is the culprit: its op, the user's
source line and the error are reported. Exposing intermediates can change what a converter
fuses; if the final output disagrees but no exposed intermediate does, the debugger bisects
over graph prefixes instead, each converted with a single output.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Sequence

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument

from .capture import CapturedProgram
from .fxnodes import op_name, shape_of, user_source_line
from .errors import InputError, NumericsError, TteError
from .numerics import DEFAULT_RTOL, Agreement, compare, tolerance_arg
from .specs import TensorSpec, dtype_name

log = logging.getLogger("torchtpu_export")


@dataclasses.dataclass
class NodeResult:
    node: str
    op: str
    source: str | None
    agreement: Agreement


@dataclasses.dataclass
class DebugReport:
    target: str
    final: Agreement
    first_divergence: NodeResult | None
    checked: int
    method: str  # "exposed intermediates" or "bisection"

    @property
    def ok(self) -> bool:
        return self.final.ok and self.first_divergence is None

    def __str__(self) -> str:
        lines = [f"{self.target}: final outputs {'agree' if self.final.ok else 'DISAGREE'} with eager ({self.final})"]
        if self.first_divergence is None:
            lines.append(f"no intermediate diverges ({self.checked} checked by {self.method})")
        else:
            d = self.first_divergence
            lines.append(f"first divergence ({self.method}, {self.checked} intermediates checked): "
                         f"node {d.node} = {d.op}")
            lines.append(f"  error: {d.agreement}")
            if d.source:
                lines.append(f"  at {d.source}")
        return "\n".join(lines)


def _eager_values(captured: CapturedProgram) -> dict[str, object]:
    """Every node's value when the captured graph runs in torch eager on the sample inputs."""
    gm = captured.exported.graph_module
    inputs = iter(captured.sample_inputs)
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in captured.weight_placeholders:
            args.append(captured.weights[captured.weight_placeholders[node.name]])
        elif node.name in captured.input_placeholders:
            args.append(next(inputs))
        else:
            args.append(None)
    values: dict[str, object] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(*args)
    return values


def _taps(captured: CapturedProgram) -> list[torch.fx.Node]:
    out = []
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel() > 0:
            out.append(node)
    return out


def tapped(captured: CapturedProgram, names: Sequence[str]) -> CapturedProgram:
    """A copy of ``captured`` whose outputs are the nodes ``names`` (in that order)."""
    ep = captured.exported
    gm = copy.deepcopy(ep.graph_module)
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[n] for n in names]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = (tuple(nodes),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    sig = copy.copy(ep.graph_signature)
    sig.output_specs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(n.name), None) for n in nodes]
    new_ep = ep._update(gm, sig)
    live = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    outputs = [TensorSpec(f"output_{i}", shape_of(n.meta["val"]), dtype_name(n.meta["val"].dtype))
               for i, n in enumerate(nodes)]
    _, out_spec = pytree.tree_flatten(tuple(range(len(nodes))))
    return dataclasses.replace(
        captured, exported=new_ep, outputs=outputs, out_spec=out_spec,
        weight_placeholders={k: v for k, v in captured.weight_placeholders.items() if k in live},
        weights={v: captured.weights[v] for k, v in captured.weight_placeholders.items() if k in live})


def _compare_node(node, got, want, rtol) -> NodeResult:
    return NodeResult(node.name, op_name(node.target), user_source_line(node), compare([got], [want], rtol))


def debug(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *, target: str = "litert",
          rtol: float = DEFAULT_RTOL, strict_export: bool | str = False, **options) -> DebugReport:
    """Finds the first op whose converted output diverges from eager (see the module docstring)."""
    from . import api, targets
    if target not in debuggable_targets():
        raise InputError(f"debug supports the {' and '.join(debuggable_targets())} targets, not {target!r}")
    (captured,) = api.captures([("main", module, tuple(sample_args), sample_kwargs, None)], target,
                               strict_export).values()
    options = {**targets.get(target).local_options, **options}  # the values are compared here, on this machine
    # build first: a target may rewrite the graph (fusing patterns into single ops) and the
    # intermediates compared must be those of the graph it converts
    final_values = api.build(target, {"main": captured}, **options).run_flat(captured.sample_inputs)
    eager = _eager_values(captured)
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    final_ref = [eager[o.name] if isinstance(o, torch.fx.Node) else o for o in out_node.args[0]]
    final = compare(final_values, final_ref, rtol)
    taps = _taps(captured)
    method = "exposed intermediates"
    first = None
    try:
        program = api.build(target, {"main": tapped(captured, [n.name for n in taps])}, **options)
        values = program.run_flat(captured.sample_inputs)
        for node, got in zip(taps, values):
            result = _compare_node(node, got, eager[node.name], rtol)
            if not result.agreement.ok:
                first = result
                break
    except TteError as e:
        log.info("converting with exposed intermediates failed (%s); bisecting instead", e)
        values = None
    if first is None and (values is None or not final.ok):
        method = "bisection"
        first = _bisect(captured, taps, eager, target, rtol, options)
    return DebugReport(target, final, first, len(taps), method)


def _bisect(captured, taps, eager, target, rtol, options) -> NodeResult | None:
    """The first tap whose value diverges when the graph is cut right after it (assumes divergence persists)."""
    from . import api

    def check(i):
        prog = api.build(target, {"main": tapped(captured, [taps[i].name])}, **options)
        return _compare_node(taps[i], prog.run_flat(captured.sample_inputs)[0], eager[taps[i].name], rtol)

    lo, hi, found = 0, len(taps) - 1, None
    if hi < 0:
        return None
    last = check(hi)
    if last.agreement.ok:
        return None
    found = last
    while lo < hi:
        mid = (lo + hi) // 2
        result = check(mid)
        if result.agreement.ok:
            lo = mid + 1
        else:
            found, hi = result, mid
    return found


# ---- CLI -----------------------------------------------------------------------------------

HELP = "find the first op whose converted output diverges from torch eager"


def debuggable_targets() -> tuple:
    from . import targets
    return tuple(name for name, t in targets.all_targets().items() if t.debuggable)


def add_arguments(p) -> None:
    p.add_argument("model", help="a .pt2, TorchScript archive or package.module:factory")
    p.add_argument("--target", required=True, choices=debuggable_targets())
    p.add_argument("--inputs", nargs="+", default=None, metavar="SPEC", help="sample inputs (as for conversion)")
    p.add_argument("--tolerance", type=tolerance_arg, default=DEFAULT_RTOL,
                   help="relative tolerance per intermediate")
    p.add_argument("--trust-pickle", action="store_true", help="allow loading a pickled module")


def run_cli(args) -> int:
    from .models import load_model, parse_inputs
    sample = parse_inputs(args.inputs) if args.inputs else None
    model, margs, mkwargs = load_model(args.model, trust_pickle=args.trust_pickle, sample_inputs=sample)
    if sample is not None:
        margs, mkwargs = tuple(sample), {}
    report = debug(model, margs, mkwargs, target=args.target, rtol=args.tolerance)
    print(report)
    if not report.ok:
        raise NumericsError(f"the {args.target} conversion diverges from eager"
                            + (f" first at {report.first_divergence.op}" if report.first_divergence else ""))
    return 0
