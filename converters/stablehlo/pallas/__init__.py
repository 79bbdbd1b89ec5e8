"""Pallas TPU kernels for hot ops, each with the check that says when it applies.

Every kernel module exposes ``plan_*(shapes, dtypes, force=...)``, which returns
a plan (block sizes, padding) or an :class:`Unfit` saying why the kernel cannot
take those shapes, and the kernel itself, which follows a plan. The lowering
rules (``ops_hot.py``) decide, per node, between the kernel and XLA.

Kernels run as Mosaic ``tpu_custom_call`` on TPU. On CPU they run in Pallas
interpret mode, which is how their numerics are tested: pass ``interpret=True``
or wrap the call in :func:`interpret_mode`.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp

LANES = 128  # the last dim of a TPU vreg
_INTERPRET = [False]


@dataclasses.dataclass(frozen=True)
class Unfit:
    """Why a kernel does not take some shapes.

    ``forcible`` marks limits of cost, not of correctness (padding that costs
    more than it saves, a sequence too short to pay off): ``kernels="pallas"``
    runs the kernel anyway, ``kernels="auto"`` falls back to XLA.
    """

    reason: str
    forcible: bool = False


@contextlib.contextmanager
def interpret_mode(enabled: bool = True):
    """Runs every kernel built inside the block in Pallas interpret mode (to check numerics on CPU)."""
    prev = _INTERPRET[0]
    _INTERPRET[0] = enabled
    try:
        yield
    finally:
        _INTERPRET[0] = prev


def interpreting(interpret: bool | None) -> bool:
    return _INTERPRET[0] if interpret is None else interpret


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def sublanes(dtype) -> int:
    """Rows of one TPU tile for ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit types."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def static_shape(*shapes) -> bool:
    return all(isinstance(d, int) for s in shapes for d in s)


KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def dtype_unfit(dtype) -> Unfit | None:
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
        return Unfit(f"dtype {jnp.dtype(dtype).name} (kernels take float32 and bfloat16)")
    return None
