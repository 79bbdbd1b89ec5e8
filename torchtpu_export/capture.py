"""Capture: torch.export, decomposition to core ATen, flattened inputs and outputs.

Every target starts from a :class:`CapturedProgram`. The graph is core ATen
except for the composite ops a target asked to keep whole (``keep``), which
it lowers itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import operator
import re
import warnings
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from . import progress, treespec
from .errors import CaptureError, InputError
from .fxnodes import op_name, shape_of
from .specs import TensorSpec, dtype_name, jsonable

log = logging.getLogger("torchtpu_export")



@dataclasses.dataclass
class CapturedProgram:
    """A core-ATen graph with its weights lifted out and its I/O flattened.

    ``weights`` maps a weight's name (its state-dict key) to its tensor;
    ``weight_placeholders`` maps each weight placeholder of the graph to that
    name. ``inputs`` are the tensor leaves of ``(args, kwargs)`` flattened by
    ``in_spec``; ``constant_inputs`` holds the non-tensor leaves, which
    torch.export specialises (index in the flat leaves -> value).
    """

    exported: ExportedProgram
    weights: dict[str, torch.Tensor]
    weight_placeholders: dict[str, str]
    inputs: list[TensorSpec]
    input_placeholders: list[str]
    outputs: list[TensorSpec]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    constant_inputs: dict[int, Any]
    sample_inputs: list[torch.Tensor]
    dim_ranges: dict[str, tuple] = dataclasses.field(default_factory=dict)  # symbolic dim -> (min, max or None)
    # buffers the module changes in place (a KV cache kept as a buffer), for targets that keep state:
    # (buffer name, its value before the first call). They are the last len(state) inputs and outputs
    # (the value before the call in, the value after it out); ``output_order`` maps those outputs to
    # the graph's (which lists the buffers' new values first).
    state: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    output_order: list[int] | None = None

    @property
    def graph(self) -> torch.fx.Graph:
        return self.exported.graph_module.graph

    def flatten_inputs(self, args: Sequence, kwargs: dict | None = None) -> list:
        """Flattens call arguments like the captured ones, returning the tensor leaves."""
        return flatten_call_args(self.in_spec, self.constant_inputs, args, kwargs)

    def call_metadata(self) -> dict:
        """What an artifact records to be called like the module: torch-side input and output specs,
        the call's pytree structure (treespec text), and the non-tensor inputs torch.export specialised."""
        n = len(self.inputs) - len(self.state), len(self.outputs) - len(self.state)
        meta = {"inputs": [s.to_json() for s in self.inputs[:n[0]]],
                "outputs": [s.to_json() for s in self.outputs[:n[1]]],
                "in_spec": treespec.dumps(self.in_spec), "out_spec": treespec.dumps(self.out_spec),
                "constant_inputs": {str(i): jsonable(v) for i, v in self.constant_inputs.items()}}
        if self.state:
            meta["state"] = [dict(s.to_json(), name=name) for (name, _), s in zip(self.state, self.inputs[n[0]:])]
        return meta

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.graph.nodes:
            if n.op == "call_function":
                hist[op_name(n.target)] = hist.get(op_name(n.target), 0) + 1
        return dict(sorted(hist.items()))


def to_torch(x):
    """numpy arrays (and numpy scalars) become tensors; everything else is passed through."""
    if isinstance(x, np.ndarray):
        from .safetensors_io import from_numpy
        return from_numpy(x)
    if isinstance(x, np.generic):
        return torch.tensor(x)
    return x


def _reorder_kwargs(in_spec: pytree.TreeSpec, kwargs: dict) -> dict:
    kw_spec = in_spec.child(1) if in_spec.num_children == 2 else None
    if kw_spec is None or not kw_spec.context:
        return kwargs
    keys = list(kw_spec.context)
    if set(keys) != set(kwargs):
        raise InputError(f"keyword arguments {sorted(kwargs)} do not match the captured ones {sorted(keys)}")
    return {k: kwargs[k] for k in keys}


