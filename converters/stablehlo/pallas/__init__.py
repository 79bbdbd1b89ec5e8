"""Pallas TPU kernels for hot ops, each with the check that says when it applies.

Every kernel module exposes ``plan_*(shapes, dtypes, force=...)``, which returns
a plan (block sizes, padding) or an :class:`Unfit` saying why the kernel cannot
take those shapes, and the kernel itself, which follows a plan. The lowering
rules (``ops_hot.py``) decide, per node, between the kernel and XLA.

Kernels run as Mosaic ``tpu_custom_call`` on TPU. On CPU they run in Pallas
interpret mode, which is how their numerics are tested: pass ``interpret=True``
or wrap the call in :func:`interpret_mode`. Whether the TPU compiler accepts
them is tested with libtpu, ahead of time (``compiler_rejects``; the export
checks each kernel it emits the same way).

Kernels: ``attention`` (flash attention, ours, for masks, padding and decode
steps), ``splash`` (JAX's splash attention, for causal and unmasked attention),
``paged`` (attention over a paged KV cache: JAX's paged attention for decode
rows, ours for rows of several queries), ``norm`` (RMSNorm, LayerNorm) and
``int8_matmul``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
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


def traced_in_32_bit(kernel):
    """Traces a kernel with jax's 64-bit mode off.

    Mosaic takes only 32-bit index maps and scalars; under 64-bit mode (on while a program with
    torch's int64/float64 semantics is lowered) a literal ``0`` in an index map becomes i64 and
    the TPU compiler rejects the kernel. The kernels take and return 32-bit and narrower arrays,
    so the program around them keeps its 64-bit semantics.
    """
    @functools.wraps(kernel)
    def wrapper(*args, **kwargs):
        with jax.enable_x64(False):
            return kernel(*args, **kwargs)
    return wrapper


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


_VERDICTS: dict[tuple, str | None] = {}  # (kernel, key, operand avals, topology) -> compiler error or None


def compiler_rejects(kernel: str, call, operands, key, topologies) -> str | None:
    """The TPU compiler's error for ``call(*operands)`` on the first of ``topologies`` that rejects it, or None.

    The kernel is compiled alone, ahead of time through libtpu, once per process for each
    (kernel, key, operand shapes and dtypes, topology); ``key`` holds what ``call`` binds
    (the plan and static parameters).
    """
    from torchtpu_export.targets.tpu import aot as tpu_compile
    avals = tuple((tuple(o.shape), jnp.dtype(o.dtype).name) for o in operands)
    for topology in topologies:
        entry = (kernel, key, avals, topology)
        if entry not in _VERDICTS:
            _VERDICTS[entry] = _compile_alone(call, avals, topology, tpu_compile)
        if _VERDICTS[entry] is not None:
            return f"{topology}: {_VERDICTS[entry]}"
    return None


def _compile_alone(call, avals, topology, tpu_compile) -> str | None:
    from jax.sharding import SingleDeviceSharding
    device = SingleDeviceSharding(tpu_compile.devices_for(topology, 1)[0])
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=device) for shape, dtype in avals]
    try:
        jax.jit(call).trace(*specs).lower(lowering_platforms=("tpu",)).compile()
    except Exception as e:  # the compiler's verdict, whatever form it takes
        return tpu_compile.compiler_message(e, limit=600)
    return None
