"""The table of .tflite readers (docs/guides/npus.md) other than LiteRT's CPU interpreter, per zoo model:
Qualcomm's NPU compiler through LiteRT's AOT path (every Qualcomm SoC LiteRT knows; ops on the
NPU; the SM8650 file run on QNN's HTP simulator), LiteRT's GPU-delegate compatibility analyzer (what
`inspect --gpu` prints) and OpenVINO's TFLite frontend on its CPU device. Errors are the max error
against torch eager relative to each output's scale.

    python -m benchmarks.edge_readers [--no-peers]   # from the repository root

Then the GPU-delegate verdicts of litert-torch 0.10's files of the same models beside ours, with
the op types only one of them uses (litert-torch runs in .venv-bench-litert-torch, made on first use).

tests/targets/litert/test_npu.py and tests/targets/litert/test_tflite_consumers.py assert the same (the CNNs on three SoCs within
their tolerances; GPU compatible; OpenVINO within 1e-5); this prints the numbers. Needs the [test]
extra (`openvino`, `onnxruntime-qnn`) and `make`'s QNN libraries (tools/qnn_libs.py).
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import openvino as ov  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

import torchtpu_export as tte  # noqa: E402
from examples import zoo  # noqa: E402
from torchtpu_export.targets.litert import npu
from torchtpu_export import targets  # noqa: E402
from torchtpu_export.numerics import compare  # noqa: E402

SIZES = {"resnet18": {"size": 64}, "mobilenet_v2": {"size": 64}}  # the rest at the zoo's defaults


def _npu_columns(path: str, args, ref) -> tuple[str, str, str]:
    # (SoCs compiled, ops on the NPU, HTP-simulator error on SM8650)
    socs = npu.parse_targets("qualcomm:all")
    try:
        compiled = npu.compile_model(path, socs, keep_going=True)
    except tte.TteError as e:
        return "0", f"failed: {str(e)[:80]}", "-"
    results = npu.soc_results(compiled)
    failed = "; ".join(f"not {b.target_id.split('_', 1)[1]}: {why}" for b, why in compiled.failed_backends)
    if not results:
        return f"0/{len(socs)} ({failed})", "-", "-"
    r = next((r for r in results if r.name == "Qualcomm_SM8650"), results[0])
    ops = f"{r.ops_on_npu}/{r.ops_total}" + (f" ({r.partitions} partitions)" if r.partitions > 1 else "")
    if r.ops_on_npu != r.ops_total:
        return f"{len(results)}/{len(socs)}", ops, "- (CPU ops left: the simulator runs whole-graph files)"
    socs_text = f"{len(results)}/{len(socs)}" + (f" ({failed})" if failed else "")
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "npu.tflite")
        with open(p, "wb") as f:
            f.write(r.content)
        outs = tte.load(p).run_flat([np.asarray(a.numpy()) for a in pytree.tree_leaves(args)], runtime="qnn_htp")
    err = max(float(np.abs(np.asarray(o, np.float64) - x).max() / max(np.abs(x).max(), 1e-12))
              for o, x in zip(outs, ref))
    return socs_text, ops, f"{err:.1e}"


def _histogram(path: str) -> dict[str, int]:
    from torchtpu_export.targets.litert.artifact import op_histogram, validate
    with open(path, "rb") as f:
        return op_histogram(validate(f.read()))


def _verdict(gpu: dict) -> str:
    return "compatible" if gpu["compatible"] else "not: " + "; ".join(gpu["problems"])[:200]


def peers_table(tmp: str) -> list[str]:
    """The same models converted by litert-torch 0.10 (in its own venv, as benchmarks/
    litert_vs_litert_torch.py makes it): GPU-delegate verdicts side by side, and the op types only
    one of the two files uses."""
    from benchmarks.litert_vs_litert_torch import convert_in_child, ensure_bench_venv
    peer_py = ensure_bench_venv()
    lines = ["| model | ours: ops, GPU delegate | litert-torch 0.10: ops, GPU delegate | op types only ours use "
             "| op types only litert-torch's use |", "|---|---|---|---|---|"]
    for name in zoo.ZOO:
        ours, theirs = os.path.join(tmp, f"{name}.tflite"), os.path.join(tmp, f"{name}_litert_torch.tflite")
        conv = convert_in_child(peer_py, "litert_torch", name, theirs, SIZES.get(name, {}))
        h_ours = _histogram(ours)
        ours_text = f"{sum(h_ours.values())}, {_verdict(targets.get('litert').gpu_check(ours))}"
        if "error" in conv:
            lines.append(f"| {name} | {ours_text} | conversion failed: {conv['error'][:120]} | | |")
            continue
        h_theirs = _histogram(theirs)
        only = (", ".join(sorted(set(h_ours) - set(h_theirs))) or "-",
                ", ".join(sorted(set(h_theirs) - set(h_ours))) or "-")
        lines.append(f"| {name} | {ours_text} | {sum(h_theirs.values())}, "
                     f"{_verdict(targets.get('litert').gpu_check(theirs))} | {only[0]} | {only[1]} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    print("| model | Qualcomm SoCs compiled | ops on the NPU | HTP simulator vs torch (fp16 math) "
          "| GPU delegate (LiteRT's analyzer) | OpenVINO CPU vs torch |")
    print("|---|---|---|---|---|---|")
    core = ov.Core()
    with tempfile.TemporaryDirectory() as tmp:
        for name, factory in zoo.ZOO.items():
            model, args = factory(**SIZES.get(name, {}))
            with torch.no_grad():
                ref = [r.numpy() for r in pytree.tree_leaves(model(*args))]
            path = os.path.join(tmp, f"{name}.tflite")
            tte.convert(model, args).export(path)
            # float32 as the file says (OpenVINO's default on CPUs with bf16 units is bf16)
            compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
            result = compiled([np.asarray(a.numpy()) for a in pytree.tree_leaves(args)])
            error = compare([result[o] for o in compiled.outputs], ref, rtol=1e-5).max_rel_err
            verdict = _verdict(targets.get("litert").gpu_check(path))
            socs, ops, sim = _npu_columns(path, args, ref)
            print(f"| {name} | {socs} | {ops} | {sim} | {verdict} | {error:.1e} |", flush=True)
        if "--no-peers" not in sys.argv:
            print()
            lines = peers_table(tmp)
            print("\n".join(["", "full table:", *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
