"""What every example does: convert to .tpu and .tflite, run both, compare with eager, print one table.

An example exits non-zero if any artifact is out of tolerance or a decoder's tokens differ.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Callable, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree

import torchtpu_export as tte
from torchtpu_export.numerics import compare

OUT = os.environ.get("TTE_EXAMPLES_OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out"))


@dataclasses.dataclass
class Row:
    target: str
    path: str
    size: int
    convert_s: float
    latency_ms: float | None
    check: str
    ok: bool


def median_ms(fn, runs=10, warmup=1) -> float:
    """Median wall time of ``fn()`` in ms, over ``runs`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _eager(model, args):
    with torch.no_grad():
        return [r.numpy() for r in pytree.tree_leaves(model(*args))]


TARGETS = tuple(t for t in os.environ.get("TTE_EXAMPLE_TARGETS", "tpu,litert").split(",") if t)


def convert_both(name: str, make: Callable[[str], object], run: Callable[[object, str], Sequence], check, *,
                 targets=TARGETS) -> list[Row]:
    """``make(target)`` builds an artifact, ``run(artifact, target)`` runs it; ``check(artifact, target)``
    returns (ok, text). Each artifact is saved under out/ and reloaded from disk before it is checked."""
    os.makedirs(OUT, exist_ok=True)
    rows = []
    for target in targets:
        suffix = {"tpu": ".tpu", "litert": ".tflite"}[target]
        path = os.path.join(OUT, name + suffix)
        t0 = time.perf_counter()
        artifact = make(target)
        artifact.save(path)
        convert_s = time.perf_counter() - t0
        loaded = tte.load(path)
        ok, text = check(loaded, target)
        latency = median_ms(lambda: run(loaded, target))
        rows.append(Row(target, os.path.relpath(path), os.path.getsize(path), convert_s, latency, text, ok))
    return rows


def check_outputs(model, args, rtol=1e-5):
    """A ``check`` for single-call models: outputs vs eager within ``rtol`` of the output scale."""
    ref = _eager(model, args)

    def check(artifact, target):
        agreement = compare(pytree.tree_leaves(artifact(*args)), ref, rtol)
        return agreement.ok, f"max abs err {agreement.max_abs_err:.2e}, rel {agreement.max_rel_err:.2e}"
    return check


def single_call_example(name: str, description: str, model, args, rtol=1e-5) -> int:
    rows = convert_both(name, lambda target: tte.export(model, args, target=target),
                        lambda art, target: art(*args), check_outputs(model, args, rtol))
    return report(f"{description}; inputs {', '.join(str(tuple(a.shape)) for a in args)}", rows)


def decoder_example(name: str, description: str, model, prompt, steps: int = 8, rtol=1e-4) -> int:
    """Prefill and decode as two signatures of one artifact; greedy tokens must equal eager's."""
    import zoo
    prefill, decode = zoo.Prefill(model), zoo.Decode(model)
    k, v = model.empty_cache(prompt.shape[0])
    decode_args = (prompt[:, -1:], torch.tensor([prompt.shape[1]]), k, v)
    with torch.no_grad():
        want = zoo.generate(prefill, decode, prompt, steps, model.max_seq)

    def make(target):
        sigs = tte.signature("prefill", prefill, (prompt,)).signature("decode", decode, decode_args)
        return sigs.export(target=target)

    def run(art, target):
        return art(*decode_args, signature_name="decode")

    def check(art, target):
        got = zoo.generate(lambda t: art(t, signature_name="prefill"),
                           lambda *a: art(*a, signature_name="decode"), prompt, steps, model.max_seq)
        ref = _eager(prefill, (prompt,))
        agreement = compare(pytree.tree_leaves(art(prompt, signature_name="prefill")), ref, rtol)
        ok = got == want and agreement.ok
        return ok, f"prefill max abs err {agreement.max_abs_err:.2e}; {steps} greedy tokens " + \
            ("match eager" if got == want else f"DIFFER: {got[-steps:]} vs {want[-steps:]}")

    rows = convert_both(name, make, run, check)
    print(f"eager tokens: {want[prompt.shape[1]:]}")
    return report(f"{description}; prompt {tuple(prompt.shape)}, {steps} greedy tokens "
                  "(latency: one decode step)", rows)


def report(title: str, rows: list[Row]) -> int:
    print(title)
    print(f"{'target':<8} {'artifact':<28} {'size':>9} {'convert':>8} {'latency':>9}  check")
    for r in rows:
        print(f"{r.target:<8} {r.path:<28} {r.size / 2**20:>7.2f}MB {r.convert_s:>7.1f}s "
              f"{r.latency_ms:>7.2f}ms  {'OK' if r.ok else 'FAIL'}: {r.check}")
    ok = all(r.ok for r in rows)
    if not ok:
        print("FAILED: an artifact is out of tolerance", file=sys.stderr)
    return 0 if ok else 1
