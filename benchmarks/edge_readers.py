"""The README's table of .tflite readers other than LiteRT's CPU interpreter, per zoo model: LiteRT's
GPU-delegate compatibility analyzer (what `inspect --gpu` prints) and OpenVINO's TFLite frontend on
its CPU device, as the max error against torch eager relative to each output's scale.

    python benchmarks/edge_readers.py

tests/test_edge_consumers.py asserts the same (compatible; OpenVINO within 1e-5); this prints the
numbers. Needs `openvino` (in the [test] extra).
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))  # zoo
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import openvino as ov  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

import torchtpu_export as tte  # noqa: E402
import zoo  # noqa: E402
from torchtpu_export import targets  # noqa: E402
from torchtpu_export.numerics import compare  # noqa: E402

SIZES = {"resnet18": {"size": 64}, "mobilenet_v2": {"size": 64}}  # the rest at the zoo's defaults


def main() -> int:
    print("| model | GPU delegate (LiteRT's analyzer) | OpenVINO CPU vs torch (max error / output scale) |")
    print("|---|---|---|")
    core = ov.Core()
    with tempfile.TemporaryDirectory() as tmp:
        for name, factory in zoo.ZOO.items():
            model, args = factory(**SIZES.get(name, {}))
            with torch.no_grad():
                ref = [r.numpy() for r in pytree.tree_leaves(model(*args))]
            path = os.path.join(tmp, f"{name}.tflite")
            tte.convert(model, args).export(path)
            compiled = core.compile_model(core.read_model(path), "CPU")
            result = compiled([np.asarray(a.numpy()) for a in pytree.tree_leaves(args)])
            error = compare([result[o] for o in compiled.outputs], ref, rtol=1e-5).max_rel_err
            gpu = targets.get("litert").gpu_check(path)
            verdict = "compatible" if gpu["compatible"] else "not: " + "; ".join(gpu["problems"])[:200]
            print(f"| {name} | {verdict} | {error:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
