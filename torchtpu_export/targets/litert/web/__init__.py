"""Serve converted .tflite models to a browser page that runs them with LiteRT.js.

    torchtpu-export serve-web MODEL.tflite [MORE.tflite ...] [--inputs x.npy ...] [--port 8000]
                             [--accelerator auto|webgpu|wasm]
    python -m torchtpu_export.targets.litert.web MODEL.tflite

The page (``page/``, installed with the package) loads LiteRT.js (``@litertjs/core``) through an
import map and runs the model on its WebGPU accelerator where the browser has WebGPU, else on its
CPU (WASM) path, saying which (``--accelerator`` or the page's ``?accelerator=`` insists on one). Everything is served from this process: the page, the models,
and LiteRT.js's JavaScript and .wasm files, so nothing is fetched from a CDN at run time.
LiteRT.js comes from ``--litertjs DIR`` (a ``node_modules`` folder), ``$TTE_LITERTJS``, a
checkout's ``examples/web/node_modules`` (``make web-deps``), or else is fetched once with npm
into the user cache (``~/.cache/torchtpu_export/litertjs-<version>``). The server binds
127.0.0.1 unless ``--host`` says otherwise.

URLs: ``/`` (runner page), ``/classify.html`` (image-classification demo), ``/models.json``,
``/models/NAME.tflite`` (``/model.tflite`` is the first model), ``/inputs.json`` and
``/inputs/NAME.npy`` (inputs given with ``--inputs``), ``/labels.json`` (``--labels``),
``/config.json`` (``{"accelerator": ...}``, the page's default) and
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
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer, SimpleHTTPRequestHandler
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ....errors import InputError
from ....httpcheck import host_allowed
from ..artifact import signature_tensors

log = logging.getLogger("torchtpu_export")

PAGE_DIR = Path(__file__).resolve().parent / "page"
MAX_PATH = 2048  # longer request paths are refused (400) before they reach the filesystem
LITERTJS_VERSION = "2.5.3"  # examples/web/package.json pins the same
# LiteRT.js 2.5 tensors are float32, int32 or uint8 (its DATATYPES table); anything else at the
# model boundary makes loadAndCompile throw "Element type ... is not supported".
WEB_DTYPES = ("float32", "int32", "uint8")
# the page's accelerator choices: auto (WebGPU where the browser has it and the model compiles for it,
# else WASM), or one of LiteRT.js's two, insisted on (webgpu fails, saying why, where it cannot run)
ACCELERATORS = ("auto", "webgpu", "wasm")
# npm package -> the folders of it the page may load
_VENDOR = {"@litertjs/core": ("dist", "wasm"), "@litertjs/wasm-utils": ("dist",)}
_MIME = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
         ".tflite": "application/octet-stream", ".npy": "application/octet-stream", ".json": "application/json",
         ".html": "text/html; charset=utf-8", ".css": "text/css", ".map": "application/json"}


def check_web_dtypes(signatures: dict, name: str) -> None:
    """Raises InputError when a model's inputs or outputs have dtypes LiteRT.js cannot hold."""
    bad = [f"{t['name']} ({t['dtype']})" for sig in signatures.values() for side in ("inputs", "outputs")
           for t in sig[side] if t["dtype"] not in WEB_DTYPES]
    if bad:
        raise InputError(f"{name}: LiteRT.js tensors are {', '.join(WEB_DTYPES)}; this model has "
                         f"{', '.join(bad)} at its boundary",
                         hint="reconvert for the web: tte.convert(..., io_dtypes=\"web\")")


def _check_page_dir(page_dir: Path) -> None:
    if not (page_dir / "index.html").is_file():
        raise InputError(f"{page_dir} has no index.html: it is not a page folder",
                         hint="leave --web-dir out to serve the page installed with torchtpu-export")


def _has_litertjs(node_modules: Path) -> bool:
    return all((node_modules / pkg / "package.json").is_file() for pkg in _VENDOR)


