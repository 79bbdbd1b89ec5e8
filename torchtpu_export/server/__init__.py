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
import dataclasses
import json
import os
import sys
import time
import uuid

import numpy as np

from . import distributed
from ..errors import InputError, TteError

# v2 datatypes <-> numpy dtype names
V2_DTYPES = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
             "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "FP16": "float16",
             "FP32": "float32", "FP64": "float64"}
NP_TO_V2 = {v: k for k, v in V2_DTYPES.items()} | {"bfloat16": "BF16"}


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

def make_v2_model(kserve, name: str, program, engine=None, stop_ids=()):
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
                    request = self.llm.submit(ids, limit, stop=stop_ids)
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


# ---- what a request may carry ---------------------------------------------------------------------

CHARS_PER_POSITION = 32  # prompt characters per cache position: far more than any real text needs
MAX_V2_BODY = 64 << 20  # a v2 request to a model whose input shapes are not all known


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may carry. An LLM's come from its cache: a prompt that fits ``C`` positions has
    far fewer than ``32 C`` characters and ``C`` messages, so anything larger is refused before it is
    tokenized or rendered (and a chat template may write no more than that either)."""

    chars: int  # prompt characters, or the text of all messages together
    messages: int
    body: int  # request body bytes (JSON escapes a character in at most 12)

    @classmethod
    def for_cache(cls, length: int) -> "Limits":
        chars = CHARS_PER_POSITION * length + 4096
        return cls(chars=chars, messages=length, body=(1 << 20) + 12 * chars)

    @classmethod
    def for_inputs(cls, specs) -> "Limits":
        """A v2 model's: its inputs' elements as JSON numbers (at most 32 bytes each) when every shape is known."""
        if not all(isinstance(d, int) and d >= 0 for s in specs for d in s.shape):
            return cls(chars=0, messages=0, body=MAX_V2_BODY)
        return cls(chars=0, messages=0, body=(1 << 20) + 32 * sum(int(np.prod(s.shape)) for s in specs))


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
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over the engine. Text work
    (tokenizing, the chat template, detokenizing) runs in ``text``'s worker processes, never on the
    event loop."""

    def __init__(self, name: str, engine, text=None, stop_ids=(), limits: Limits | None = None):
        self.name, self.engine, self.text, self.stop_ids = name, engine, text, tuple(stop_ids)
        self.limits = limits or Limits.for_cache(engine.length)
        self.created = int(time.time())

    def mount(self, app) -> None:
        """Adds the routes to KServe's FastAPI application (plain Starlette routes: the bodies are
        checked here, so a bad one gets OpenAI's error object rather than a validation dump)."""
        from starlette.responses import JSONResponse, StreamingResponse

        def handler(kind: str):
            async def handle(raw):
                try:
                    body = await _json_body(raw, self.limits.body)
                    request, prompt_len, stops = await self._submit(kind, body)
                    if body.get("stream"):
                        options = body.get("stream_options")
                        usage = isinstance(options, dict) and bool(options.get("include_usage"))
                        return StreamingResponse(self._events(kind, request, prompt_len, stops, usage),
                                                 media_type="text/event-stream")
                    return JSONResponse(await self._complete(kind, request, prompt_len, stops))
                except OpenAIError as e:
                    return _error_response(e)
            return handle

        async def models(raw):
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        async def model(raw):
            if raw.path_params["model_name"] != self.name:
                return _error_response(OpenAIError(f"no model {raw.path_params['model_name']!r}", 404, "model"))
            return JSONResponse(self._model_card())

        app.add_route("/v1/completions", handler("text_completion"), methods=["POST"])
        app.add_route("/v1/chat/completions", handler("chat.completion"), methods=["POST"])
        app.add_route("/v1/models", models, methods=["GET"])
        app.add_route("/v1/models/{model_name}", model, methods=["GET"])

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "torchtpu-export",
                "max_model_len": self.engine.length}

    async def _submit(self, kind: str, body: dict):
        """Checks every field, then tokenizes (in a text worker) and queues the request."""
        model = body.get("model")
        if model is not None and model != self.name:
            raise OpenAIError(f"no model {model!r}; this server serves {self.name!r}", 404, "model")
        for unsupported in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "logit_bias"):
            if body.get(unsupported):
                raise OpenAIError(f"{unsupported} is not supported by this server", param=unsupported)
        _field(body, "n", int, 1, lambda v: v == 1, "1 (one choice per request)")
        _field(body, "best_of", int, 1, lambda v: v == 1, "1 (one choice per request)")
        _field(body, "stream", bool, False, None, "true or false")
        limit_key = "max_completion_tokens" if kind == "chat.completion" and \
            body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, limit_key, int, None, lambda v: v >= 1, "a positive integer")
        temperature = float(_field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "from 0 to 2"))
        top_p = _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "in (0, 1]")
        top_k = _field(body, "top_k", int, None, lambda v: v >= -1, "a positive integer, or -1 for all")
        seed = _field(body, "seed", int, None, lambda v: 0 <= v < 2 ** 64, "an integer from 0 to 2^64 - 1")
        stops = self._stops(body.get("stop"))
        ids = await (self._chat_ids(body) if kind == "chat.completion" else self._prompt_ids(body))
        if max_tokens is None:
            max_tokens = 16 if kind == "text_completion" else max(1, self.engine.length - len(ids))
        try:
            request = self.engine.submit(ids, max_tokens, temperature=temperature, top_p=top_p,
                                         top_k=None if top_k in (None, -1, 0) else top_k, seed=seed,
                                         stop=self.stop_ids)
        except InputError as e:
            raise OpenAIError(_one_line(e), param=limit_key if "fit" in str(e) else None) from None
        return request, len(ids), stops

    def _stops(self, stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(
                isinstance(s, str) and 0 < len(s) <= self.limits.chars for s in stops):
            raise OpenAIError("stop must be a string or up to 4 non-empty strings", param="stop")
        if stops and self.text is None:
            raise OpenAIError("stop strings need the model's tokenizer, which this artifact does not carry",
                              param="stop")
        return stops

    async def _chat_ids(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise OpenAIError("messages must be a non-empty list of {role, content} objects", param="messages")
        if len(messages) > self.limits.messages:
            raise OpenAIError(f"{len(messages):,} messages are more than the model's {self.limits.messages} "
                              "positions can hold", param="messages")
        if self.text is None:
            raise OpenAIError("this model was exported without a tokenizer: chat needs one")
        plain = [_plain_message(m) for m in messages]
        size = sum(len(m["role"]) + len(m["content"]) for m in plain)
        if size > self.limits.chars:
            raise OpenAIError(f"the messages hold {size:,} characters, more than the model's {self.engine.length} "
                              f"positions can hold (at most {self.limits.chars:,} are read)", 413, "messages")
        return await self._text("messages", self.text.chat(plain))

    async def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            if self.text is None:
                raise OpenAIError("this model was exported without a tokenizer: send prompt as token ids",
                                  param="prompt")
            if len(prompt) > self.limits.chars:
                raise OpenAIError(f"the prompt is {len(prompt):,} characters, more than the model's "
                                  f"{self.engine.length} positions can hold (at most {self.limits.chars:,} are read)",
                                  413, "prompt")
            return await self._text("prompt", self.text.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if len(prompt) > self.engine.length:
                raise OpenAIError(f"{len(prompt):,} prompt tokens do not fit the model's {self.engine.length} "
                                  "positions", param="prompt")
            return prompt
        raise OpenAIError("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")

    @staticmethod
    async def _text(param: str, work):
        from .textproc import TextError
        try:
            return await work
        except TextError as e:
            raise OpenAIError(str(e), param=param) from None

    async def _deltas(self, request, stops):
        """(text delta, finish reason or None) pairs; stop strings end the request early."""
        from .textproc import Detokenizer, TextError
        detok = Detokenizer(self.text) if self.text else None
        text, reason = "", None
        try:
            async for token in _stream(request):
                if detok is None:
                    yield f"<{token}>", None
                    continue
                delta = await detok.add(token)
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
                    tail = await detok.flush()
                    if tail:
                        yield tail, None
                reason = "length" if request.finish_reason == "length" else "stop"
        except TextError as e:
            raise OpenAIError(str(e), 500) from None
        except TteError as e:  # the engine failed this request's step
            raise OpenAIError(f"generation failed: {_one_line(e)}", 500) from None
        except Exception as e:  # noqa: BLE001 - a device step's failure, as the engine reports it
            raise OpenAIError(f"generation failed: {type(e).__name__}: {str(e)[:300]}", 500) from None
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
        except OpenAIError as e:  # mid-stream: the error object as the last event
            yield _sse(_error_object(e))
        finally:
            request.cancel()
        yield "data: [DONE]\n\n"


def _error_object(e: OpenAIError) -> dict:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": None}}


def _error_response(e: OpenAIError):
    from starlette.responses import JSONResponse
    return JSONResponse(_error_object(e), status_code=e.status)


def _one_line(e: TteError) -> str:
    return " ".join(line.strip() for line in e.user_message().splitlines())


def _plain_message(m: dict) -> dict:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text ones
        if not all(isinstance(p, dict) for p in content):
            raise OpenAIError("a message's content parts must be objects", param="messages")
        texts = [p.get("text") for p in content if p.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise OpenAIError("a text content part's text must be a string", param="messages")
        content = "".join(texts)
    if content is not None and not isinstance(content, str):
        raise OpenAIError("a message's content must be a string or a list of text parts", param="messages")
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


async def _json_body(raw, limit: int) -> dict:
    from ..untrusted import load_json
    data = await raw.body()
    if len(data) > limit:
        raise OpenAIError(f"the request body is {len(data):,} bytes, more than the {limit:,} this model's requests "
                          "can need", 413)
    body = load_json(data, "the request body", max_bytes=limit, error=OpenAIError)
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


# ---- what reaches the application ----------------------------------------------------------------

# (methods, path) the server answers; everything else KServe's application has (model repository
# load/unload, v1 predict/explain, docs) is not served
_V2_ROUTES = [("GET", r"/v2"), ("GET", r"/v2/health/(live|ready)"), ("GET", r"/v2/models"),
              ("GET", r"/v2/models/[^/]+"), ("GET", r"/v2/models/[^/]+/ready"), ("POST", r"/v2/models/[^/]+/infer"),
              ("GET", r"/metrics")]
_OPENAI_ROUTES = [("POST", r"/v1/(chat/)?completions"), ("GET", r"/v1/models"), ("GET", r"/v1/models/[^/]+")]


class RequestGuard:
    """An ASGI middleware in front of KServe's application, checking what every request is before it
    reaches a route: one of the served routes (404 otherwise: no model-repository, v1 or docs routes),
    a Host that names this server (421: DNS rebinding), no browser Origin but the ones ``--allow-origin``
    names (403), a JSON body on POST (415; a v2 request with no content type is JSON, as tritonclient
    sends it, and binary tensors come with their header length), and a body no larger than ``limits``
    allows (413), read whole before the route sees it. Allowed origins get CORS headers."""

    def __init__(self, app, *, bound: str, openai: bool, body_limit: int, allow_origins=()):
        import re
        self.app, self.bound, self.body_limit, self.origins = app, bound, body_limit, tuple(allow_origins)
        routes = _V2_ROUTES + (_OPENAI_ROUTES if openai else [])
        self.routes = [(m, re.compile(p + "/?")) for m, p in routes]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from ..httpcheck import host_allowed, origin_allowed
        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        method, path = scope["method"], scope["path"]
        origin = headers.get("origin")
        if not host_allowed(self.bound, headers.get("host")):
            return await _plain(send, 421, f"this server does not answer for host {headers.get('host', '')!r}")
        if not origin_allowed(origin, self.origins):
            return await _plain(send, 403, f"cross-site requests from {origin!r} are refused "
                                           "(start the server with --allow-origin ORIGIN to allow a web app)")
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")] if origin else []
        allowed = {m for m, rx in self.routes if rx.fullmatch(path)}
        if method == "OPTIONS" and origin and allowed:  # a preflight of an allowed origin
            return await _plain(send, 204, "", cors + [
                (b"access-control-allow-methods", ", ".join(sorted(allowed)).encode()),
                (b"access-control-allow-headers", b"content-type, authorization"),
                (b"access-control-max-age", b"600")])
        if not allowed:
            return await _plain(send, 404, f"no route {path!r} on this server")
        if method not in allowed and not (method == "HEAD" and "GET" in allowed):
            return await _plain(send, 405, f"{path} takes {', '.join(sorted(allowed))}, not {method}")
        if method == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            v2 = path.startswith("/v2/")
            if not ctype and v2 and "inference-header-content-length" not in headers:
                scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
            elif ctype != "application/json" and not (v2 and ctype in ("", "application/octet-stream")
                                                     and "inference-header-content-length" in headers):
                return await _plain(send, 415, "send the request body as JSON (Content-Type: application/json)")
            body = await _read_body(receive, headers.get("content-length"), self.body_limit)
            if body is None:
                return await _plain(send, 413, f"the request body is over {self.body_limit:,} bytes, more than "
                                               "this model's requests can need")
            receive = _replay(body, receive)
        if cors:
            send = _with_headers(send, cors)
        return await self.app(scope, receive, send)


async def _read_body(receive, length: str | None, limit: int) -> bytes | None:
    """The whole request body, or None once it is past ``limit`` (its declared length or what came)."""
    if length is not None and (not length.isdigit() or int(length) > limit):
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """``receive`` for the application: the body read already, then the connection's own messages (a
    streaming response waits on them to see the client go)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _with_headers(send, extra):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", []), *extra])
        await send(message)
    return wrapped


async def _plain(send, status: int, message: str, headers=()) -> None:
    body = json.dumps({"error": message}).encode() if status != 204 else b""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


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


# ---- the server ----------------------------------------------------------------------------------

class Served:
    """What one served file is: its program, and for an LLM the engine and text workers."""

    def __init__(self, path: str, name: str | None = None, *, batched: bool = True, text_workers: int = 2,
                 text_budget: float = 10.0):
        from ..api import load
        self.path = os.fspath(path)
        self.name = name or os.path.splitext(os.path.basename(self.path))[0]
        if not self.name or len(self.name) > 128 or not all(c.isalnum() or c in "-_." for c in self.name):
            raise InputError(f"model name {self.name!r}: use up to 128 letters, digits, '-', '_' and '.'",
                             hint="pass --name")
        self.program = load(self.path)
        manifest = getattr(self.program, "manifest", None) or {}
        self.llm = manifest.get("llm") if isinstance(manifest, dict) else None
        self.engine = self.text = self.model = None
        self.stop_ids: tuple = ()
        if self.llm is not None:
            from ..engine import Engine
            self.engine = Engine(self.program, batched=batched)
            self.limits = Limits.for_cache(self.engine.length)
            self.stop_ids = tuple(self.llm.get("stop_ids", ()))
            special = [i for i in (*self.stop_ids, self.llm.get("bos_id"), self.llm.get("pad_id")) if i is not None]
            if any(i >= self.engine.vocab for i in special):
                from ..errors import ArtifactError
                raise ArtifactError(f"{self.path}: its special token ids {special} are not all below the model's "
                                    f"vocabulary of {self.engine.vocab}")
            tok = self.llm.get("tokenizer")
            if tok:
                from .textproc import TextWorkers
                self.text = TextWorkers(self.program.artifact.extras[tok], template=self.llm.get("chat_template"),
                                        bos_id=self.llm.get("bos_id"),
                                        eos_id=self.stop_ids[0] if self.stop_ids else None,
                                        max_chars=self.limits.chars, workers=text_workers, time_budget=text_budget)
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
        if self.engine is not None:
            self.engine.stop()
        if self.text is not None:
            self.text.close()


def serve(path, *, name: str | None = None, host: str = "127.0.0.1", port: int = 8080,
          batched: bool = True, allow_origins=(), text_budget: float = 10.0) -> None:
    """Serves one artifact until interrupted (SIGINT/SIGTERM). Under several processes (jax.distributed,
    a sharded LLM program) process 0 serves HTTP and the others run the steps its engine schedules,
    until it stops."""
    kserve = _import_kserve()
    from kserve.model_server import ModelServer, app
    from kserve.protocol.rest.server import RESTServer
    served = Served(path, name, batched=batched, text_budget=text_budget)
    try:
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
            OpenAIServer(served.name, served.engine, served.text, served.stop_ids, served.limits).mount(app)
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
        asyncio.run(server._serve())
    finally:
        served.close()


HELP = "serve an artifact over HTTP (Open Inference Protocol v2; OpenAI completions for LLMs) on KServe"


def add_arguments(p) -> None:
    p.add_argument("model", nargs="?", help="a .tpu or .tflite file")
    p.add_argument("--name", default=None, help="the served model's name (default: the file's stem)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080, KServe's)")
    p.add_argument("--one-slot", action="store_true",
                   help="LLMs: decode one request at a time (the decode program) even where decode_batch exists")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN (e.g. https://app.example.com; '*' for any) call the server "
                        "(CORS); without it, requests a browser marks cross-site are refused")
    p.add_argument("--text-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="LLMs: the longest one tokenizing, chat-template or detokenizing step may take (default 10)")
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
    if not 0 < args.text_timeout <= 3600:
        raise InputError(f"--text-timeout must be from 0 to 3600 seconds, got {args.text_timeout}")
    for origin in args.allow_origin:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise InputError(f"--allow-origin {origin!r}: give an origin such as https://app.example.com, or '*'")
    given = [args.coordinator, args.num_processes, args.process_id, args.token_file]
    if not args.distributed and any(v is not None for v in given):
        raise InputError("--coordinator, --num-processes, --process-id and --token-file go with --distributed")
    if args.distributed:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, token_file=args.token_file)
    serve(args.model, name=args.name, host=args.host, port=args.port, batched=not args.one_slot,
          allow_origins=args.allow_origin, text_budget=args.text_timeout)
    return 0
