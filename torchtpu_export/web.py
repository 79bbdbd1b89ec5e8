"""Serve converted .tflite models to a browser page that runs them with LiteRT.js.

    torchtpu-export serve-web MODEL.tflite [MORE.tflite ...] [--inputs x.npy ...] [--port 8000]
    python -m torchtpu_export.web MODEL.tflite

The page (``examples/web/``) loads LiteRT.js (``@litertjs/core``, WASM backend) through an
import map. Everything is served from this process: the page, the models, and LiteRT.js's
JavaScript and .wasm files out of ``examples/web/node_modules`` (``npm ci`` there, or
``make web-deps``), so nothing is fetched from a CDN. The server binds 127.0.0.1 unless
``--host`` says otherwise.

URLs: ``/`` (runner page), ``/classify.html`` (image-classification demo), ``/models.json``,
``/models/NAME.tflite`` (``/model.tflite`` is the first model), ``/inputs.json`` and
``/inputs/NAME.npy`` (inputs given with ``--inputs``), ``/labels.json`` (``--labels``), and
``/vendor/@litertjs/{core,wasm-utils}/...``.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import mimetypes
import os
import socket
import sys
import threading
from http import HTTPStatus
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .cli import command
from .errors import ArtifactError, InputError

log = logging.getLogger("torchtpu_export")

WEB_DIR = Path(__file__).resolve().parent.parent / "examples" / "web"
# LiteRT.js 2.5 tensors are float32, int32 or uint8 (its DATATYPES table); anything else at the
# model boundary makes loadAndCompile throw "Element type ... is not supported".
WEB_DTYPES = ("float32", "int32", "uint8")
# npm package -> the folders of it the page may load
_VENDOR = {"@litertjs/core": ("dist", "wasm"), "@litertjs/wasm-utils": ("dist",)}
# files of the web folder that are not part of the page
_PRIVATE = {"package.json", "package-lock.json", "driver.mjs"}
_MIME = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
         ".tflite": "application/octet-stream", ".npy": "application/octet-stream", ".json": "application/json",
         ".html": "text/html; charset=utf-8", ".css": "text/css", ".map": "application/json"}


def describe_tflite(data: bytes, name: str = "model") -> dict:
    """Signatures of a .tflite flatbuffer as ``{key: {"inputs": [...], "outputs": [...]}}``.

    Each tensor is ``{"name", "shape", "dtype"}`` (-1 for a dynamic dim), in the SignatureDef's
    order: the order LiteRT.js and CompiledModel use (the Python interpreter sorts names).
    """
    from ai_edge_litert import schema_py_generated as schema

    if len(data) < 8 or data[4:8] != b"TFL3":
        raise ArtifactError(f"{name} is not a valid .tflite flatbuffer (no TFL3 identifier)")
    dtypes = {v: k.lower() for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    try:
        model = schema.Model.GetRootAs(data, 0)
        out = {}
        for i in range(model.SignatureDefsLength()):
            sig = model.SignatureDefs(i)
            graph = model.Subgraphs(sig.SubgraphIndex())
            out[sig.SignatureKey().decode()] = {
                "inputs": [_tensor_spec(graph, sig.Inputs(j), dtypes) for j in range(sig.InputsLength())],
                "outputs": [_tensor_spec(graph, sig.Outputs(j), dtypes) for j in range(sig.OutputsLength())]}
    except Exception as e:  # a damaged flatbuffer fails anywhere inside the generated readers
        raise ArtifactError(f"{name} is not a valid .tflite flatbuffer: {type(e).__name__}: {e}") from None
    if not out:
        raise ArtifactError(f"{name} has no signatures; LiteRT.js runs models through their signatures",
                            hint="convert it with torchtpu-export, which writes a serving_default signature")
    return out


def _tensor_spec(graph, tensor_map, dtypes: dict) -> dict:
    t = graph.Tensors(tensor_map.TensorIndex())
    if t.ShapeSignatureLength():
        shape = t.ShapeSignatureAsNumpy()
    else:
        shape = t.ShapeAsNumpy() if t.ShapeLength() else []
    return {"name": tensor_map.Name().decode(), "shape": [int(d) for d in shape],
            "dtype": dtypes.get(t.Type(), str(t.Type()))}


def check_web_dtypes(signatures: dict, name: str) -> None:
    """Raises InputError when a model's inputs or outputs have dtypes LiteRT.js cannot hold."""
    bad = [f"{t['name']} ({t['dtype']})" for sig in signatures.values() for side in ("inputs", "outputs")
           for t in sig[side] if t["dtype"] not in WEB_DTYPES]
    if bad:
        raise InputError(f"{name}: LiteRT.js tensors are {', '.join(WEB_DTYPES)}; this model has "
                         f"{', '.join(bad)} at its boundary",
                         hint="reconvert for the web: tte.convert(..., io_dtypes=\"web\")")


