"""Test helpers: run .tflite models in headless Chromium with LiteRT.js, and in Python LiteRT.

``Browser`` talks to ``examples/web/driver.mjs`` (one Chromium for its lifetime) over JSON
lines; ``interpreter_outputs`` and ``compiled_model_outputs`` are the Python references.
"""
from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
WEB_DIR = REPO / "examples" / "web"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
NPM_PACKAGES = ("@litertjs/core", "@litertjs/wasm-utils", "playwright-core")


def missing_web_deps() -> list[str]:
    """What the browser tests need and this machine lacks, each with how to get it."""
    missing = []
    if shutil.which("node") is None:
        missing.append("node (apt-get install nodejs)")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    for pkg in NPM_PACKAGES:
        if not (WEB_DIR / "node_modules" / pkg / "package.json").is_file():
            missing.append(f"npm package {pkg} (npm ci in examples/web)")
    return missing


def require_web_deps() -> None:
    """Fails (never skips) the calling test when the browser toolchain is missing."""
    missing = missing_web_deps()
    if missing:
        pytest.fail("the browser tests cannot run: missing " + "; ".join(missing) +
                    ". `make web-deps` installs them (`make test` runs it first); it failed or was not run.",
                    pytrace=False)


class BrowserError(RuntimeError):
    pass


def _encode(a: np.ndarray) -> dict:
    a = np.asarray(a, order="C")
    return {"dtype": a.dtype.name, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def decode(t: dict) -> np.ndarray:
    """A tensor the page returned ({dtype, shape, b64}) as a numpy array."""
    return np.frombuffer(base64.b64decode(t["b64"]), np.dtype(t["dtype"])).reshape(t["shape"])


class Browser:
    """Headless Chromium on one page of the web server, driven by driver.mjs.

    ``webgpu="swiftshader"`` (default) gives the browser WebGPU on SwiftShader, Chromium's software
    Vulkan; ``webgpu="off"`` launches it without, so WebGPU has no adapter (the page falls back to WASM).
    """

    def __init__(self, url: str, *, webgpu: str = "swiftshader", timeout: float = 120):
        self._log = tempfile.NamedTemporaryFile("w+", prefix="tte-browser-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(["node", str(WEB_DIR / "driver.mjs"), url, "--chromium", CHROMIUM,
                                       "--webgpu", webgpu],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True, cwd=WEB_DIR)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._next_id = 0
        self.info = self._read(timeout)
        if not self.info.get("ready"):
            raise BrowserError(f"the page did not start: {self.info}{self.log_tail()}")

    def _pump(self):
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"no answer from the browser in {timeout:.0f} s{self.log_tail()}") from None
        if line is None:
            raise BrowserError(f"the browser driver exited (code {self._proc.wait()}){self.log_tail()}")
        return json.loads(line)

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(errors="replace")
        return f"\n--- driver log ({self._log.name}) ---\n{text[-n:]}" if text else ""

    def call(self, call: str, args=None, *, page: str | None = None, timeout: float = 300):
        """``window.tte[call](args)`` in the first page, or in ``page`` (a URL relative to the first,
        opened in another tab on first use); raises BrowserError with the page's message."""
        self._next_id += 1
        request = {"id": self._next_id, "call": call, "args": args, "page": page}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._read(timeout)
        if not reply.get("ok"):
            raise BrowserError(reply.get("error", str(reply)))
        return reply["result"]

    def run(self, model_url: str, inputs: dict[str, np.ndarray], *, signature: str | None = None,
            repeats: int = 0, accelerator: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """Runs a served model on named inputs on an accelerator ("auto", "webgpu", "wasm"; default the
        page's, auto); returns ({output name: array}, timings in ms plus "accelerator", the page's
        {requested, used, fullyAccelerated, cpuOps, adapter, note, text})."""
        result = self.call("run", {"model": model_url, "signature": signature, "repeats": repeats,
                                   "accelerator": accelerator,
                                   "inputs": {k: _encode(v) for k, v in inputs.items()}})
        return {k: decode(v) for k, v in result["outputs"].items()}, {**result["timings"],
                                                                       "accelerator": result["accelerator"]}

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        os.unlink(self._log.name)


def interpreter_outputs(model: bytes, inputs: dict[str, np.ndarray], signature: str | None = None) -> dict:
    """The Python LiteRT interpreter's outputs of a signature (default: the first), by name."""
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_content=model)
    runner = interp.get_signature_runner(signature or next(iter(interp.get_signature_list())))
    return {k: np.array(v) for k, v in runner(**inputs).items()}


def compiled_model_outputs(model: bytes, inputs: dict[str, np.ndarray], signature: str | None = None) -> dict:
    """The same through LiteRT's CompiledModel API, the path the Android and iOS runtimes take."""
    from ai_edge_litert.compiled_model import CompiledModel
    with CompiledModel.from_buffer(model) as cm:
        key = signature or next(iter(cm.get_signature_list()))
        details = cm.get_output_tensor_details(key)
        ins = {}
        for name, value in inputs.items():
            ins[name] = cm.create_input_buffer_by_name(key, name)
            ins[name].write(np.asarray(value, order="C"))
        outs = {name: cm.create_output_buffer_by_name(key, name) for name in details}
        cm.run_by_name(key, ins, outs)
        result = {}
        for name, d in details.items():
            shape = tuple(int(s) for s in d["shape"])
            result[name] = outs[name].read(int(np.prod(shape)), np.dtype(d["dtype"])).reshape(shape)
        for buf in [*ins.values(), *outs.values()]:
            buf.destroy()
        return result


def max_error(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's scale (at least 1)."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return float("inf")
    if got.size == 0:
        return 0.0
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64)).max()
    return float(diff / max(1.0, float(np.abs(ref.astype(np.float64)).max())))
