"""The server itself: what one served file is (:class:`Served`), the health routes that tell the truth,
:func:`serve` (KServe's model server, built from its public parts, bound where asked, with the guard in
front and OpenAI's routes for an LLM) and ``torchtpu-export serve``'s command line."""
from __future__ import annotations

import asyncio
import os
import sys

from . import distributed
from ..errors import InputError
from .common import Limits
from .guard import RequestGuard
from .openai import OpenAIServer
from .v2 import import_kserve, make_v2_model


def mount_health(app, served) -> None:
    """``/v2/health/live``, ``/v2/health/ready`` and ``/v2/models/{name}/ready`` that tell the truth: ready
    while the model is loaded and (for an LLM) its engine runs; not ready (503) once either stops."""
    from starlette.responses import JSONResponse

    async def live(raw):
        ok = served.live()
        return JSONResponse({"live": ok}, status_code=200 if ok else 503)

    async def ready(raw):
        ok = served.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def model_ready(raw):
        name = raw.path_params["model_name"]
        if name != served.name:
            return JSONResponse({"error": f"model {name!r} is not served here"}, status_code=404)
        ok = served.ready()
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 503)

    app.add_route("/v2/health/live", live, methods=["GET"])
    app.add_route("/v2/health/ready", ready, methods=["GET"])
    app.add_route("/v2/models/{model_name}/ready", model_ready, methods=["GET"])


class Served:
    """What one served file is: its program, and for an LLM the engine and text workers."""

    def __init__(self, path: str, name: str | None = None, *, batched: bool = True, text_workers: int = 2,
                 text_budget: float = 10.0, prefix_cache: bool = True, warm: bool = False,
                 trust_stored_executables: bool = False):
        from ..api import load
        self.path = os.fspath(path)
        self.name = name or os.path.splitext(os.path.basename(self.path))[0]
        if not self.name or len(self.name) > 128 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise InputError(f"model name {self.name!r}: use up to 128 letters, digits, '-', '_' and '.'",
                             hint="pass --name")
        self.program = load(self.path, trust_stored_executables=trust_stored_executables)
        self.llm = self.program.llm
        self.session = self.engine = None
        self.stop_ids: tuple = ()
        self.model = None
        if self.llm is not None:
            from ..engine.session import LlmSession
            from ..errors import ArtifactError
            try:
                self.session = LlmSession(self.program, batched=batched, prefix_cache=prefix_cache, warm=warm,
                                          text_workers=text_workers, text_budget=text_budget)
            except ArtifactError as e:
                raise ArtifactError(f"{self.path}: {e}", hint=e.hint) from e
            self.engine, self.stop_ids = self.session.engine, self.session.stop_ids
            self.limits = Limits.for_cache(self.engine.length)
        else:
            sig = self.program.signature(None)
            self.limits = Limits.for_inputs(self.program.inputs(sig))
        self.processes = self.engine.processes if self.engine is not None else 1
        if _process_count() > 1 and self.processes == 1:
            raise InputError(f"{self.name}: under several processes (jax.distributed) only an LLM sharded over "
                             "all of them is served (process 0 taking the requests)",
                             hint="export it with tte.export_llm(..., target='tpu', mesh=...), or serve this "
                                  "file from one process")

    def app_models(self, kserve):
        self.model = make_v2_model(kserve, self.name, self.program, self.engine, self.stop_ids)
        return [self.model]

    def live(self) -> bool:
        return self.engine is None or self.engine.running

    def ready(self) -> bool:
        return bool(self.model is not None and self.model.ready and (self.engine is None or self.engine.running))

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def serve(path, *, name: str | None = None, host: str = "127.0.0.1", port: int = 8080,
          batched: bool = True, allow_origins=(), text_budget: float = 10.0, prefix_cache: bool = True,
          warm: bool = True, trust_stored_executables: bool = False, image_budget: float = 10.0) -> None:
    """Serves one artifact until interrupted (SIGINT/SIGTERM). Under several processes (jax.distributed,
    a sharded LLM program) process 0 serves HTTP and the others run the steps its engine schedules,
    until it stops. ``trust_stored_executables``: load the file's stored executables (native code; see
    ``tte.load``) rather than compile."""
    kserve = import_kserve()
    from kserve.model_server import ModelServer, app
    # bound before the model loads: a port in use or another machine's address is the user's error, said at once
    # (uvicorn found it only after loading, and exited 3, the code of a failed capture)
    sockets = listen_sockets(host, port) if _lead_process() else []
    try:
        served = Served(path, name, batched=batched, text_budget=text_budget, prefix_cache=prefix_cache,
                        warm=warm, trust_stored_executables=trust_stored_executables)
    except BaseException:
        _close(sockets)
        raise
    openai = None
    try:
        if served.engine is not None and "warm_seconds" in served.engine.stats:
            print(f"compiled the engine's device calls in {served.engine.stats['warm_seconds']:.1f} s: serving "
                  "compiles nothing", flush=True)
        if served.processes > 1 and not served.engine.lead:
            import jax
            print(f"process {jax.process_index()} of {served.processes}: running the steps of process 0's engine "
                  f"({served.name})", flush=True)
            served.engine.follow()
            return
        app.add_middleware(RequestGuard, bound=host, openai=served.engine is not None,
                           body_limit=served.limits.body, allow_origins=allow_origins)
        mount_health(app, served)
        if served.engine is not None:
            openai = OpenAIServer(served.name, served.session, served.limits, image_budget=image_budget)
            openai.mount(app)
        server = ModelServer(http_port=port, enable_grpc=False, workers=1)
        register_models(server, served.app_models(kserve))
        http = rest_server(server, app, host, port, sockets)
        server.setup_event_loop()
        server.register_signal_handler()  # SIGINT/SIGTERM: KServe's stop(), which unloads (stops) the model
        print(f"serving {served.name} ({served.path}) on http://{host}:{port}"
              + (" with /v1/completions, /v1/chat/completions" if served.engine else "") + " and /v2", flush=True)
        asyncio.run(http())
    finally:
        if openai is not None:
            openai.close()
        served.close()
        _close(sockets)


