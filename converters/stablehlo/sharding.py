"""Sharded TPU programs: a device mesh, and a plan that says how each weight is split over it.

``tensor_parallel`` is Megatron-style: a linear layer whose input is replicated is
column-parallel (its output features split over the ``model`` axis), and a linear layer whose
input is already split that way is row-parallel (its input features split; XLA inserts the
all-reduce). Splits propagate through elementwise ops, reshapes, attention and concatenation;
norms, embeddings and convolutions stay replicated. Inputs are split over the ``data`` axis on
their batch dim when it divides.

Mixture-of-experts weights (transformers' ``grouped_mm`` experts, ``[experts, in, out]``) are split by
expert: over the ``expert`` axis where the mesh has one, else over ``model`` (expert parallelism on the
tensor-parallel chips, as vLLM's ``--enable-expert-parallel`` does). Each chip then computes its own
experts' rows of the replicated tokens and one all-reduce sums the rows (the lowering's ``shard_map``):
XLA alone would all-gather every expert's weights for a ragged matmul. The plan decides only where data lives: XLA's sharding
propagation keeps the program exact whatever the plan, so a weight whose dims do not divide
is simply replicated.
"""
from __future__ import annotations

import math
import operator
from typing import Mapping, Sequence

import torch

from torchtpu_export import treespec
from torchtpu_export.capture import CapturedProgram
from torchtpu_export.errors import InputError

aten = torch.ops.aten

SHARDING_MODES = ("tensor_parallel", "data_parallel", "replicated")

# Ops through which a feature split flows unchanged (for this planner's purpose).
_FLOW = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.expand.default, aten.clone.default, aten.alias.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
    aten.cat.default, aten.repeat_interleave.self_int, aten.repeat.default, aten.contiguous.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, operator.getitem,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default,
    aten.mul.Scalar, aten.add.Scalar, aten.div.Scalar, aten.silu.default, aten.gelu.default,
    aten.relu.default, aten.sigmoid.default, aten.tanh.default, aten.where.self, aten._to_copy.default,
    aten.to.dtype, aten.bmm.default, aten.matmul.default, aten._softmax.default, aten.softmax.int,
    aten.scaled_dot_product_attention.default, aten.exp.default, aten.pow.Tensor_Scalar,
}


def parse_mesh(mesh) -> dict[str, int]:
    """``(("data", 1), ("model", 8))`` or ``{"data": 1, "model": 8}`` -> an ordered dict of axis sizes."""
    if mesh is None:
        return {}
    items = list(mesh.items()) if isinstance(mesh, Mapping) else list(mesh)
    try:
        axes = {str(name): int(size) for name, size in items}
    except (TypeError, ValueError):
        raise InputError(f"mesh must be pairs of (axis name, size), e.g. (('data', 1), ('model', 8)); got {mesh!r}")
    if not axes or any(size < 1 for size in axes.values()):
        raise InputError(f"mesh axis sizes must be positive; got {mesh!r}")
    return axes


def weight_of(node, captured: CapturedProgram) -> tuple[str, bool] | None:
    """(weight name, transposed) if ``node`` is a weight placeholder, possibly through permute/t."""
    transposed = False
    while node.op == "call_function" and node.target in (aten.permute.default, aten.t.default, aten.transpose.int):
        transposed = not transposed
        node = node.args[0]
    if node.op == "placeholder" and node.name in captured.weight_placeholders:
        return captured.weight_placeholders[node.name], transposed
    return None


GROUPED_MM = "transformers.grouped_mm_fallback.default"  # (rows by expert, weights [E, in, out], offsets)


def expert_axis(mesh: Mapping[str, int], mode: str) -> str | None:
    """The mesh axis a mixture-of-experts program splits its experts over, or None."""
    if mode != "tensor_parallel":
        return None
    return next((a for a in ("expert", "model") if mesh.get(a, 1) > 1), None)