def _check_web_dir(web_dir: Path) -> None:
    if not (web_dir / "index.html").is_file():
        raise InputError(f"{web_dir} has no index.html: it is not the examples/web folder",
                         hint="pass --web-dir PATH_TO/examples/web")
    missing = [pkg for pkg in _VENDOR if not (web_dir / "node_modules" / pkg / "package.json").is_file()]
    if missing:
        raise InputError(f"{', '.join(missing)} not installed in {web_dir / 'node_modules'}",
                         hint=f"run `npm ci` in {web_dir} (or `make web-deps`)")


def _load_inputs(paths: list[str], signature: dict) -> dict[str, bytes]:
    """``--inputs`` files as .npy bytes keyed by input name, checked against the model's first signature."""
    import numpy as np

    specs = signature["inputs"]
    arrays: dict[str, np.ndarray] = {}
    for path in paths:
        try:
            loaded = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read --inputs file {path}: {e}") from None
        if isinstance(loaded, np.lib.npyio.NpzFile):
            arrays.update({k: loaded[k] for k in loaded.files})
        else:
            if len(arrays) >= len(specs):
                raise InputError(f"--inputs: the model takes {len(specs)} inputs, got more files")
            arrays[specs[len(arrays)]["name"]] = loaded
    out = {}
    for spec in specs:
        if spec["name"] not in arrays:
            raise InputError(f"--inputs: no value for input {spec['name']!r}",
                             hint=f"the model's inputs are {', '.join(s['name'] for s in specs)}")
        a = arrays.pop(spec["name"])
        if list(a.shape) != spec["shape"]:
            raise InputError(f"--inputs: {spec['name']} has shape {list(a.shape)}, the model takes {spec['shape']}")
        want = np.dtype(spec["dtype"])
        if a.dtype != want:
            if a.dtype.kind in "iub" and want.kind in "iu":
                info = np.iinfo(want)
                if a.size and (a.min() < info.min or a.max() > info.max):
                    raise InputError(f"--inputs: {spec['name']} has values outside {want.name}")
            elif not (a.dtype.kind in "fiub" and want.kind == "f"):
                raise InputError(f"--inputs: {spec['name']} is {a.dtype.name}, the model takes {want.name}")
            a = a.astype(want)
        buf = io.BytesIO()
        np.save(buf, np.asarray(a, order="C"), allow_pickle=False)
        out[spec["name"]] = buf.getvalue()
    if arrays:
        raise InputError(f"--inputs: the model has no input named {', '.join(map(repr, arrays))}")
    return out


class WebServer(ThreadingHTTPServer):
    """An HTTP server for the LiteRT.js page; ``url`` is its address once bound."""

    daemon_threads = True

    def __init__(self, models: dict[str, bytes], *, web_dir: Path, host: str, port: int,
                 inputs: dict[str, bytes] | None = None, labels: list[str] | None = None):
        self.models, self.web_dir, self.inputs, self.labels = dict(models), web_dir, inputs or {}, labels
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.server_address[1]}/"

    def add_model(self, name: str, data: bytes, *, check_dtypes: bool = True) -> str:
        """Serves one more model at ``/models/NAME``; returns that URL path."""
        _check_model(name, data, check_dtypes)
        self.models[name] = data
        return f"/models/{name}"

    def route(self, path: str) -> tuple[bytes | Path, str] | None:
        """The body (bytes or a file) and content type for a URL path, or None for 404."""
        if path in ("/", "/index.html"):
            return self.web_dir / "index.html", _MIME[".html"]
        if path == "/models.json":
            listing = [{"name": n, "url": f"/models/{n}", "bytes": len(b)} for n, b in self.models.items()]
            return json.dumps(listing).encode(), _MIME[".json"]
        if path == "/model.tflite" and self.models:
            return next(iter(self.models.values())), _MIME[".tflite"]
        if path.startswith("/models/") and path[len("/models/"):] in self.models:
            return self.models[path[len("/models/"):]], _MIME[".tflite"]
        if path == "/inputs.json":
            return json.dumps([{"name": n, "url": f"/inputs/{n}.npy"} for n in self.inputs]).encode(), _MIME[".json"]
        if path.startswith("/inputs/") and path.endswith(".npy") and path[8:-4] in self.inputs:
            return self.inputs[path[8:-4]], _MIME[".npy"]
        if path == "/labels.json" and self.labels is not None:
            return json.dumps(self.labels).encode(), _MIME[".json"]
        if path.startswith("/vendor/"):
            return self._vendor_file(path[len("/vendor/"):])
        name = path.lstrip("/")
        if "/" not in name and name not in _PRIVATE and not name.startswith("."):
            return self._file(self.web_dir, name)
        return None

    def _vendor_file(self, rest: str):
        for pkg, folders in _VENDOR.items():
            if rest.startswith(pkg + "/"):
                sub = rest[len(pkg) + 1:]
                if sub.split("/", 1)[0] in folders:
                    return self._file(self.web_dir / "node_modules" / pkg, sub)
        return None

    @staticmethod
    def _file(root: Path, rel: str):
        target = (root / rel).resolve()
        if not target.is_file() or not target.is_relative_to(root.resolve()):
            return None
        mime = _MIME.get(target.suffix) or mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        return target, mime


