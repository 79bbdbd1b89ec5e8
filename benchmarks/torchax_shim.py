"""torchax 0.0.13 names ATen overloads that torch 2.13 removed (named-dimension variants such as
``aten.prod.dim_Dimname``). Importing this before torchax makes those lookups return an inert
placeholder, so torchax's tables build; the placeholders never match a real graph node."""
import torch._ops as _ops

_original = _ops.OpOverloadPacket.__getattr__


class RemovedOverload:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


def _getattr(self, key):
    try:
        return _original(self, key)
    except AttributeError:
        if "dimname" in key.lower() or "names" in key:
            return RemovedOverload(f"{self._qualified_op_name}.{key}")
        raise


_ops.OpOverloadPacket.__getattr__ = _getattr