def _weight_dim(node, dim: int, captured: CapturedProgram) -> tuple[str, int] | None:
    """(weight name, its dim) that dim ``dim`` of ``node`` is, if ``node`` is a weight through
    transposes and permutes."""
    while node.op == "call_function":
        if node.target is aten.permute.default:
            dim = node.args[1][dim] % len(node.args[1])
        elif node.target is aten.transpose.int:
            rank = len(node.meta["val"].shape)
            a, b = (d % rank for d in node.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif node.target is aten.t.default:
            dim = 1 - dim
        else:
            return None
        node = node.args[0]
    if node.op == "placeholder" and node.name in captured.weight_placeholders:
        return captured.weight_placeholders[node.name], dim
    return None


def matmul_weight(node, captured):
    """For linear-like nodes: (activation input, weight name, weight-is-[out,in], bias name or None)."""
    t = node.target
    if t is aten.linear.default:
        w = weight_of(node.args[1], captured)
        bias = weight_of(node.args[2], captured) if len(node.args) > 2 and node.args[2] is not None else None
        if w and not w[1]:
            return node.args[0], w[0], True, bias[0] if bias else None
    elif t is aten.addmm.default:
        w = weight_of(node.args[2], captured)
        bias = weight_of(node.args[0], captured)
        if w:
            return node.args[1], w[0], w[1], bias[0] if bias else None
    elif t in (aten.mm.default, aten.matmul.default):
        w = weight_of(node.args[1], captured)
        if w:
            return node.args[0], w[0], w[1], None
    return None


def plan(captured: CapturedProgram, mesh: Mapping[str, int], mode: str,
         input_shardings: Mapping[str, Sequence] | None = None) -> dict:
    """Per weight, input and output: a partition spec (a list with an axis name or None per dim).

    ``input_shardings`` names inputs and how they are split (``{"kv_cache_k_0": [None, "model",
    None, None]}``): state a program takes and returns, such as an LLM's KV cache split by head.
    An output of the same name is split the same way, so a donated input's buffer can become it
    in place; other outputs are replicated."""
    if mode not in SHARDING_MODES:
        raise InputError(f"sharding must be one of {', '.join(SHARDING_MODES)}, not {mode!r}")
    model_axis = "model" if "model" in mesh else None
    data_axis = "data" if "data" in mesh else None
    n_model = mesh.get("model", 1)
    weights = {name: [None] * t.dim() for name, t in captured.weights.items()}
    column, row = [], []
    if mode == "tensor_parallel" and model_axis and n_model > 1:
        split: dict = {}  # node -> True when its value is split over the model axis
        for node in captured.graph.nodes:
            if node.op != "call_function":
                continue
            mm = matmul_weight(node, captured)
            if mm is not None:
                act, wname, out_first, bias = mm
                shape = captured.weights[wname].shape
                out_dim, in_dim = (0, 1) if out_first else (1, 0)
                if split.get(act) and shape[in_dim] % n_model == 0:
                    weights[wname][in_dim] = model_axis
                    row.append(wname)
                    split[node] = False
                elif not split.get(act) and shape[out_dim] % n_model == 0:
                    weights[wname][out_dim] = model_axis
                    if bias:
                        weights[bias][0] = model_axis
                    column.append(wname)
                    split[node] = True
                continue
            if node.target in _FLOW:
                split[node] = any(split.get(a) for a in node.all_input_nodes)
    experts, axis = [], expert_axis(mesh, mode)
    for node in captured.graph.nodes if axis else ():
        if node.op == "call_function" and str(node.target) == GROUPED_MM:
            found = _weight_dim(node.args[1], 0, captured)
            if found and captured.weights[found[0]].shape[found[1]] % mesh[axis] == 0:
                weights[found[0]] = [None] * captured.weights[found[0]].dim()
                weights[found[0]][found[1]] = axis
                experts.append(found[0])
    inputs = []
    for spec in captured.inputs:
        s = [None] * len(spec.shape)
        if mode in ("tensor_parallel", "data_parallel") and data_axis and mesh[data_axis] > 1 and s \
                and isinstance(spec.shape[0], int) and spec.shape[0] % mesh[data_axis] == 0:
            s[0] = data_axis
        inputs.append(s)
    for k, spec in enumerate(captured.inputs):
        given = (input_shardings or {}).get(spec.name)
        if given is not None:
            inputs[k] = _given_spec(spec, given, mesh, inputs[k])
    by_name = {spec.name: (list(spec.shape), s) for spec, s in zip(captured.inputs, inputs)}
    # outputs by the module's names for them (a dict's keys, as litert-torch names signature outputs)
    out_names = treespec.unique(treespec.output_names(captured.out_spec))
    out_names += [o.name for o in captured.outputs[len(out_names):]]  # state: "state.<buffer>", as its input
    outputs = [list(by_name[n][1]) if n in by_name and by_name[n][0] == list(o.shape) else [None] * len(o.shape)
               for n, o in zip(out_names, captured.outputs)]
    if mode == "data_parallel":
        column, row = [], []
    plan = {"mode": mode, "mesh": dict(mesh), "weights": weights, "inputs": inputs, "outputs": outputs,
            "column_parallel": column, "row_parallel": row}
    if experts:
        plan.update(expert_axis=axis, expert_parallel=experts)
    return plan


def _given_spec(spec, given: Sequence, mesh: Mapping[str, int], default: list) -> list:
    """A user's partition spec for an input, checked against its shape and the mesh; dims it leaves
    None keep the default split (the batch over ``data``) unless it uses that axis itself."""
    given = list(given)
    if len(given) != len(spec.shape):
        raise InputError(f"input_shardings[{spec.name!r}] has {len(given)} entries; the input has "
                         f"{len(spec.shape)} dims {list(spec.shape)}")
    for dim, (axis, size) in enumerate(zip(given, spec.shape)):
        if axis is None:
            continue
        if axis not in mesh:
            raise InputError(f"input_shardings[{spec.name!r}] names axis {axis!r}; the mesh has {', '.join(mesh)}")
        if not isinstance(size, int) or size % mesh[axis]:
            raise InputError(f"input {spec.name} dim {dim} ({size}) does not divide over the {axis!r} axis "
                             f"({mesh[axis]} devices)")
    return [g if g is not None else (d if d not in given else None) for g, d in zip(given, default)]


def devices_needed(mesh: Mapping[str, int]) -> int:
    return math.prod(mesh.values()) if mesh else 1