def listen_sockets(host: str, port: int) -> list:
    """Sockets bound to every address ``host`` resolves to, at ``port``, as asyncio's ``create_server`` binds
    them (SO_REUSEADDR; IPv6 sockets IPv6 only), for :func:`rest_server`; InputError naming ``--host`` or
    ``--port`` when one cannot be bound."""
    import errno
    import socket
    anywhere = "give one of its addresses: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise InputError(f"--host {host!r} is not an address this machine can listen on "
                         f"({getattr(e, 'strerror', None) or e})",
                         hint=anywhere) from None
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as e:
        _close(sockets)
        if e.errno == errno.EADDRINUSE:
            raise InputError(f"--port {port} is in use on {host} (another server listens there)",
                             hint="choose another --port, or stop the other server") from None
        if e.errno == errno.EACCES:
            raise InputError(f"--port {port}: this user may not listen there (ports below 1024 need privileges)",
                             hint="choose a port from 1024") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise InputError(f"--host {host!r} is not an address of this machine", hint=anywhere) from None
        raise InputError(f"cannot listen on {host}:{port} (--host, --port): {e.strerror}") from None
    return sockets


def _close(sockets) -> None:
    for sock in sockets:
        sock.close()


def _lead_process() -> bool:
    """Whether this process serves HTTP: the only one, or process 0 of a jax.distributed job."""
    jax = sys.modules.get("jax")
    return jax is None or not jax.distributed.is_initialized() or jax.process_index() == 0


def register_models(server, models) -> None:
    """What ``ModelServer.start(models)`` does with its models, by KServe's public methods: each ready one
    registered (with the server's latency logging), each started (an LLM's engine starts), and KServe's
    ``NoModelReady`` when none is ready. (``start`` itself also binds 0.0.0.0, right in a container but not
    on a laptop, and has no host to pass: the REST server is built by :func:`rest_server`.)"""
    from kserve.errors import NoModelReady
    ready = False
    for model in models:
        if model.ready:
            ready = True
            server.register_model(model)
            model.enable_latency_logging = server.enable_latency_logging
        model.start()
    if models and not ready:
        raise NoModelReady(models)


def rest_server(server, app, host: str, port: int, sockets: list):
    """KServe's REST server for ``server``'s models on ``host``: KServe's ``RESTServer`` builds the application
    (its v2 routes, /metrics, timing middleware and error handlers, over the server's data plane) and
    uvicorn serves it as ``RESTServer.start()`` would, but on ``sockets`` (:func:`listen_sockets`: bound to
    ``host``, where ``RESTServer`` always binds 0.0.0.0). Returns the coroutine function that serves until the
    server is told to stop."""
    import uvicorn
    from kserve.protocol.rest.server import RESTServer
    rest = RESTServer("kserve.model_server:app", server.dataplane, server.model_repository_extension, port,
                      workers=1, grace_period=5)
    config = uvicorn.Config(app, host=host, port=port, workers=1, log_config=None,  # KServe configures logging
                            timeout_graceful_shutdown=5, timeout_keep_alive=server.timeout_keep_alive,
                            loop=server.event_loop)

    async def run():
        rest.create_application()
        await uvicorn.Server(config).serve(sockets=sockets)
    return run


