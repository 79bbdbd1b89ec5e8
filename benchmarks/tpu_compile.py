"""What the TPU compiler says about the zoo's tpu programs, on v5e and v6e, with and without Pallas kernels.

libtpu compiles each program ahead of time on this CPU machine (no TPU): HBM bytes, FLOPs and
bytes accessed come from the compiler's memory and cost analysis; the roofline estimate is the
larger of FLOPs / peak bf16 FLOP/s and bytes / HBM bandwidth, from Google's published per-chip
figures. It is a lower bound on a step's time, not a measurement: only a TPU can time a program.

    python -m benchmarks.tpu_compile [-o benchmarks/RESULTS-tpu-compile.md] [--topologies v5e:2x2,v6e:2x2]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

import torchtpu_export as tte  # noqa: E402
from examples import zoo  # noqa: E402
from torchtpu_export.targets.tpu import aot as tpu_compile  # noqa: E402

KERNEL_FRIENDLY = dict(seq=512, dim=1024, heads=8, layers=4, max_seq=1024)  # head_dim 128


def _decode():
    model, _ = zoo.llama(**dict(KERNEL_FRIENDLY, kv_heads=2, head_dim=128))
    k, v = model.empty_cache()
    return zoo.Decode(model), (torch.tensor([[1]]), torch.tensor([700]), k, v)


CASES = {
    "resnet18 (224x224)": lambda: zoo.resnet18(),
    "mobilenet_v2 (224x224)": lambda: zoo.mobilenet_v2(),
    "resnet50 (64x64, width 16)": lambda: zoo.resnet50(),
    "unet (32x32)": lambda: zoo.unet(),
    "dlrm (batch 8)": lambda: zoo.dlrm(),
    "gpt (seq 512, 4 layers, head_dim 128)": lambda: zoo.gpt(**KERNEL_FRIENDLY),
    "llama (seq 512, 4 layers, head_dim 128, GQA 4:1)": lambda: zoo.llama(**dict(KERNEL_FRIENDLY, kv_heads=2,
                                                                                  head_dim=128)),
    "llama decode step (cache 1024)": _decode,
    "bert_encoder (seq 512, head_dim 128)": lambda: zoo.bert_encoder(seq=512, dim=1024, heads=8, layers=4,
                                                                     max_seq=512),
}


def _mb(n: float) -> str:
    return f"{n / 2 ** 20:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--topologies", default="v5e:2x2,v6e:2x2")
    args = p.parse_args(argv)
    topologies = tpu_compile.parse_topologies(args.topologies)
    tpu_compile.require_libtpu("this benchmark")
    rows = []
    for name, make in CASES.items():
        model, margs = make()
        for kernels in ("auto", "xla"):
            t = time.perf_counter()
            prog = tte.export(model, margs, platforms=("tpu",), kernels=kernels)
            export_s = time.perf_counter() - t
            used = sorted({k["kernel"].split(".")[1] for k in prog.kernels() if k.get("kernel")})
            for topo in topologies:
                t = time.perf_counter()
                s = prog.compiled_stats(topo)
                compile_s = time.perf_counter() - t
                hbm = s["hbm_bytes"]
                rows.append([name, "pallas: " + ", ".join(used) if used else ("xla" if kernels == "xla" else
                                                                               "auto (no kernel fits)"),
                             topo, _mb(hbm["total"]), _mb(hbm["arguments"]), _mb(hbm["temporaries"]),
                             "yes" if s["fits"] else "NO", f"{s['flops'] / 1e9:.2f}", _mb(s["bytes_accessed"]),
                             f"{s['roofline']['seconds'] * 1e6:.1f}", s["roofline"]["bound"],
                             f"{export_s:.1f}", f"{compile_s:.1f}"])
                print(" | ".join(rows[-1]), flush=True)
    head = ["model", "kernels", "topology", "HBM total (MiB)", "args (MiB)", "temp (MiB)", "fits", "GFLOP",
            "bytes accessed (MiB)", "roofline (us)", "bound", "export (s)", "compile (s)"]
    load = os.getloadavg()[0]
    text = [
        f"TPU compile statistics, {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores (no TPU), "
        f"torch {torch.__version__.split('+')[0]}, jax {tpu_compile.jaxlib_version()}, libtpu "
        f"{tpu_compile.libtpu_version()}; 1-minute load average {load:.1f} at the end "
        "(`python -m benchmarks.tpu_compile`).",
        "",
        "Each zoo model's tpu program compiled ahead of time by libtpu for each topology, once with the default",
        "`kernels=\"auto\"` (Pallas kernels where they fit and compile) and once with `kernels=\"xla\"`. HBM and",
        "cost figures are the compiler's (per chip); Pallas kernels declare their cost (JAX's splash kernel",
        "declares none, so the manifest's estimate is added). Roofline = max(FLOPs / bf16 peak, bytes / HBM",
        "bandwidth) with the published per-chip figures (v5e 197 TFLOP/s, 819 GB/s; v6e 918 TFLOP/s, 1638 GB/s):",
        "a lower bound for one call, not a measurement. Export and compile times are this machine's.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    text += ["| " + " | ".join(r) + " |" for r in rows]
    out = "\n".join(text) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(out)
    else:
        sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
