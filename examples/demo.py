"""make demo: convert a ResNet-18 built from code to a .tpu artifact, reload it, check it against eager."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.utils._pytree as pytree

import torchtpu_export as tte
from torchtpu_export import zoo
from torchtpu_export.numerics import compare

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out")


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    model, args = zoo.resnet18()
    with torch.no_grad():
        ref = pytree.tree_leaves(model(*args))
    rows = []
    ok = True

    t0 = time.perf_counter()
    prog = tte.export(model, args, target="tpu")
    path = os.path.join(OUT, "resnet18.tpu")
    prog.save(path)
    convert_s = time.perf_counter() - t0
    reloaded = tte.load(path)
    reloaded(*args)  # compile once
    t0 = time.perf_counter()
    out = pytree.tree_leaves(reloaded(*args))
    run_ms = (time.perf_counter() - t0) * 1000
    agreement = compare(out, ref, rtol=1e-5)
    ok &= agreement.ok
    rows.append(("tpu (cpu program)", path, os.path.getsize(path), convert_s, run_ms, agreement))

    print(f"ResNet-18 (11.7M parameters), input {tuple(args[0].shape)}")
    print(f"{'target':<20} {'artifact':<24} {'size':>9} {'convert':>8} {'latency':>9}  agreement with eager")
    for target, p, size, cs, ms, a in rows:
        print(f"{target:<20} {os.path.relpath(p):<24} {size / 2**20:>7.1f}MB {cs:>7.1f}s {ms:>7.1f}ms  "
              f"{'OK' if a.ok else 'FAIL'} ({a})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
