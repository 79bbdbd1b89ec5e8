"""``torchtpu-export serve MODEL``: a model server on KServe's Python model server.

    torchtpu-export serve model.tpu [--name NAME] [--host 127.0.0.1] [--port 8080]

Every artifact (``.tpu``, ``.tflite``) is served with the Open Inference Protocol v2, the REST protocol
KServe and Triton speak, implemented by KServe itself: ``/v2/models/{name}/infer``, ``/v2/models/{name}``
(metadata), ``/v2/models/{name}/ready``, ``/v2/health/live`` and ``/v2/health/ready``. An LLM (a ``.tpu``
from ``tte.export_llm``) is run by the continuous-batching engine (:mod:`torchtpu_export.engine`) and also
gets OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (streamed as server-sent events with
``"stream": true``) and ``/v1/models``; its v2 endpoint takes ``input_ids`` (INT32, ``[n]``) and optional
``max_new_tokens`` (INT32, ``[1]``) and gives ``output_ids``.

KServe's own OpenAI layer is built on vLLM's request types (it imports vLLM, a GPU engine); the OpenAI
routes here are this module's, mounted on the same FastAPI application KServe serves. A bad request
gets a 4xx with one message and never touches other requests; a client that goes away mid-stream
frees its slot at the next engine step.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid

import numpy as np

from .errors import InputError, TteError

# v2 datatypes <-> numpy dtype names
V2_DTYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
             "FP32": "float32", "FP64": "float64"}
NP_TO_V2 = {v: k for k, v in V2_DTYPES.items()} | {"bfloat16": "BF16"}
MAX_BODY_TOKENS = 1 << 20  # a prompt of token ids longer than this is refused before it is read into a list


def _import_kserve():
    """kserve parses ``sys.argv`` when imported (its own flags): it sees none of ours."""
    os.environ.setdefault("KSERVE_OPENAI_ROUTE_PREFIX", "")
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        import kserve  # noqa: F401
        from kserve import model_server  # noqa: F401
    except ImportError as e:
        raise InputError(f"serving needs KServe's model server ({e.name or e} is not installed)",
                         hint="pip install 'torchtpu-export[serve]'") from e
    finally:
        sys.argv = argv
    return kserve


def v2_shape(spec) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in spec.shape]


# ---- the v2 model -------------------------------------------------------------------------------

def make_v2_model(kserve, name: str, program, engine=None, tokenizer=None):
    """A ``kserve.Model`` that runs ``program``'s default signature, or (for an LLM) generates."""
    from kserve.errors import InvalidInput
    from kserve.protocol.infer_type import InferOutput, InferResponse

    class ArtifactModel(kserve.Model):
        def __init__(self):
            super().__init__(name)
            self.program, self.llm = program, engine  # (KServe's own `engine` attribute means something else)
            if engine is None:
                self.sig = program.signature(None)
                self.in_specs, self.out_specs = program.inputs(self.sig), program.outputs(self.sig)
            self.ready = True

        def start(self):  # KServe's lifecycle: the engine's scheduler thread runs while the model is served
            if self.llm is not None:
                self.llm.start()
            self.ready = True

        def stop(self):
            if self.llm is not None:
                self.llm.stop()
            self.ready = False

        async def healthy(self) -> bool:
            return self.ready and (self.llm is None or self.llm.running)

        def get_input_types(self):
            if self.llm is not None:
                return [{"name": "input_ids", "datatype": "INT32", "shape": [-1]},
                        {"name": "max_new_tokens", "datatype": "INT32", "shape": [1], "optional": True}]
            return [{"name": s.name, "datatype": NP_TO_V2.get(s.dtype, s.dtype.upper()), "shape": v2_shape(s)}
                    for s in self.in_specs]

        def get_output_types(self):
            if self.llm is not None:
                return [{"name": "output_ids", "datatype": "INT32", "shape": [-1]}]
            return [{"name": s.name, "datatype": NP_TO_V2.get(s.dtype, s.dtype.upper()), "shape": v2_shape(s)}
                    for s in self.out_specs]

        def _array(self, inp, spec_name, dtype, shape):
            if inp.datatype != NP_TO_V2.get(dtype):
                raise InvalidInput(f"input {spec_name!r} must be {NP_TO_V2.get(dtype, dtype)}, got {inp.datatype}")
            try:
                arr = inp.as_numpy()
            except (ValueError, TypeError) as e:
                raise InvalidInput(f"input {spec_name!r}: its data does not match its shape {inp.shape} "
                                   f"and datatype {inp.datatype} ({str(e)[:120]})") from None
            if len(arr.shape) != len(shape) or any(isinstance(d, int) and d >= 0 and d != a
                                                   for d, a in zip(shape, arr.shape)):
                raise InvalidInput(f"input {spec_name!r} must have shape {list(shape)}, got {list(arr.shape)}")
            return arr

        def _inputs(self, payload, specs):
            got = {i.name: i for i in payload.inputs}
            unknown = sorted(set(got) - {s[0] for s in specs})
            if unknown:
                raise InvalidInput(f"unknown input {unknown[0]!r}; the model takes {[s[0] for s in specs]}")
            out = {}
            for spec_name, dtype, shape, required in specs:
                if spec_name not in got:
                    if required:
                        raise InvalidInput(f"missing input {spec_name!r}; the model takes {[s[0] for s in specs]}")
                    continue
                out[spec_name] = self._array(got[spec_name], spec_name, dtype, shape)
            return out

        async def predict(self, payload, headers=None, response_headers=None):
            if self.llm is not None:
                arrays = self._inputs(payload, [("input_ids", "int32", (-1,), True),
                                                ("max_new_tokens", "int32", (1,), False)])
                ids = arrays["input_ids"].tolist()
                limit = int(arrays["max_new_tokens"][0]) if "max_new_tokens" in arrays else 16
                try:
                    request = self.llm.submit(ids, limit, stop=tokenizer.stop_ids if tokenizer else ())
                except InputError as e:
                    raise InvalidInput(_one_line(e)) from None
                tokens = [t async for t in _stream(request)]
                out = InferOutput("output_ids", [len(tokens)], "INT32")
                out.set_data_from_numpy(np.array(tokens, np.int32), binary_data=False)
                return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=name, infer_outputs=[out])
            arrays = self._inputs(payload, [(s.name, s.dtype, s.shape, True) for s in self.in_specs])
            try:
                outs = await asyncio.to_thread(self.program.run_flat, [arrays[s.name] for s in self.in_specs],
                                               self.sig)
            except TteError as e:
                raise InvalidInput(_one_line(e)) from None
            results = []
            for spec, arr in zip(self.out_specs, outs):
                arr = np.asarray(arr)
                if arr.dtype.name == "bfloat16":  # v2's BF16 has no numpy form here: sent as FP32
                    arr = arr.astype(np.float32)
                o = InferOutput(spec.name, list(arr.shape), NP_TO_V2[arr.dtype.name])
                o.set_data_from_numpy(arr, binary_data=False)
                results.append(o)
            return InferResponse(response_id=payload.id or str(uuid.uuid4()), model_name=name, infer_outputs=results)

    return ArtifactModel()