def flatten_call_args(in_spec, constant_inputs, args, kwargs=None) -> list:
    """The tensor leaves of a call, checked against the captured structure (``in_spec``: a TreeSpec
    or its treespec text; ``constant_inputs``: flat index -> the non-tensor leaves, left out)."""
    if isinstance(in_spec, str):
        in_spec = treespec.loads(in_spec)
    constant_inputs = {int(k): v for k, v in constant_inputs.items()}
    args = tuple(pytree.tree_map(to_torch, tuple(args)))
    kwargs = _reorder_kwargs(in_spec, pytree.tree_map(to_torch, dict(kwargs or {})))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if not treespec.same_structure(spec, in_spec):
        raise InputError(
            f"the inputs do not have the structure of the captured ones: got {_short(spec)}, expected {_short(in_spec)}")
    return [x for i, x in enumerate(leaves) if i not in constant_inputs]


def _short(spec) -> str:
    s = str(spec)
    return s if len(s) < 200 else s[:200] + "..."


def decomposition_table(keep: Iterable = ()) -> dict:
    """torch.export's core-ATen decompositions, minus the ops a target lowers whole."""
    table = torch.export.default_decompositions()
    for op in keep:
        table.pop(op, None)
    return table


# Nodes torch.export leaves in graphs that compute nothing.
_BOOKKEEPING = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default}


def kept_or_plain_core(keep: Iterable) -> Callable:
    """A ``lowerable`` for targets without a rule table to consult: an op is taken as it is when the
    target keeps it whole, or it is core ATen that torch's decomposition table leaves alone."""
    keep = frozenset(keep)
    table = decomposition_table(keep)
    return lambda op: op in keep or (op not in table and torch.Tag.core in op.tags)


def _needs_decomposition(ep: ExportedProgram, lowerable: Callable | None) -> bool:
    """False when run_decompositions (a second full trace of the model) would change nothing we need:
    every op is functional and the target takes it as it is (``lowerable``; None: decompose always)."""
    if lowerable is None:
        return True
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            return True  # higher-order ops, submodules
        t = node.target
        if t is operator.getitem or t in _BOOKKEEPING:
            continue
        if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable or _hides_mutation(node):
            return True
        if not lowerable(t):
            return True
    return any(o.kind != OutputKind.USER_OUTPUT for o in ep.graph_signature.output_specs)


# composite ops whose schemas do not say that they write into arguments: (running_mean, running_var,
# the flag that makes them update those) positions; decomposition functionalises the writes
_HIDDEN_MUTATION = {torch.ops.aten.batch_norm.default: (3, 4, 5), torch.ops.aten.instance_norm.default: (3, 4, 5)}


def _hides_mutation(node: torch.fx.Node) -> bool:
    positions = _HIDDEN_MUTATION.get(node.target)
    if positions is None:
        return False
    *stats, flag = positions
    args = node.args
    return len(args) > flag and bool(args[flag]) and any(args[i] is not None for i in stats)


@contextlib.contextmanager
def _eval_mode(module):
    if not isinstance(module, torch.nn.Module):
        yield
        return
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.eval()
    except NotImplementedError:  # ExportedProgram.module()s (pt2e's) refuse eval(); their graph is fixed anyway
        for m, _ in modes:
            m.training = False
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def abstract_weights():
    """Models built inside have their parameters on the meta device: shapes and dtypes, no values and no
    memory (buffers such as RoPE frequencies, computed at construction, keep their values). Export such
    a model to the tpu target and its programs take abstract weights: they compile for any topology, and
    values are bound at load (``TpuProgram.bind_weights``)::

        with tte.abstract_weights():
            model = LlamaForCausalLM(config)            # an 8B or 70B config, nothing allocated
        prog = tte.export_llm(model, target="tpu", quant_config="bf16")
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(self, name, param):
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:  # torch.empty reserved but never touched: no memory was used
            self._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def is_abstract(t) -> bool:
    """A weight without values: on the meta device, or a fake tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.is_meta)