class _Handler(SimpleHTTPRequestHandler):
    server: WebServer

    def do_GET(self):
        self._respond(send_body=True)

    def do_HEAD(self):
        self._respond(send_body=False)

    def _respond(self, send_body: bool):
        path = unquote(urlsplit(self.path).path)
        found = self.server.route(path) if ".." not in path.split("/") else None
        if found is None:
            self.send_error(HTTPStatus.NOT_FOUND, f"{path} is not served here")
            return
        body, mime = found
        data = body.read_bytes() if isinstance(body, Path) else body
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")  # a re-served model must not come from the cache
        # cross-origin isolation gives the page SharedArrayBuffer, which LiteRT.js's threaded wasm needs
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.end_headers()
        if send_body:
            self.wfile.write(data)

    def log_message(self, format, *args):
        log.debug("%s %s", self.address_string(), format % args)


def start_server(models: list[str | os.PathLike] | dict[str, bytes], *, host: str = "127.0.0.1", port: int = 8000,
                 web_dir: str | os.PathLike | None = None, inputs: list[str] | None = None,
                 labels: str | os.PathLike | None = None, check_dtypes: bool = True) -> WebServer:
    """Binds the server (``port=0`` picks a free port) and serves it from a daemon thread.

    ``models`` are .tflite paths, or ``{file name: flatbuffer bytes}`` (``add_model`` serves more
    later). Stop it with ``shutdown()`` then ``server_close()``.
    """
    web_dir = Path(web_dir) if web_dir is not None else WEB_DIR
    _check_web_dir(web_dir)
    blobs = dict(models) if isinstance(models, dict) else _read_models(models)
    sigs = [_check_model(name, data, check_dtypes) for name, data in blobs.items()]
    if inputs and not sigs:
        raise InputError("--inputs needs a model to feed")
    served_inputs = _load_inputs(inputs, next(iter(sigs[0].values()))) if inputs else None
    label_list = _read_labels(labels) if labels is not None else None
    try:
        server = WebServer(blobs, web_dir=web_dir, host=host, port=port, inputs=served_inputs, labels=label_list)
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                         hint="pick another --port (0 takes any free one)") from None
    threading.Thread(target=server.serve_forever, name="tte-web", daemon=True).start()
    return server


def _check_model(name: str, data: bytes, check_dtypes: bool) -> dict:
    if not name.endswith(".tflite") or "/" in name or name.startswith("."):
        raise InputError(f"model name {name!r} must be a file name ending in .tflite")
    sigs = describe_tflite(data, name)
    if check_dtypes:
        check_web_dtypes(sigs, name)
    return sigs


def _read_models(paths) -> dict[str, bytes]:
    blobs: dict[str, bytes] = {}
    for p in map(Path, paths):
        if p.suffix != ".tflite":
            raise InputError(f"{p} is not a .tflite file",
                             hint=f"convert it first: torchtpu-export {p} --target litert")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read {p}: {e.strerror or e}") from None
        if p.name in blobs:
            raise InputError(f"two models are named {p.name}; rename one")
        blobs[p.name] = data
    return blobs


def _read_labels(path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read --labels file {path}: {e}") from None
    if Path(path).suffix == ".json":
        try:
            labels = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"--labels {path} is not valid JSON: {e}") from None
        if not isinstance(labels, list) or not all(isinstance(s, str) for s in labels):
            raise InputError(f"--labels {path} must be a JSON list of strings")
        return labels
    return [line.strip() for line in text.splitlines() if line.strip()]


def _serve_web_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", metavar="MODEL.tflite", help="converted model(s) to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--inputs", nargs="+", default=None, metavar="FILE",
                   help=".npy files (one per input, in order) or an .npz keyed by input name; default: random")
    p.add_argument("--labels", default=None, help="class names for the classification demo (.txt lines or .json list)")
    p.add_argument("--web-dir", default=None, help=f"the page's folder (default {WEB_DIR})")


@command("serve-web", "serve a .tflite to a browser page that runs it with LiteRT.js")(_serve_web_args)
def _serve_web(args) -> int:
    server = start_server(args.models, host=args.host, port=args.port, web_dir=args.web_dir, inputs=args.inputs,
                          labels=args.labels)
    if not args.quiet:
        print(f"serving {', '.join(server.models)} at {server.url}  (image classification: {server.url}classify.html)"
              "\npress Ctrl-C to stop", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:  # Ctrl-C is how a server is stopped: not an error
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    from .cli import main
    sys.exit(main(["serve-web", *sys.argv[1:]]))