async def _stream(request):
    try:
        async for t in request.astream():
            yield t
    finally:
        request.cancel()  # a no-op once done; frees the slot when the reader went away


# ---- text: tokenizer, chat template, incremental detokenizing -----------------------------------

class TextCodec:
    """The artifact's tokenizer (``tokenizers``) and chat template (jinja, sandboxed, as transformers runs it)."""

    def __init__(self, info: dict, tokenizer_json: bytes):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_str(tokenizer_json.decode())
        self.stop_ids = [int(t) for t in info.get("stop_ids", [])]
        self.template = info.get("chat_template")
        self.bos = self._token(info.get("bos_id"))
        self.eos = self._token(self.stop_ids[0] if self.stop_ids else None)

    def _token(self, i):
        return self.tok.id_to_token(int(i)) if i is not None else None

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: list) -> list[int]:
        if not self.template:
            raise InputError("this model has no chat template: use /v1/completions")
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise InputError(f"the chat template refuses these messages: {message}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        try:
            text = env.from_string(self.template).render(messages=messages, add_generation_prompt=True,
                                                         bos_token=self.bos or "", eos_token=self.eos or "")
        except InputError:
            raise
        except jinja2.TemplateError as e:
            raise InputError(f"the chat template fails on these messages: {e}") from None
        return self.encode(text, special=False)


class Detokenizer:
    """Text deltas of a growing token list; a delta ending inside a multi-byte character waits for the rest."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.sent = codec, [], ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def flush(self) -> str:
        text = self.codec.decode(self.ids)
        delta, self.sent = text[len(self.sent):], text
        return delta


# ---- OpenAI routes -------------------------------------------------------------------------------

class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def _field(body: dict, key: str, kinds, default=None, check=None, what: str = ""):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise OpenAIError(f"{key} must be {what}", param=key)
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise OpenAIError(f"{key} must be {what}", param=key)
    return value


class OpenAIServer:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over the engine."""

    def __init__(self, name: str, engine, codec: TextCodec | None):
        self.name, self.engine, self.codec = name, engine, codec
        self.created = int(time.time())

    def mount(self, app) -> None:
        """Adds the routes to KServe's FastAPI application (plain Starlette routes: the bodies are
        checked here, so a bad one gets OpenAI's error object rather than a validation dump)."""
        from starlette.responses import JSONResponse, StreamingResponse

        def error(e: OpenAIError):
            return JSONResponse({"error": {"message": e.message, "type": "invalid_request_error", "param": e.param,
                                           "code": None}}, status_code=e.status)

        def handler(kind: str):
            async def handle(raw):
                try:
                    body = await _json_body(raw)
                    request, prompt_len, stops = self._submit(kind, body)
                except OpenAIError as e:
                    return error(e)
                if body.get("stream"):
                    options = body.get("stream_options")
                    usage = isinstance(options, dict) and bool(options.get("include_usage"))
                    return StreamingResponse(self._events(kind, request, prompt_len, stops, usage),
                                             media_type="text/event-stream")
                return JSONResponse(await self._complete(kind, request, prompt_len, stops))
            return handle

        async def models(raw):
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        async def model(raw):
            if raw.path_params["model_name"] != self.name:
                return error(OpenAIError(f"no model {raw.path_params['model_name']!r}", 404, "model"))
            return JSONResponse(self._model_card())

        app.add_route("/v1/completions", handler("text_completion"), methods=["POST"])
        app.add_route("/v1/chat/completions", handler("chat.completion"), methods=["POST"])
        app.add_route("/v1/models", models, methods=["GET"])
        app.add_route("/v1/models/{model_name}", model, methods=["GET"])

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "torchtpu-export",
                "max_model_len": self.engine.length}

    def _submit(self, kind: str, body: dict):
        model = body.get("model")
        if model is not None and model != self.name:
            raise OpenAIError(f"no model {model!r}; this server serves {self.name!r}", 404, "model")
        if kind == "chat.completion":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise OpenAIError("messages must be a non-empty list of {role, content} objects", param="messages")
            if self.codec is None:
                raise OpenAIError("this model was exported without a tokenizer: chat needs one")
            try:
                ids = self.codec.chat([_plain_message(m) for m in messages])
            except InputError as e:
                raise OpenAIError(_one_line(e), param="messages") from None
            limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # one prompt in a list
            if isinstance(prompt, str):
                if self.codec is None:
                    raise OpenAIError("this model was exported without a tokenizer: send prompt as token ids",
                                      param="prompt")
                ids = self.codec.encode(prompt)
            elif isinstance(prompt, list) and prompt and len(prompt) <= MAX_BODY_TOKENS and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = prompt
            else:
                raise OpenAIError("prompt must be a string or a list of token ids (one prompt per request)",
                                  param="prompt")
            limit_key = "max_tokens"
        for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "logit_bias"):
            if body.get(unsupported):
                raise OpenAIError(f"{unsupported} is not supported by this server", param=unsupported)
        _field(body, "n", int, 1, lambda v: v == 1, "1 (one choice per request)")
        _field(body, "best_of", int, 1, lambda v: v == 1, "1 (one choice per request)")
        default_max = 16 if kind == "text_completion" else self.engine.length - len(ids)
        max_tokens = _field(body, limit_key, int, default_max, lambda v: v >= 1, "a positive integer")
        temperature = float(_field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "from 0 to 2"))
        top_p = _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "in (0, 1]")
        top_k = _field(body, "top_k", int, None, lambda v: v >= -1, "a positive integer, or -1 for all")
        seed = _field(body, "seed", int, None, lambda v: 0 <= v < 2 ** 64, "an integer from 0 to 2^64 - 1")
        stop = body.get("stop")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
            stops = stop
        else:
            raise OpenAIError("stop must be a string or up to 4 non-empty strings", param="stop")
        if stops and self.codec is None:
            raise OpenAIError("stop strings need the model's tokenizer, which this artifact does not carry",
                              param="stop")
        try:
            request = self.engine.submit(ids, max_tokens, temperature=temperature, top_p=top_p,
                                         top_k=None if top_k in (None, -1, 0) else top_k, seed=seed,
                                         stop=self.codec.stop_ids if self.codec else ())
        except InputError as e:
            raise OpenAIError(_one_line(e), param=limit_key if "fit" in str(e) else None) from None
        return request, len(ids), stops

    async def _deltas(self, request, stops):
        """(text delta, finish reason or None) pairs; stop strings end the request early."""
        detok = Detokenizer(self.codec) if self.codec else None
        text, reason = "", None
        async for token in _stream(request):
            if detok is None:
                yield f"<{token}>", None
                continue
            delta = detok.add(token)
            if stops and delta:
                cut = _earliest(text + delta, stops, len(text))
                if cut is not None:
                    yield (text + delta)[len(text):cut], None
                    reason = "stop"
                    request.cancel()
                    break
            text += delta
            if delta:
                yield delta, None
        if reason is None:
            if detok is not None:
                tail = detok.flush()
                if tail:
                    yield tail, None
            reason = "length" if request.finish_reason == "length" else "stop"
        yield "", reason

    async def _complete(self, kind: str, request, prompt_len: int, stops) -> dict:
        text, reason = "", None
        async for delta, finish in self._deltas(request, stops):
            text += delta
            reason = finish or reason
        choice = ({"index": 0, "text": text, "logprobs": None, "finish_reason": reason} if kind == "text_completion"
                  else {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason})
        return {"id": _id(kind, request), "object": kind, "created": int(time.time()), "model": self.name,
                "choices": [choice], "usage": _usage(prompt_len, request)}

    async def _events(self, kind: str, request, prompt_len: int, stops, include_usage: bool):
        obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        rid, created = _id(kind, request), int(time.time())

        def chunk(delta_text, reason, first=False):
            if kind == "text_completion":
                choice = {"index": 0, "text": delta_text, "logprobs": None, "finish_reason": reason}
            else:
                delta = {"role": "assistant", "content": delta_text} if first else (
                    {"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return _sse({"id": rid, "object": obj, "created": created, "model": self.name, "choices": [choice]})

        try:
            first = True
            async for delta, reason in self._deltas(request, stops):
                if delta or reason or first:
                    yield chunk(delta, reason, first)
                    first = False
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.name, "choices": [],
                            "usage": _usage(prompt_len, request)})
            yield "data: [DONE]\n\n"
        finally:
            request.cancel()


