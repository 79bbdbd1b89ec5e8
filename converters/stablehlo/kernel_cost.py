"""Kernels that pay: a program keeps its Pallas kernels only where the TPU compiler says they cost no more.

A kernel that is faster alone can make its program worse: XLA cannot fuse across a Mosaic call,
and it may relayout the kernel's operands (a KV cache copied whole, layer by layer, into the
kernel's layout). So with ``kernels="auto"`` each program that uses a kernel is compiled whole by
libtpu, ahead of time, with its kernels and lowered with XLA alone, for each TPU generation the
kernels were checked for; the compiler's "bytes accessed" (plus what kernels that declare no
cost, JAX's splash and paged attention, would count) decides. That figure counts staging through
on-chip memory too, so it is not HBM traffic: it compares two programs of the same model, nothing
more.
"""
from __future__ import annotations

import math
from typing import Callable

from torchtpu_export.errors import InputError


def kernels_that_pay(exported, kernel_log: list[dict], lower_xla: Callable, topologies, *, uses_x64: bool,
                     mesh_axes=None, shardings=None, dims=None, donate=()):
    """(program, kernel log, cost record): the program with kernels, or its XLA lowering where the
    kernels access more bytes on any of ``topologies``. The record is ``{"pallas": {topology: bytes},
    "xla": {...}, "kept": "pallas" | "xla"}``, or ``{"kept": "pallas", "not_compared": why}`` where the
    program cannot be compiled whole (an unbounded dynamic dimension, a compiler error)."""
    from torchtpu_export import progress
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
    xla = lower_xla()
    cost = {"pallas": {}, "xla": {}}
    declared = [k["cost"]["bytes_accessed"] for k in kernel_log if k.get("kernel") and k.get("cost")]
    for topology in topologies:
        for name, program in (("pallas", exported), ("xla", xla)):
            try:
                with progress.stage(f"kernels vs XLA ({topology})"):
                    compiled = aot.compile_exported(program, topology, uses_x64=uses_x64, mesh_axes=mesh_axes,
                                                    shardings=shardings, dims=upper, donate=donate)
            except (aot.CompileError, InputError) as e:
                return exported, kernel_log, {"kept": "pallas", "not_compared": f"{topology}, {name}: "
                                              f"{str(e).splitlines()[0][:200]}"}
            accessed = float(aot.cost_of(compiled).get("bytes accessed", 0.0))
            cost[name][topology] = accessed + (float(sum(declared)) if name == "pallas" else 0.0)
    worse = [t for t in topologies if cost["pallas"][t] > cost["xla"][t]]
    if not worse:
        return exported, kernel_log, dict(cost, kept="pallas")
    t = worse[0]
    why = (f"kernels='auto': with kernels the program accesses {_mb(cost['pallas'][t])} on {t}, with XLA alone "
           f"{_mb(cost['xla'][t])}")
    log = [{k: v for k, v in entry.items() if k not in ("kernel", "detail", "cost")} | {"reason": why}
           if entry.get("kernel") else entry for entry in kernel_log]
    return xla, log, dict(cost, kept="xla")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"
