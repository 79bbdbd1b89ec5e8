"""The core ATen opset of the installed torch: every overload tagged ``torch.Tag.core``."""
from __future__ import annotations

import functools

import torch


@functools.cache
def core_aten_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Every core ATen overload, sorted by name (``aten.abs.default`` ...)."""
    seen = set()
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            seen.add((schema.name[len("aten::"):], schema.overload_name or "default"))
    ops = []
    for name, overload in seen:
        try:
            op = getattr(getattr(torch.ops.aten, name), overload)
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.core in op.tags:
            ops.append(op)
    return tuple(sorted(ops, key=str))


@functools.cache
def rewritten_core_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Core ATen ops that torch.export's default decomposition table still rewrites (the symbolic
    shape queries aside, which torch.export resolves itself). A target with a rule for one of them
    keeps it whole: the program stays closer to the model (col2im, the pads and the norm
    backwards lower smaller than their decompositions)."""
    table = torch.export.default_decompositions()
    return tuple(op for op in core_aten_ops() if op in table and not op.name().startswith("aten::sym_"))