@contextlib.contextmanager
def _abstract_weights(module):
    """Parameters and buffers on the meta device (a model built without its weights, e.g. under
    ``tte.abstract_weights()``) become fake CPU tensors while torch.export traces: shapes and dtypes
    only, so the captured weights stay abstract and nothing of their size is ever allocated."""
    found = [(m, kind, n, t) for m in module.modules() for kind in ("_parameters", "_buffers")
             for n, t in getattr(m, kind).items() if t is not None and t.is_meta] \
        if isinstance(module, torch.nn.Module) else []
    if not found:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}  # one per tensor: tied weights stay tied
    try:
        for m, kind, n, t in found:
            if id(t) not in fakes:
                with mode:
                    fake = torch.empty(t.shape, dtype=t.dtype)
                fakes[id(t)] = torch.nn.Parameter(fake, requires_grad=False) if kind == "_parameters" else fake
            getattr(m, kind)[n] = fakes[id(t)]
        yield
    finally:
        for m, kind, n, t in found:
            getattr(m, kind)[n] = t


def _export(module, args, kwargs, dynamic_shapes, strict) -> ExportedProgram:
    if strict == "auto":
        try:
            return _export(module, args, kwargs, dynamic_shapes, False)
        except CaptureError as first:
            log.info("non-strict export failed (%s); retrying with strict=True", first)
            try:
                return _export(module, args, kwargs, dynamic_shapes, True)
            except CaptureError:
                raise first from None
    stderr = io.StringIO()
    try:
        # torch.export prints partial graphs to stderr on failure: keep them for -vv, not for the user
        with _eval_mode(module), torch.no_grad(), contextlib.redirect_stderr(stderr), torch_internal_warnings(), \
                _abstract_weights(module):
            return torch.export.export(module, tuple(args), kwargs or None,
                                       dynamic_shapes=dynamic_shapes, strict=bool(strict))
    except Exception as e:  # torch.export raises many exception types
        log.debug("torch.export failed; its stderr:\n%s", stderr.getvalue())
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first_line = lines[0] if lines else type(e).__name__
        detail = next((ln[2:] for ln in lines[1:] if ln.startswith("- ")), "")
        if detail:
            first_line += f" {detail}"
        hint = "make the control flow independent of tensor values (torch.cond), or try strict_export='auto'"
        if not re.search(r"data.dependent|GuardOnDataDependent|guard|control flow|Dynamo|symbolic", str(e)):
            hint = "check that the sample inputs fit the model (their shapes and dtypes are what forward expects)"
        if "specialized it to be a constant (0)" in first_line or "specialized it to be a constant (1)" in first_line:
            hint = "torch.export specialises dims whose sample size is 0 or 1: give sample inputs of size >= 2 " \
                   "in every dynamic dim"
        elif "dynamic" in str(e).lower() and dynamic_shapes is not None:
            hint = "check the dynamic_shapes bounds against the model (torch.export's message above)"
        raise CaptureError(f"torch.export could not capture the model: {type(e).__name__}: {first_line}",
                           hint=hint) from e