def _one_line(e: TteError) -> str:
    return " ".join(line.strip() for line in e.user_message().splitlines())


def _plain_message(m: dict) -> dict:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is not None and not isinstance(content, str):
        raise InputError("a message's content must be a string or a list of text parts")
    return {"role": m["role"], "content": content or ""}


def _earliest(text: str, stops, after: int):
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _usage(prompt_len: int, request) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": len(request.tokens),
            "total_tokens": prompt_len + len(request.tokens)}


def _id(kind: str, request) -> str:
    return f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _json_body(raw) -> dict:
    data = await raw.body()
    if len(data) > 64 << 20:
        raise OpenAIError("the request body is over 64 MB", 413)
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


class _JsonWithoutContentType:
    """tritonclient sends a v2 request that is JSON alone without a content type; FastAPI (strict content
    types, its default now) then hands KServe raw bytes, which KServe refuses unless a binary-extension
    header says where the JSON ends. Such a request is JSON, as the protocol says: it is marked so."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST":
            names = {k.lower() for k, _ in scope.get("headers", [])}
            if b"content-type" not in names and b"inference-header-content-length" not in names:
                scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


# ---- the server ----------------------------------------------------------------------------------

class Served:
    """What one served file is: its program, and for an LLM the engine and text codec."""

    def __init__(self, path: str, name: str | None = None, *, batched: bool = True):
        from .api import load
        self.path = os.fspath(path)
        self.name = name or os.path.splitext(os.path.basename(self.path))[0]
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise InputError(f"model name {self.name!r}: use letters, digits, '-', '_' and '.'",
                             hint="pass --name")
        self.program = load(self.path)
        manifest = getattr(self.program, "manifest", None) or {}
        self.llm = manifest.get("llm") if isinstance(manifest, dict) else None
        self.engine = self.codec = None
        if self.llm is not None:
            from .engine import Engine
            self.engine = Engine(self.program, batched=batched)
            tok = self.llm.get("tokenizer")
            if tok:
                self.codec = TextCodec(self.llm, self.program.artifact.extras[tok])
        self.processes = self.engine.processes if self.engine is not None else 1
        if _process_count() > 1 and self.processes == 1:
            raise InputError(f"{self.name}: under several processes (jax.distributed) only an LLM sharded over "
                             "all of them is served (process 0 taking the requests)",
                             hint="export it with tte.export_llm(..., target='tpu', mesh=...), or serve this "
                                  "file from one process")

    def app_models(self, kserve):
        return [make_v2_model(kserve, self.name, self.program, self.engine, self.codec)]


def serve(path, *, name: str | None = None, host: str = "127.0.0.1", port: int = 8080,
          batched: bool = True) -> None:
    """Serves one artifact until interrupted (SIGINT/SIGTERM). Under several processes (jax.distributed,
    a sharded LLM program) process 0 serves HTTP and the others run the steps its engine schedules,
    until it stops."""
    kserve = _import_kserve()
    from kserve.model_server import ModelServer, app
    from kserve.protocol.rest.server import RESTServer
    served = Served(path, name, batched=batched)
    if served.processes > 1 and not served.engine.lead:
        import jax
        print(f"process {jax.process_index()} of {served.processes}: running the steps of process 0's engine "
              f"({served.name})", flush=True)
        served.engine.follow()
        return
    app.add_middleware(_JsonWithoutContentType)
    if served.engine is not None:
        OpenAIServer(served.name, served.engine, served.codec).mount(app)
    server = ModelServer(http_port=port, enable_grpc=False, workers=1)
    server._register_and_check_atleast_one_model_is_ready(served.app_models(kserve))
    # ModelServer.start() with the host chosen (it binds 0.0.0.0, right in a container, not on a laptop)
    rest = RESTServer("kserve.model_server:app", server.dataplane, server.model_repository_extension, port,
                      workers=1, grace_period=5)
    rest.config.host = host
    server._rest_server = rest
    server.servers.append(rest.start())
    server.setup_event_loop()
    server.register_signal_handler()
    print(f"serving {served.name} ({served.path}) on http://{host}:{port}"
          + (" with /v1/completions, /v1/chat/completions" if served.engine else "") + " and /v2", flush=True)
    try:
        asyncio.run(server._serve())
    finally:
        if served.engine is not None:
            served.engine.stop()


HELP = "serve an artifact over HTTP (Open Inference Protocol v2; OpenAI completions for LLMs) on KServe"


def add_arguments(p) -> None:
    p.add_argument("model", help="a .tpu or .tflite file")
    p.add_argument("--name", default=None, help="the served model's name (default: the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080, KServe's)")
    p.add_argument("--one-slot", action="store_true",
                   help="LLMs: decode one request at a time (the decode program) even where decode_batch exists")
    g = p.add_argument_group("several hosts (a sharded LLM over a multi-host slice: run the same command on each)")
    g.add_argument("--distributed", action="store_true",
                   help="join JAX's multi-controller runtime (jax.distributed.initialize) first: process 0 serves "
                        "HTTP, the others run its engine's steps. On Cloud TPU VMs the settings come from the "
                        "environment; elsewhere pass the three below")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address for the runtime")
    g.add_argument("--num-processes", type=int, default=None, help="how many processes (hosts) take part")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 to N-1")


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """``jax.distributed.initialize`` with the CLI's settings (none: detected from a TPU VM's environment),
    its failure said in one message."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise InputError("--coordinator, --num-processes and --process-id go together",
                         hint="pass all three, or none on a Cloud TPU VM")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise InputError(f"--process-id must be from 0 to {num_processes - 1}, got {process_id}")
    import jax
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except (RuntimeError, ValueError) as e:
        raise InputError(f"jax.distributed.initialize failed: {str(e).splitlines()[0]}",
                         hint="on a Cloud TPU VM run the same command on every worker; elsewhere pass "
                              "--coordinator, --num-processes and --process-id") from None


def _process_count() -> int:
    """How many processes take part (1 unless jax.distributed was initialized)."""
    jax = sys.modules.get("jax")
    return jax.process_count() if jax is not None and jax.distributed.is_initialized() else 1


def run_cli(args) -> int:
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be from 1 to 65535, got {args.port}")
    if args.distributed:
        initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    serve(args.model, name=args.name, host=args.host, port=args.port, batched=not args.one_slot)
    return 0
