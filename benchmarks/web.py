"""LiteRT.js in headless Chromium: load, compile and run times of converted zoo models, next to
the Python LiteRT interpreter on the same flatbuffer, and the largest difference between them.

    python -m benchmarks.web                          # all models, a markdown table to stdout
    python -m benchmarks.web --models mobilenet_v2 --repeats 50 --threads 0

Needs `make web-deps` (chromium, node, examples/web/node_modules). Models with int64 inputs are
converted with io_dtypes="web" (int32 at the boundary), which LiteRT.js needs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from tests.helpers.web_browser import Browser, interpreter_outputs, max_error, missing_web_deps  # the tests' helper

MODELS = ["small_cnn", "mobilenet_v2", "bert_encoder", "llama_decode"]


def _case(name):
    import torch

    from examples import zoo
    if name == "small_cnn":
        return zoo.small_cnn()
    if name == "mobilenet_v2":
        return zoo.mobilenet_v2(size=224)
    if name == "bert_encoder":
        return zoo.bert_encoder()
    model, (prompt,) = zoo.llama(seq=8)
    with torch.no_grad():
        logits, k, v = model.prefill(prompt)
    return zoo.Decode(model), (logits[:, -1:].argmax(-1), torch.tensor([prompt.shape[1]]), k, v)


def _interpreter_ms(model: bytes, inputs: dict, repeats: int) -> float:
    from ai_edge_litert.interpreter import Interpreter
    runner = Interpreter(model_content=model).get_signature_runner("serving_default")
    runner(**inputs)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        runner(**inputs)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, choices=[0, 1], help="0: single-threaded LiteRT.js wasm")
    args = p.parse_args()
    if missing_web_deps():
        print("missing: " + "; ".join(missing_web_deps()) + " (make web-deps)", file=sys.stderr)
        return 1
    import torch

    import torchtpu_export as tte
    from torchtpu_export.targets.litert import web
    server = web.start_server({}, port=0)
    # the CPU (WASM) path, as the table in docs/benchmarks/edge.md reports; the page's default would pick WebGPU when
    # the browser has it (here SwiftShader, a software GPU)
    browser = Browser(server.url + "?accelerator=wasm" + ("" if args.threads else "&threads=0"))
    print("| model | size | convert s | LiteRT.js compile ms | first run ms | median ms | wasm threads "
          "| Python interpreter median ms | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for name in args.models:
            module, sample = _case(name)
            options = {"io_dtypes": "web"} if any(a.dtype == torch.int64 for a in sample) else {}
            t0 = time.perf_counter()
            edge = tte.convert(module, sample, **options)
            convert_s = time.perf_counter() - t0
            model = edge.model_content()
            specs = web.signature_tensors(model)["serving_default"]["inputs"]
            dtypes = {s["name"]: s["dtype"] for s in specs}
            inputs = {s.name: a.numpy().astype(dtypes[s.name]) for s, a in zip(edge.inputs(), sample)}
            url = server.add_model(f"{name}.tflite", model)
            got, t = browser.run(url, inputs, repeats=args.repeats)
            ref = interpreter_outputs(model, inputs)
            diff = max(max_error(got[k], ref[k]) for k in ref)
            print(f"| {name} | {len(model) / 1e6:.2f} MB | {convert_s:.1f} | {t['compileMs']:.1f} | {t['firstRunMs']:.1f} "
                  f"| {t['medianRunMs']:.2f} | {'yes' if t['threads'] else 'no'} "
                  f"| {_interpreter_ms(model, inputs, args.repeats):.2f} | {diff:.1e} |")
    finally:
        browser.close()
        server.shutdown()
        server.server_close()
    print(f"\n{browser.info['userAgent']}; {os.cpu_count()} cores; repeats {args.repeats}; numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
