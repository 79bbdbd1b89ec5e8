"""OpenAI's routes over the continuous-batching engine: ``/v1/completions``, ``/v1/chat/completions``
(streamed as server-sent events with ``"stream": true``, usage with ``stream_options.include_usage``) and
``/v1/models``, mounted on KServe's FastAPI application. KServe's own OpenAI layer is built on vLLM's
request types (it imports vLLM, a GPU engine); these routes are this package's. Every field is checked
before a request is queued, so a bad request gets a 4xx with OpenAI's error object and never touches
other requests; stop strings end a request early; a client that goes away mid-stream frees its slot at
the next engine step."""
from __future__ import annotations

import json
import time
import uuid

from ..errors import InputError, TteError
from .common import Limits, one_line, stream_tokens

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
            raise OpenAIError(one_line(e), param=limit_key if "fit" in str(e) else None) from None
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
        from ..llm.textproc import TextError
        try:
            return await work
        except TextError as e:
            raise OpenAIError(str(e), param=param) from None

    async def _deltas(self, request, stops):
        """(text delta, finish reason or None) pairs; stop strings end the request early."""
        from ..llm.textproc import Detokenizer, TextError
        detok = Detokenizer(self.text) if self.text else None
        text, reason = "", None
        try:
            async for token in stream_tokens(request):
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
            raise OpenAIError(f"generation failed: {one_line(e)}", 500) from None
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
