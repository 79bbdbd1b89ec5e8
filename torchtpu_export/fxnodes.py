"""Questions asked of FX nodes by capture and by every converter: an op's name, the user's source
line behind a node, its shape, whether it draws random numbers, and the one unsupported-op check."""
from __future__ import annotations

import os
import re
from collections import Counter
from typing import Callable, Iterable

import torch

from .errors import UnsupportedOpError

_TORCH_DIR = os.path.dirname(torch.__file__)
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def op_name(target) -> str:
    """``aten.add.Tensor`` for an OpOverload; the qualified name for other callables."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', repr(target))}".lstrip(".")


def require_rules(nodes: Iterable[torch.fx.Node], has_rule: Callable, *, target: str, reasons: dict | None = None,
                  default_reason: str = "no rule is registered for it") -> None:
    """Raises UnsupportedOpError for the most used op among ``nodes`` that ``has_rule(op)`` refuses,
    naming its count, the user's source line of its first node and the other unsupported ops."""
    missing: Counter = Counter()
    first: dict = {}
    for node in nodes:
        if not has_rule(node.target):
            missing[node.target] += 1
            first.setdefault(node.target, node)
    if not missing:
        return
    op, count = missing.most_common(1)[0]
    others = sorted(op_name(o) for o in missing if o is not op)
    reason = (reasons or {}).get(op, default_reason)
    if others:
        reason += f" (also unsupported: {', '.join(others)})"
    raise UnsupportedOpError(op_name(op), target=target, reason=reason, count=count,
                             source=user_source_line(first[op]))


def user_source_line(node: torch.fx.Node) -> str | None:
    """The innermost frame of the node's stack trace that is the user's code, as ``file:line: code``."""
    frames = _FRAME_RE.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return None
    for path, line, fn, code in reversed(frames):
        if not (path.startswith(_TORCH_DIR) or path.startswith(_OUR_DIR + os.sep + "torchtpu_export")):
            return f"{path}:{line} in {fn}: {code.strip()}"
    path, line, fn, code = frames[-1]
    return f"{path}:{line} in {fn}: {code.strip()}"


def shape_of(val) -> tuple:
    """A fake tensor's shape, symbolic dims as strings (``"s0"``)."""
    return tuple(_dim(d) for d in val.shape)

def _dim(d):
    if isinstance(d, torch.SymInt):
        text = str(d)
        return int(text) if text.lstrip("-").isdigit() else text
    return int(d)


_DROPOUTS = {"aten::dropout", "aten::native_dropout", "aten::feature_dropout", "aten::alpha_dropout",
             "aten::feature_alpha_dropout"}


# attention ops, tagged random for their dropout: the position of dropout_p
_ATTENTION_DROPOUT = {"aten::scaled_dot_product_attention": 4, "aten::_scaled_dot_product_attention_math": 4,
                      "aten::_scaled_dot_product_flash_attention_for_cpu": 3,
                      "aten::_scaled_dot_product_flash_attention": 3}


def draws_random(node) -> bool:
    """Whether a node draws random numbers: a random op, but not a dropout in eval mode (or p = 0)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    name = node.target._schema.name
    if name in _DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return bool(train) and p != 0
    if name in _ATTENTION_DROPOUT:
        i = _ATTENTION_DROPOUT[name]
        return bool(node.args[i] if len(node.args) > i else node.kwargs.get("dropout_p", 0.0))
    return True