def litertjs_dir(explicit: str | os.PathLike | None = None, *, fetch: bool = True) -> Path:
    """The ``node_modules`` folder LiteRT.js is served from (see the module docstring for the order)."""
    if explicit is not None or os.environ.get("TTE_LITERTJS"):
        folder = Path(explicit if explicit is not None else os.environ["TTE_LITERTJS"])
        if not _has_litertjs(folder):
            raise InputError(f"{folder} does not hold {' and '.join(_VENDOR)}",
                             hint=f"give the node_modules folder of `npm install @litertjs/core@{LITERTJS_VERSION} "
                                  f"@litertjs/wasm-utils@{LITERTJS_VERSION}`")
        return folder
    checkout = PAGE_DIR.parents[4] / "examples" / "web" / "node_modules"
    if _has_litertjs(checkout):
        return checkout
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtpu_export" / \
        f"litertjs-{LITERTJS_VERSION}"
    if not _has_litertjs(cache / "node_modules") and fetch:
        _fetch_litertjs(cache)
    return cache / "node_modules"


def _fetch_litertjs(cache: Path) -> None:
    """``npm install`` of LiteRT.js into a temporary folder beside ``cache``, renamed into place."""
    import shutil
    import subprocess
    import tempfile
    npm = shutil.which("npm")
    if npm is None:
        raise InputError("serve-web needs LiteRT.js, fetched with npm on first use, and npm is not installed",
                         hint="install Node.js and npm, or pass --litertjs DIR (a node_modules folder with "
                              f"@litertjs/core and @litertjs/wasm-utils {LITERTJS_VERSION})")
    cache.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching LiteRT.js {LITERTJS_VERSION} with npm into {cache} (once)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache.parent, prefix=".litertjs-") as tmp:
        cmd = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", tmp,
               f"@litertjs/core@{LITERTJS_VERSION}", f"@litertjs/wasm-utils@{LITERTJS_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not _has_litertjs(Path(tmp) / "node_modules"):
            raise InputError(f"npm could not fetch LiteRT.js: {(proc.stderr or proc.stdout).strip()[:300]}",
                             hint="check the network and npm's registry, or pass --litertjs DIR")
        try:
            os.replace(tmp, cache)
        except OSError:  # another process fetched it first
            if not _has_litertjs(cache / "node_modules"):
                raise
        else:
            os.mkdir(tmp)  # for TemporaryDirectory's cleanup


def _load_inputs(paths: list[str], signature: dict) -> dict[str, bytes]:
    """``--inputs`` files as .npy bytes keyed by input name, checked against the model's first signature
    (names, shapes from the files' headers before any data is read; then dtypes)."""
    import numpy as np

    from ....npyfiles import scan
    from ....specs import require_memory
    specs = signature["inputs"]
    stored = {}
    for path in paths:
        arrays = scan(path)
        if path.endswith(".npz"):
            stored.update({a.name: a for a in arrays})
        else:
            if len(stored) >= len(specs):
                raise InputError(f"--inputs: the model takes {len(specs)} inputs, got more files")
            stored[specs[len(stored)]["name"]] = arrays[0]
    unknown = set(stored) - {s["name"] for s in specs}
    if unknown:
        raise InputError(f"--inputs: the model has no input named {', '.join(sorted(map(repr, unknown)))}")
    out = {}
    for spec in specs:
        if spec["name"] not in stored:
            raise InputError(f"--inputs: no value for input {spec['name']!r}",
                             hint=f"the model's inputs are {', '.join(s['name'] for s in specs)}")
        item = stored[spec["name"]]
        if list(item.shape) != spec["shape"]:
            raise InputError(f"--inputs: {spec['name']} has shape {list(item.shape)}, the model takes {spec['shape']}")
        require_memory(item.shape, item.dtype, f"--inputs {item.path}")
        a = item.load()
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
    return out