HELP = "serve an artifact over HTTP (Open Inference Protocol v2; OpenAI completions for LLMs) on KServe"


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="a .tpu or .tflite file")
    p.add_argument("--name", default=None, help="the served model's name (default: the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080, KServe's)")
    p.add_argument("--one-slot", action="store_true",
                   help="LLMs: decode one request at a time (the decode program) even where decode_batch exists")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="LLMs: prefill every prompt whole (by default the KV cache of prompts' full pages is kept on "
                        "the device and a prompt starting the same way prefills only the rest)")
    p.add_argument("--no-warm", action="store_true",
                   help="LLMs: compile each device call on its first use (by default every program and step the "
                        "engine may call is compiled before the server takes requests, and serving compiles nothing)")
    p.add_argument("--trust-stored-executables", action="store_true",
                   help=".tpu: load the file's stored executables (torchtpu-export compile) instead of compiling. "
                        "They are native code, run as they are: only for files you trust (without this flag they "
                        "are never read)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN (e.g. https://app.example.com; '*' for any) call the server "
                        "(CORS); without it, requests a browser marks cross-site are refused")
    p.add_argument("--text-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="LLMs: the longest one tokenizing, chat-template or detokenizing step may take (default 10)")
    p.add_argument("--image-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="VLMs: the longest one image's decoding may take, in an image worker (default 10)")
    g = p.add_argument_group("several hosts (a sharded LLM over a multi-host slice: run the same command on each)")
    g.add_argument("--distributed", action="store_true",
                   help="join JAX's multi-controller runtime first: process 0 serves HTTP, the others run its "
                        "engine's steps. Processes prove they belong to the job with a shared secret "
                        f"({'$' + distributed.TOKEN_ENV} or --token-file). On Cloud TPU VMs the rest comes from the "
                        "environment; elsewhere pass the three below")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address for the runtime (process 0 listens there, on that address only)")
    g.add_argument("--num-processes", type=int, default=None, help="how many processes (hosts) take part")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 to N-1")
    g.add_argument("--token-file", default=None, metavar="FILE",
                   help=f"the job's shared secret (default: ${distributed.TOKEN_ENV}); make one with "
                        "`torchtpu-export serve --new-token FILE`")
    p.add_argument("--new-token", default=None, metavar="FILE",
                   help="write a new random secret for a --distributed job to FILE (readable by you only) and exit")


def _process_count() -> int:
    """How many processes take part (1 unless jax.distributed was initialized)."""
    jax = sys.modules.get("jax")
    return jax.process_count() if jax is not None and jax.distributed.is_initialized() else 1


def run_cli(args) -> int:
    if args.new_token is not None:
        distributed.new_token_file(args.new_token)
        print(f"wrote a new secret to {args.new_token}: give it to every process of the job "
              f"(--token-file, or ${distributed.TOKEN_ENV})")
        return 0
    if args.model is None:
        raise InputError("serve takes the model file to serve", hint="torchtpu-export serve model.tpu")
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be from 1 to 65535, got {args.port}")
    for flag, seconds in (("--text-timeout", args.text_timeout), ("--image-timeout", args.image_timeout)):
        if not 0 < seconds <= 3600:
            raise InputError(f"{flag} must be above 0 and at most 3600 seconds, got {seconds}")
    for origin in args.allow_origin:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise InputError(f"--allow-origin {origin!r}: give an origin such as https://app.example.com, or '*'")
    given = [args.coordinator, args.num_processes, args.process_id, args.token_file]
    if not args.distributed and any(v is not None for v in given):
        raise InputError("--coordinator, --num-processes, --process-id and --token-file go with --distributed")
    if args.distributed:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, token_file=args.token_file)
    serve(args.model, name=args.name, host=args.host, port=args.port, batched=not args.one_slot,
          allow_origins=args.allow_origin, text_budget=args.text_timeout, prefix_cache=not args.no_prefix_cache,
          warm=not args.no_warm, trust_stored_executables=args.trust_stored_executables,
          image_budget=args.image_timeout)
    return 0
