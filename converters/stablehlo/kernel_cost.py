"""Kernels that pay: a program keeps its Pallas kernels only where the TPU compiler says they cost no more.

A kernel that is faster alone can make its program worse: XLA cannot fuse across a Mosaic call,
and it may relayout the kernel's operands (a KV cache copied whole, layer by layer, into the
kernel's layout). So with ``kernels="auto"`` each program that uses a kernel is compiled whole by
libtpu, ahead of time, with its kernels, lowered with XLA alone and, where it uses several kinds of
kernel, with each kind left out in turn, for each TPU generation the kernels were checked for; the
compiler's "bytes accessed" (plus what kernels that declare no cost, JAX's splash and paged
attention and ours for paged blocks, would count) decides. That figure counts staging through
on-chip memory too, so it is not HBM traffic: it compares two programs of the same model, nothing
more.
"""
from __future__ import annotations

import math
from typing import Callable

from torchtpu_export import progress
from torchtpu_export.errors import InputError

# a kernel's reason in a lowering that leaves its kind out (``LoweringContext.kernels_off``)
LEFT_OUT = "kernels='auto': the program accesses fewer bytes without it"


def kernels_that_pay(exported, kernel_log: list[dict], lower_xla: Callable, lower_without: Callable | None,
                     topologies, *, uses_x64: bool, mesh_axes=None, shardings=None, dims=None, donate=()):
    """(program, kernel log, cost record): the program with the kernels that pay, or its XLA lowering where
    every set of kernels tried accesses more bytes on one of ``topologies``.

    The program is compiled with all its kernels and with XLA alone; where it uses more than one kind of kernel,
    each kind is then left out in turn (``lower_without(kinds)`` → (program, kernel log)) and stays out where
    the program then accesses fewer bytes on every topology: a kernel that pays in one program (a prompt chunk's
    paged attention in a prefill step) may not in another (beside a decode kernel in a mixed step). The record
    is ``{"pallas": {topology: bytes}, "xla": {...}, "kept": "pallas" | "xla"}`` (``pallas``: the kept kernels'
    program), with ``"without": {kind: {topology: bytes}}`` for each kind tried and ``"dropped": [kinds]``, or
    ``{"kept": "pallas", "not_compared": why}`` where the program cannot be compiled whole (an unbounded dynamic
    dimension, a compiler error)."""
    from torchtpu_export.targets.tpu import aot

    unbounded = sorted(name for name, (_, hi) in (dims or {}).items() if hi is None)
    if unbounded:
        return exported, kernel_log, {"kept": "pallas", "not_compared": f"dynamic dimension(s) "
                                      f"{', '.join(unbounded)} have no upper bound to compile for"}
    upper = {name: hi for name, (_, hi) in (dims or {}).items()}
    chips = math.prod(mesh_axes.values()) if mesh_axes else 1
    topologies = [aot.with_chips(t, chips) for t in topologies]
    if None in topologies:
        return exported, kernel_log, {"kept": "pallas", "not_compared": f"no TPU slice of {chips} chips to compile for"}

    def accessed(program, log) -> dict | str:
        """Bytes accessed per topology (plus what kernels that declare no cost would count), or the error."""
        declared = float(sum(k["cost"]["bytes_accessed"] for k in log if k.get("kernel") and k.get("cost")))
        out = {}
        for topology in topologies:
            try:
                with progress.stage(f"kernels vs XLA ({topology})"):
                    compiled = aot.compile_exported(program, topology, uses_x64=uses_x64, mesh_axes=mesh_axes,
                                                    shardings=shardings, dims=upper, donate=donate)
            except (aot.CompileError, InputError) as e:
                return f"{topology}: {str(e).splitlines()[0][:200]}"
            out[topology] = float(aot.cost_of(compiled).get("bytes accessed", 0.0)) + declared
        return out

    xla, cost = lower_xla(), {}
    for name, program, log in (("pallas", exported, kernel_log), ("xla", xla, [])):
        cost[name] = accessed(program, log)
        if isinstance(cost[name], str):
            return exported, kernel_log, {"kept": "pallas", "not_compared": f"{name}, {cost[name]}"}
    kinds = sorted({k["kernel"].removeprefix("pallas.") for k in kernel_log if k.get("kernel")})
    every, every_log = cost["pallas"], kernel_log  # with every kernel that fits
    dropped = []
    for kind in kinds if lower_without and len(kinds) > 1 else ():
        if len(dropped) + 1 == len(kinds):
            break  # leaving out every kind is the XLA lowering, compared already
        program, log = lower_without(tuple(dropped + [kind]))
        tried = accessed(program, log)
        if isinstance(tried, str):
            continue
        cost.setdefault("without", {})[kind] = tried
        if all(tried[t] < cost["pallas"][t] for t in topologies):
            exported, kernel_log, cost["pallas"], dropped = program, log, tried, dropped + [kind]
    if dropped:
        cost["dropped"] = dropped
        note = (f"kernels='auto': the program without {', '.join('pallas.' + k for k in dropped)} accesses "
                + ", ".join(f"{_mb(cost['pallas'][t])} on {t}, with {_mb(every[t])}" for t in topologies))
        kernel_log = [dict(e, reason=e["reason"].replace(LEFT_OUT, note)) if LEFT_OUT in e.get("reason", "") else e
                      for e in kernel_log]
    worse = [t for t in topologies if cost["pallas"][t] > cost["xla"][t]]
    if not worse:
        return exported, kernel_log, dict(cost, kept="pallas")
    t = worse[0]
    why = (f"kernels='auto': with kernels the program accesses {_mb(cost['pallas'][t])} on {t}, with XLA alone "
           f"{_mb(cost['xla'][t])}")
    log = [{k: v for k, v in entry.items() if k not in ("kernel", "detail", "cost")} | {"reason": why}
           if entry.get("kernel") else entry for entry in every_log]
    return xla, log, dict(cost, kept="xla")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"