class WebServer(HTTPServer):
    """An HTTP server for the LiteRT.js page; ``url`` is its address once bound.

    Requests are served by a fixed pool of worker threads; connections beyond what the pool and a
    short backlog hold are closed at once, an idle connection is dropped after ``Handler.timeout``
    seconds, and a client that goes away mid-answer is logged at debug level, not as a traceback.
    """

    workers = 16
    backlog = 64

    def __init__(self, models: dict[str, bytes], *, page_dir: Path, vendor_dir: Path, host: str, port: int,
                 inputs: dict[str, bytes] | None = None, labels: list[str] | None = None, accelerator: str = "auto"):
        self.models, self.inputs, self.labels, self.accelerator = dict(models), inputs or {}, labels, accelerator
        self.page_dir, self.vendor_dir = page_dir, vendor_dir
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.server_address[1]}/"
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tte-web")
        self._pending = 0
        self._lock = threading.Lock()
        self._open: set = set()  # connections being served: closed at shutdown so no worker waits on one

    def process_request(self, request, client_address):
        with self._lock:
            if self._pending >= self.workers + self.backlog:
                full = True
            else:
                full, self._pending = False, self._pending + 1
        if full:  # a flood of connections gets closed sockets, not threads
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request, client_address):
        with self._lock:
            self._open.add(request)
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 (reported by handle_error, as socketserver does)
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._lock:
                self._pending -= 1
                self._open.discard(request)

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError, socket.timeout)):
            log.debug("client %s went away: %s", client_address, error)
        else:
            log.warning("serving %s failed: %s: %s", client_address, type(error).__name__, error)

    def server_close(self):
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        # an idle keep-alive connection (a browser tab left open) would hold its worker, and the
        # interpreter's exit that joins it, for up to Handler.timeout: end them now
        with self._lock:
            open_ = list(self._open)
        for sock in open_:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def host_allowed(self, host: str | None) -> bool:
        return host_allowed(self.server_address[0], host)

    def add_model(self, name: str, data: bytes, *, check_dtypes: bool = True) -> str:
        """Serves one more model at ``/models/NAME``; returns that URL path."""
        _check_model(name, data, check_dtypes)
        self.models[name] = data
        return f"/models/{name}"

    def route(self, path: str) -> tuple[bytes | Path, str] | None:
        """The body (bytes or a file) and content type for a URL path, or None for 404."""
        if path in ("/", "/index.html"):
            return self.page_dir / "index.html", _MIME[".html"]
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
        if path == "/config.json":
            return json.dumps({"accelerator": self.accelerator}).encode(), _MIME[".json"]
        if path == "/labels.json" and self.labels is not None:
            return json.dumps(self.labels).encode(), _MIME[".json"]
        if path.startswith("/vendor/"):
            return self._vendor_file(path[len("/vendor/"):])
        name = path.lstrip("/")
        if "/" not in name and not name.startswith("."):
            return self._file(self.page_dir, name)
        return None

    def _vendor_file(self, rest: str):
        for pkg, folders in _VENDOR.items():
            if rest.startswith(pkg + "/"):
                sub = rest[len(pkg) + 1:]
                if sub.split("/", 1)[0] in folders:
                    return self._file(self.vendor_dir / pkg, sub)
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
    timeout = 30  # seconds a connection may sit idle (or trickle a request) before it is dropped

    def do_GET(self):
        self._respond(send_body=True)

    def do_HEAD(self):
        self._respond(send_body=False)

    def _respond(self, send_body: bool):
        if not self.server.host_allowed(self.headers.get("Host")):
            # a page of another site reaching this server through DNS rebinding names its own host
            self.send_error(HTTPStatus.MISDIRECTED_REQUEST, "this server answers to its own address only")
            return
        try:
            path = unquote(urlsplit(self.path).path, errors="strict") if len(self.path) <= MAX_PATH else None
        except ValueError:  # percent-escapes that are not UTF-8
            path = None
        if path is None or "\0" in path:
            self.send_error(HTTPStatus.BAD_REQUEST, "malformed path")
            return
        try:
            found = self.server.route(path) if ".." not in path.split("/") else None
            body, mime = found if found is not None else (None, None)
            data = body.read_bytes() if isinstance(body, Path) else body
        except (OSError, ValueError):  # a name the filesystem refuses is a name not served here
            found = None
        if found is None:
            self.send_error(HTTPStatus.NOT_FOUND, "not served here")
            return
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
                 web_dir: str | os.PathLike | None = None, litertjs: str | os.PathLike | None = None,
                 inputs: list[str] | None = None, labels: str | os.PathLike | None = None,
                 check_dtypes: bool = True, accelerator: str = "auto") -> WebServer:
    """Binds the server (``port=0`` picks a free port) and serves it from a daemon thread.

    ``models`` are .tflite paths, or ``{file name: flatbuffer bytes}`` (``add_model`` serves more
    later). ``web_dir`` replaces the installed page; ``litertjs`` names LiteRT.js's node_modules
    folder (default: see the module docstring). ``accelerator`` is the page's default: ``auto``
    (WebGPU where the browser has it, else WASM), ``webgpu`` or ``wasm``; a page URL's
    ``?accelerator=`` overrides it. Stop it with ``shutdown()`` then ``server_close()``.
    """
    if accelerator not in ACCELERATORS:
        raise InputError(f"accelerator {accelerator!r} is not one of {', '.join(ACCELERATORS)}")
    page_dir = Path(web_dir) if web_dir is not None else PAGE_DIR
    _check_page_dir(page_dir)
    blobs = dict(models) if isinstance(models, dict) else _read_models(models)
    sigs = [_check_model(name, data, check_dtypes) for name, data in blobs.items()]
    if inputs and not sigs:
        raise InputError("--inputs needs a model to feed")
    served_inputs = _load_inputs(inputs, next(iter(sigs[0].values()))) if inputs else None
    label_list = _read_labels(labels) if labels is not None else None
    try:
        server = WebServer(blobs, page_dir=page_dir, vendor_dir=litertjs_dir(litertjs), host=host, port=port,
                           inputs=served_inputs, labels=label_list, accelerator=accelerator)
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                         hint="pick another --port (0 takes any free one)") from None
    threading.Thread(target=server.serve_forever, name="tte-web", daemon=True).start()
    return server