def capture(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
            dynamic_shapes=None, strict_export: bool | str = False, keep: Iterable = (),
            lowerable: Callable | None = None, state: bool = False) -> CapturedProgram:
    """Exports ``module`` (or takes an ExportedProgram) and decomposes it to core ATen.

    ``keep`` names composite ops that the calling target lowers whole. ``lowerable(op)`` says
    whether the target has a rule for ``op``: when every op of the exported graph has one and
    none mutates, decomposition (a full retrace, most of a warm capture's time) is skipped.
    ``state``: buffers the module changes in place become state (``CapturedProgram.state``) for a
    target whose runtime keeps them between calls; otherwise such a module is refused.
    """
    if strict_export not in (True, False, "auto"):
        raise InputError(f"strict_export must be True, False or 'auto', not {strict_export!r}")
    if isinstance(module, ExportedProgram):
        ep = module
        if not sample_args and not sample_kwargs and ep.example_inputs is not None:
            sample_args, sample_kwargs = ep.example_inputs
    elif callable(module):
        if not isinstance(sample_args, (tuple, list)):
            sample_args = (sample_args,)
        sample_args = tuple(pytree.tree_map(to_torch, tuple(sample_args)))
        sample_kwargs = pytree.tree_map(to_torch, dict(sample_kwargs or {}))
        with progress.stage("capture"):
            ep = _export(module, sample_args, sample_kwargs, dynamic_shapes, strict_export)
    else:
        raise InputError(f"expected a torch.nn.Module, a callable or an ExportedProgram, got {type(module).__name__}")
    keep = list(keep)
    table = decomposition_table(keep)
    if lowerable is None and keep:
        lowerable = kept_or_plain_core(keep)
    try:
        if _needs_decomposition(ep, lowerable):
            with progress.stage("decompose"), torch_internal_warnings():
                ep = ep.run_decompositions(table)
        else:
            log.debug("every op is lowered as it is: decomposition skipped")
    except Exception as e:
        raise CaptureError(f"decomposition to core ATen failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return _flatten(ep, tuple(sample_args or ()), dict(sample_kwargs or {}), state)


@contextlib.contextmanager
def torch_internal_warnings():
    """torch's own deprecation warnings about its own types, raised inside torch.export's passes
    (deep-copying a graph warns that torch's LeafSpec is deprecated): not the user's business."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def _drop_input_mutations(ep: ExportedProgram) -> ExportedProgram:
    """The program without the outputs torch.export adds for inputs the model changes in place.

    torch.export functionalises ``x.add_(1)``: the new value is computed like any other and what
    reads it reads that value; the extra output only says "write this back into the caller's
    tensor". An artifact does not write into its caller's arrays (litert-torch's neither), so the
    outputs are the user's."""
    sig = ep.graph_signature
    if not any(o.kind == OutputKind.USER_INPUT_MUTATION for o in sig.output_specs):
        return ep
    import copy
    with torch_internal_warnings():
        gm = copy.deepcopy(ep.graph_module)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    keep = [i for i, o in enumerate(sig.output_specs) if o.kind != OutputKind.USER_INPUT_MUTATION]
    out_node.args = (tuple(out_node.args[0][i] for i in keep),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    new_sig = copy.copy(sig)
    new_sig.output_specs = [sig.output_specs[i] for i in keep]
    return ep._update(gm, new_sig)


def _drop_effect_tokens(ep: ExportedProgram) -> ExportedProgram:
    """The program without the effect tokens torch.export threads through side-effecting calls.

    The only ones core ATen graphs get are linalg's error checks (``_linalg_check_errors``: raise
    if a matrix was singular), which a compiled program cannot raise; they become plain calls that
    the targets lower to nothing, as they do ``_assert_async``."""
    sig = ep.graph_signature
    if not any(s.kind == InputKind.TOKEN for s in sig.input_specs) and \
            not any(s.kind == OutputKind.TOKEN for s in sig.output_specs):
        return ep
    from torch.export._remove_effect_tokens_pass import _remove_effect_tokens
    return _remove_effect_tokens(ep)


def _flatten(ep: ExportedProgram, sample_args, sample_kwargs, allow_state: bool = False) -> CapturedProgram:
    ep = _drop_input_mutations(_drop_effect_tokens(ep))
    sig = ep.graph_signature
    kept = (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION) if allow_state else (OutputKind.USER_OUTPUT,)
    mutated = [o for o in sig.output_specs if o.kind not in kept]
    if mutated:
        raise CaptureError(
            f"the model changes state in place during forward ({', '.join(str(o.target or o.arg.name) for o in mutated)}); "
            + ("only buffers may change in place" if allow_state else
               "this target exports stateless programs only (the tpu target keeps buffers changed in place)"),
            hint="pass state such as buffers and KV caches as explicit inputs and return the updated values as outputs")
    # a buffer changed in place -> (its name, the graph output holding its new value)
    changed = {o.target: i for i, o in enumerate(sig.output_specs) if o.kind == OutputKind.BUFFER_MUTATION}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    weights: dict[str, torch.Tensor] = {}
    weight_placeholders: dict[str, str] = {}
    input_placeholders: list[str] = []
    abstract_names: dict[int, str] = {}  # a tied abstract weight (one tensor, two names) is one weight
    state_placeholders: list[tuple[str, str]] = []  # (buffer name, placeholder)
    for spec in sig.input_specs:
        if spec.kind == InputKind.BUFFER and spec.target in changed:
            state_placeholders.append((spec.target, spec.arg.name))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if spec.target in ep.state_dict:
                value = ep.state_dict[spec.target]
            else:
                value = ep.constants[spec.target]
            if is_abstract(value) and id(value) in abstract_names:
                weight_placeholders[spec.arg.name] = abstract_names[id(value)]
                continue
            if is_abstract(value):
                abstract_names[id(value)] = spec.target
            weights[spec.target] = value.detach()
            weight_placeholders[spec.arg.name] = spec.target
        elif spec.kind == InputKind.USER_INPUT:
            if isinstance(spec.arg, TensorArgument):
                input_placeholders.append(spec.arg.name)
        else:
            raise CaptureError(f"unsupported input kind {spec.kind.name} ({spec.target}) in the exported program")

    in_spec = ep.call_spec.in_spec
    leaves, _ = pytree.tree_flatten((sample_args, _reorder_kwargs(in_spec, sample_kwargs)))
    constant_inputs = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
    sample_inputs = [v for v in leaves if isinstance(v, torch.Tensor)]
    if len(sample_inputs) != len(input_placeholders):
        raise CaptureError(f"expected {len(input_placeholders)} tensor inputs, the samples have {len(sample_inputs)}")

    inputs = [TensorSpec(name, shape_of(placeholders[name].meta["val"]), dtype_name(placeholders[name].meta["val"].dtype))
              for name in input_placeholders]
    state = []
    for target, ph in state_placeholders:  # after the user's inputs and outputs, in the same order
        val = placeholders[ph].meta["val"]
        inputs.append(TensorSpec(f"state.{target}", shape_of(val), dtype_name(val.dtype)))
        input_placeholders.append(ph)
        state.append((target, (ep.state_dict[target] if target in ep.state_dict else ep.constants[target]).detach()))
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    order = [i for i, o in enumerate(sig.output_specs) if o.kind == OutputKind.USER_OUTPUT] + \
        [changed[target] for target, _ in state_placeholders]
    outputs = []
    for k, i in enumerate(order):
        o = out_node.args[0][i]
        val = o.meta["val"] if isinstance(o, torch.fx.Node) else torch.tensor(o)
        name = f"output_{k}" if k < len(order) - len(state) else f"state.{state[k - len(order) + len(state)][0]}"
        outputs.append(TensorSpec(name, shape_of(val), dtype_name(val.dtype)))
    symbols = {d for spec in inputs for d in spec.shape if isinstance(d, str)}
    dim_ranges = {str(sym): (_finite_int(rng.lower) or 0, _finite_int(rng.upper))
                  for sym, rng in ep.range_constraints.items() if str(sym) in symbols}
    return CapturedProgram(ep, weights, weight_placeholders, inputs, input_placeholders, outputs,
                           in_spec, ep.call_spec.out_spec, constant_inputs, sample_inputs, dim_ranges,
                           state, order if state else None)


def _finite_int(bound) -> int | None:
    """A range bound from torch's shape env as an int, or None when unbounded (torch's int_oo)."""
    try:
        value = int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return value if abs(value) < 2 ** 62 else None
