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


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten.add.Tensor"`` -> ``torch.ops.aten.add.Tensor``."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)