def _check_model(name: str, data: bytes, check_dtypes: bool) -> dict:
    if not name.endswith(".tflite") or "/" in name or name.startswith("."):
        raise InputError(f"model name {name!r} must be a file name ending in .tflite")
    sigs = signature_tensors(data, name)
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


HELP = "serve a .tflite to a browser page that runs it with LiteRT.js"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("models", nargs="+", metavar="MODEL.tflite", help="converted model(s) to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--inputs", nargs="+", default=None, metavar="FILE",
                   help=".npy files (one per input, in order) or an .npz keyed by input name; default: random")
    p.add_argument("--labels", default=None, help="class names for the classification demo (.txt lines or .json list)")
    p.add_argument("--accelerator", choices=ACCELERATORS, default="auto",
                   help="where the page runs the model: auto (default: LiteRT.js's WebGPU accelerator where the "
                        "browser has WebGPU, else its CPU/WASM path, saying why), webgpu (an error where WebGPU "
                        "cannot run it), wasm; a page URL's ?accelerator= overrides it")
    p.add_argument("--web-dir", default=None, help="a page folder to serve instead of the installed one")
    p.add_argument("--litertjs", default=None, metavar="DIR",
                   help="node_modules folder holding @litertjs/core and @litertjs/wasm-utils "
                        "(default: a checkout's examples/web, else fetched with npm into the user cache)")


def run_cli(args) -> int:
    server = start_server(args.models, host=args.host, port=args.port, web_dir=args.web_dir,
                          litertjs=args.litertjs, inputs=args.inputs, labels=args.labels,
                          accelerator=args.accelerator)
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
