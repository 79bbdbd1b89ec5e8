"""Graph rewrites that put into a captured graph the core ops torch.export never emits.

torch.export functionalises ``out=`` calls and folds symbolic-shape queries into ``sym_size``
arithmetic, so a model cannot make it emit ``atan2.out`` or ``sym_stride``; a converter must
still lower them (they are core ATen, and other front ends emit them). The table's module
calls the op (eager runs it for the reference); these rewrites turn the captured node back
into it, fake-tensor metadata included.
"""
from __future__ import annotations

import torch
from torch._guards import detect_fake_mode

aten = torch.ops.aten


def nodes_of(gm: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    """The graph's calls of ``target`` (RuntimeError if it has none)."""
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
    if not found:
        raise RuntimeError(f"the captured graph has no {target} node to rewrite")
    return found


def finish(gm: torch.fx.GraphModule) -> None:
    """Checks and recompiles the graph after a rewrite."""
    gm.graph.lint()
    gm.recompile()


def replace_with_out_variant(gm: torch.fx.GraphModule, functional, out_variant) -> None:
    """``functional(*args)`` -> ``out_variant(*args, out=empty(...))``."""
    for node in nodes_of(gm, functional):
        val = node.meta["val"]
        with gm.graph.inserting_before(node):
            empty = gm.graph.call_function(aten.empty.memory_format, (list(val.shape),),
                                           {"dtype": val.dtype, "device": val.device})
        with detect_fake_mode([val]):
            empty.meta["val"] = torch.empty(val.shape, dtype=val.dtype)
        node.target = out_variant
        node.kwargs = {**node.kwargs, "out": empty}
    finish(gm)


def retarget(gm: torch.fx.GraphModule, old, new, args_fn=None) -> None:
    """Points every ``old`` node at ``new`` (``args_fn(node) -> (args, kwargs)`` rewrites its arguments)."""
    for node in nodes_of(gm, old):
        node.target = new
        if args_fn is not None:
            node.args, node.kwargs = args_fn(node)
    finish(gm)
