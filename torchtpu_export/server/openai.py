"""OpenAI's routes over the continuous-batching engine: ``/v1/completions``, ``/v1/chat/completions``
(streamed as server-sent events with ``"stream": true``, usage with ``stream_options.include_usage``) and
``/v1/models``, mounted on KServe's FastAPI application. KServe's own OpenAI layer is built on vLLM's
request types (it imports vLLM, a GPU engine); these routes are this package's. Every field is checked
before a request is queued, so a bad request gets a 4xx with OpenAI's error object and never touches
other requests; stop strings end a request early; a client that goes away mid-stream frees its slot at
the next engine step."""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid

from ..engine.request import MAX_LOGIT_BIAS, TOP_LOGPROBS
from ..errors import InputError, TteError
from .common import Limits, one_line, stream_tokens

MAX_CHOICES = 16  # n and best_of
MAX_TOOLS = 64
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# a tool call as Qwen's and Hermes' templates ask the model to write it: <tool_call>{json}</tool_call>
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key


@dataclasses.dataclass
class _Job:
    """What one API request became: its choices' engine requests (``best_of`` of them, ``n`` shown), the
    prompt's length, stop strings, the alternatives each token's logprobs show (None: no logprobs), and
    the tools a reply may call (None: its text is not read for tool calls)."""
    kind: str
    requests: list
    n: int
    prompt_len: int
    stops: list
    logprobs: int | None
    tools: list | None
    token_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"

    def cancel(self) -> None:
        for r in self.requests:
            r.cancel()

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

    def __init__(self, name: str, engine, text=None, stop_ids=(), limits: Limits | None = None,
                 tokenizer_json: str | None = None, image_budget: float = 10.0):
        self.name, self.engine, self.text, self.stop_ids = name, engine, text, tuple(stop_ids)
        self.tokenizer_json, self.grammars = tokenizer_json, None  # structured outputs: llguidance's grammars
        self._grammars_made = None  # a lock, made on the event loop
        self.images = None  # a VLM's image workers
        if getattr(engine, "vision", None) is not None:
            from ..images import ImageWorkers
            self.images = ImageWorkers(time_budget=image_budget)
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
                    job = await self._submit(kind, body)
                    if body.get("stream"):
                        options = body.get("stream_options")
                        usage = isinstance(options, dict) and bool(options.get("include_usage"))
                        return StreamingResponse(self._events(job, usage), media_type="text/event-stream")
                    return JSONResponse(await self._complete(job))
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

    def close(self) -> None:
        """Ends the grammar and image workers (the text workers are the served file's)."""
        for pool in (self.grammars, self.images):
            if pool is not None:
                pool.close()

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "torchtpu-export",
                "max_model_len": self.engine.length}

    async def _submit(self, kind: str, body: dict) -> "_Job":
        """Checks every field, then tokenizes (in a text worker), compiles a response format (in a thread)
        and queues the request's choices."""
        model = body.get("model")
        if model is not None and model != self.name:
            raise OpenAIError(f"no model {model!r}; this server serves {self.name!r}", 404, "model")
        for unsupported in ("echo", "suffix"):
            if body.get(unsupported):
                raise OpenAIError(f"{unsupported} is not supported by this server", param=unsupported)
        chat = kind == "chat.completion"
        stream = _field(body, "stream", bool, False, None, "true or false")
        n = _field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer from 1 to {MAX_CHOICES}")
        best_of = _field(body, "best_of", int, n, lambda v: n <= v <= MAX_CHOICES,
                         f"an integer from n to {MAX_CHOICES}")
        if stream and best_of > n:
            raise OpenAIError("best_of above n cannot be streamed (the best choices are known at the end)",
                              param="best_of")
        limit_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _field(body, limit_key, int, None, lambda v: v >= 1, "a positive integer")
        params = self._sampling(body, chat)
        if best_of > n and params["logprobs"] is None:
            params["logprobs"] = 0  # the best choices are those of the highest log-probability
        shown = self._logprobs_shown(body, chat)
        tools, tool_choice = _tools(body) if chat else (None, "none")
        format_ = _response_format(body, tools, tool_choice)
        stops = self._stops(body.get("stop"))
        found: list = []  # a chat's image_url parts, in order
        ids = await (self._chat_ids(body, tools if tool_choice != "none" else None, found) if chat
                     else self._prompt_ids(body))
        images = await self._images(found) if found else None
        if max_tokens is None:
            max_tokens = 16 if not chat else max(1, self.engine.length - len(ids))
        constraints = None
        if format_ is not None:
            constraints = await self._matchers(format_, best_of)
        try:
            requests = self.engine.submit_many(ids, best_of, max_tokens, constraints=constraints, images=images,
                                               **params)
        except InputError as e:
            param = "messages" if "image" in str(e) else limit_key if "fit" in str(e) else None
            raise OpenAIError(one_line(e), param=param) from None
        as_ids = _field(body, "return_tokens_as_token_ids", bool, False, None, "true or false")
        return _Job(kind, requests, n, len(ids), stops, shown, tools if tool_choice != "none" else None, as_ids)

    def _sampling(self, body: dict, chat: bool) -> dict:
        """The engine's sampling parameters from the request's fields (OpenAI's names, and vLLM's extra
        ones: ``top_k``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``)."""
        number = (int, float)
        temperature = float(_field(body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "from 0 to 2"))
        top_p = _field(body, "top_p", number, None, lambda v: 0 < v <= 1, "in (0, 1]")
        top_k = _field(body, "top_k", int, None, lambda v: v >= -1, "a positive integer, or -1 for all")
        seed = _field(body, "seed", int, None, lambda v: 0 <= v < 2 ** 64, "an integer from 0 to 2^64 - 1")
        presence = float(_field(body, "presence_penalty", number, 0.0, lambda v: -2 <= v <= 2, "from -2 to 2"))
        frequency = float(_field(body, "frequency_penalty", number, 0.0, lambda v: -2 <= v <= 2, "from -2 to 2"))
        repetition = float(_field(body, "repetition_penalty", number, 1.0, lambda v: 0 < v <= 10,
                                  "above 0 and at most 10"))
        min_tokens = _field(body, "min_tokens", int, 0, lambda v: v >= 0, "a non-negative integer")
        stop_ids = _field(body, "stop_token_ids", list, [], lambda v: len(v) <= 64 and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.engine.vocab for t in v),
            f"a list of at most 64 token ids below {self.engine.vocab}")
        bias = _field(body, "logit_bias", dict, {}, None, "an object of token ids to biases")
        logit_bias = []
        for key, value in bias.items():
            if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key) and int(key) < self.engine.vocab) \
                    or isinstance(value, bool) \
                    or not isinstance(value, number) or not -100 <= value <= 100 or len(bias) > MAX_LOGIT_BIAS:
                raise OpenAIError(f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids (below {self.engine.vocab}) to "
                                  "biases from -100 to 100", param="logit_bias")
            logit_bias.append((int(key), float(value)))
        return dict(temperature=temperature, top_p=top_p, top_k=None if top_k in (None, -1, 0) else top_k, seed=seed,
                    stop=tuple(dict.fromkeys((*self.stop_ids, *stop_ids))), presence_penalty=presence,
                    frequency_penalty=frequency, repetition_penalty=repetition, min_tokens=min_tokens,
                    logit_bias=tuple(logit_bias), logprobs=self._logprobs_shown(body, chat))

    @staticmethod
    def _logprobs_shown(body: dict, chat: bool) -> int | None:
        """How many alternatives per token the reply reports (None: no logprobs): chat's ``logprobs: true``
        with ``top_logprobs``, completions' ``logprobs: N``."""
        if chat:
            want = _field(body, "logprobs", bool, False, None, "true or false")
            top = _field(body, "top_logprobs", int, None, lambda v: 0 <= v <= TOP_LOGPROBS,
                         f"an integer from 0 to {TOP_LOGPROBS}")
            if top is not None and not want:
                raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
            return (top or 0) if want else None
        return _field(body, "logprobs", int, None, lambda v: 0 <= v <= TOP_LOGPROBS,
                      f"an integer from 0 to {TOP_LOGPROBS}")

    async def _matchers(self, format_: tuple, count: int) -> list:
        """A grammar matcher per choice for ``format_`` (kind, value): checked in the grammar worker, then
        compiled here off the event loop (its cost now bounded by the worker's limits)."""
        import asyncio
        if self.tokenizer_json is None:
            raise OpenAIError("structured outputs need the model's tokenizer, which this artifact does not carry",
                              param="response_format")
        try:
            if self.grammars is None:  # its tokenizer loaded and its worker started off the event loop, once
                from ..llm.grammar import Grammars
                self._grammars_made = self._grammars_made or asyncio.Lock()
                async with self._grammars_made:
                    if self.grammars is None:
                        self.grammars = await asyncio.get_running_loop().run_in_executor(
                            None, Grammars, self.tokenizer_json, self.engine.vocab, self.stop_ids)
            text = await self.grammars.compile_async(*format_)

            def make():
                from ..llm.grammar import Matcher
                first = Matcher(self.grammars, text)
                return [first] + [first.copy() for _ in range(count - 1)]
            return await asyncio.get_running_loop().run_in_executor(None, make)
        except InputError as e:
            raise OpenAIError(one_line(e), param="response_format") from None

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

    async def _images(self, found: list) -> list:
        """The images of a chat's ``image_url`` parts (data URLs), decoded and resized as the model's image
        processor does, in the image workers (``images.ImageWorkers``: bounded in bytes, pixels and seconds,
        apart from the text work); one bad image is a 400 naming its part."""
        from ..images import MAX_IMAGES, data_url_bytes
        if len(found) > MAX_IMAGES:  # before any data URL is decoded
            raise OpenAIError(f"{len(found)} images are more than the {MAX_IMAGES} a request may hold",
                              param="messages")
        try:
            items = [(data_url_bytes(url, where), where) for where, url in found]
            return await self.images.read(items, self.engine.vision)
        except InputError as e:
            raise OpenAIError(one_line(e), param="messages") from None

    async def _chat_ids(self, body: dict, tools: list | None = None, found: list | None = None) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise OpenAIError("messages must be a non-empty list of {role, content} objects", param="messages")
        if len(messages) > self.limits.messages:
            raise OpenAIError(f"{len(messages):,} messages are more than the model's {self.limits.messages} "
                              "positions can hold", param="messages")
        if self.text is None:
            raise OpenAIError("this model was exported without a tokenizer: chat needs one")
        vision = getattr(self.engine, "vision", None) is not None
        plain = [_plain_message(m, found if vision else None, f"messages[{i}]") for i, m in enumerate(messages)]
        text = json.dumps(plain, ensure_ascii=False) + (json.dumps(tools, ensure_ascii=False) if tools else "")
        _check_text(text, "messages")
        size = len(text)
        if size > self.limits.chars:
            raise OpenAIError(f"the messages hold {size:,} characters, more than the model's {self.engine.length} "
                              f"positions can hold (at most {self.limits.chars:,} are read)", 413, "messages")
        return await self._text("messages", self.text.chat(plain, tools))

    async def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            if self.text is None:
                raise OpenAIError("this model was exported without a tokenizer: send prompt as token ids",
                                  param="prompt")
            _check_text(prompt, "prompt")
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
        """(text delta, finish reason or None, tokens read so far) triples; stop strings end the request early."""
        from ..llm.textproc import Detokenizer, TextError
        detok = Detokenizer(self.text) if self.text else None
        text, reason, used = "", None, 0
        try:
            async for token in stream_tokens(request):
                used += 1
                if detok is None:
                    yield f"<{token}>", None, used
                    continue
                delta = await detok.add(token)
                if stops and delta:
                    cut = _earliest(text + delta, stops, len(text))
                    if cut is not None:
                        yield (text + delta)[len(text):cut], None, used
                        reason = "stop"
                        request.cancel()
                        break
                text += delta
                if delta:
                    yield delta, None, used
            if reason is None:
                if detok is not None:
                    tail = await detok.flush()
                    if tail:
                        yield tail, None, used
                reason = "length" if request.finish_reason == "length" else "stop"
        except TextError as e:
            raise OpenAIError(str(e), 500) from None
        except InputError as e:  # what the request asked cannot go on (its format has no next token)
            raise OpenAIError(f"generation stopped: {one_line(e)}", 400) from None
        except TteError as e:  # the engine failed this request's step
            raise OpenAIError(f"generation failed: {one_line(e)}", 500) from None
        except Exception as e:  # noqa: BLE001 - a device step's failure, as the engine reports it
            raise OpenAIError(f"generation failed: {type(e).__name__}: {str(e)[:300]}", 500) from None
        yield "", reason, used

    async def _collect(self, request, stops):
        text, reason, used = "", None, 0
        async for delta, finish, used in self._deltas(request, stops):
            text += delta
            reason = finish or reason
        return text, reason, used

    async def _complete(self, job: _Job) -> dict:
        import asyncio
        try:
            results = await asyncio.gather(*(self._collect(r, job.stops) for r in job.requests))
        finally:
            job.cancel()
        order = list(range(len(job.requests)))
        if len(order) > job.n:  # best_of: the choices of the highest total log-probability
            order.sort(key=lambda i: -sum(lp for lp, _ in job.requests[i].logprobs[:results[i][2]]))
        choices = []
        for index, i in enumerate(order[:job.n]):
            text, reason, used = results[i]
            logprobs = await self._logprobs(job, job.requests[i], 0, used, 0) if job.logprobs is not None else None
            choices.append(await self._choice(job, index, text, reason, logprobs))
        return {"id": _id(job.kind), "object": job.kind, "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": _usage(job)}

    async def _choice(self, job: _Job, index: int, text: str, reason, logprobs) -> dict:
        if job.kind == "text_completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        message = {"role": "assistant", "content": text}
        if job.tools:
            calls, content = await _tool_calls_of(text, job.tools)
            if calls:
                message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    async def _logprobs(self, job: _Job, request, start: int, end: int, offset: int):
        """The logprobs of tokens ``start:end`` of a choice in OpenAI's form (chat: ``content`` entries with
        ``top_logprobs``; completions: tokens, token_logprobs, top_logprobs, text_offset from ``offset``)."""
        tokens, entries = request.tokens[start:end], request.logprobs[start:end]
        ids = list(dict.fromkeys(list(tokens) + [t for _, top in entries for t, _ in top]))
        if job.token_ids:
            pieces = [[f"token_id:{t}", f"token_id:{t}", list(f"token_id:{t}".encode())] for t in ids]
        elif self.text is not None and ids:
            pieces = await self._text("logprobs", self.text.pieces(ids))
        else:
            pieces = [[f"<{t}>", f"<{t}>", list(f"<{t}>".encode())] for t in ids]
        name = _token_names(ids, pieces)
        text = {t: p[0] for t, p in zip(ids, pieces)}
        raw = {t: p[2] for t, p in zip(ids, pieces)}
        if job.kind == "text_completion":
            offsets, at = [], offset
            for t in tokens:
                offsets.append(at)
                at += len(text[t])
            return {"tokens": [name[t] for t in tokens], "token_logprobs": [lp for lp, _ in entries],
                    "top_logprobs": [{name[a]: v for a, v in top} for _, top in entries] if job.logprobs else None,
                    "text_offset": offsets}
        return {"content": [{"token": name[t], "logprob": lp, "bytes": raw[t],
                             "top_logprobs": [{"token": name[a], "logprob": v, "bytes": raw[a]}
                                              for a, v in top[:job.logprobs]]}
                            for t, (lp, top) in zip(tokens, entries)]}

    async def _events(self, job: _Job, include_usage: bool):
        """Server-sent events: each choice's deltas as they come (several choices interleaved, each chunk
        naming its index). With tools, a choice's text is read whole at its end, then sent as its content
        or its tool calls."""
        import asyncio
        kind = job.kind
        obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        rid, created = _id(kind), int(time.time())
        queue: asyncio.Queue = asyncio.Queue()

        async def run(index: int, request):
            try:
                async for item in self._deltas(request, job.stops):
                    await queue.put((index, item))
            except OpenAIError as e:
                await queue.put((index, e))
            await queue.put((index, None))

        def chunk(index, delta_text, reason, first, logprobs=None, calls=None):
            if kind == "text_completion":
                choice = {"index": index, "text": delta_text, "logprobs": logprobs, "finish_reason": reason}
            else:
                delta = {"role": "assistant"} if first else {}
                if delta_text or (first and not calls):
                    delta["content"] = delta_text
                if calls:
                    delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(calls)]
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return _sse({"id": rid, "object": obj, "created": created, "model": self.name, "choices": [choice]})

        tasks = [asyncio.get_running_loop().create_task(run(i, r)) for i, r in enumerate(job.requests)]
        try:
            first = [True] * len(tasks)
            seen, text, offsets = [0] * len(tasks), [""] * len(tasks), [0] * len(tasks)
            left = len(tasks)
            while left:
                index, item = await queue.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, OpenAIError):
                    raise item
                delta, reason, used = item
                if job.tools:  # read whole at the end: a tool call is not text to stream
                    text[index] += delta
                    if reason is None:
                        continue
                    calls, content = await _tool_calls_of(text[index], job.tools)
                    if calls:
                        reason = "tool_calls"
                    yield chunk(index, content or "", reason, first[index], calls=calls or None)
                    first[index] = False
                    continue
                if not (delta or reason or first[index]):
                    continue
                logprobs = None
                if job.logprobs is not None and used > seen[index]:
                    logprobs = await self._logprobs(job, job.requests[index], seen[index], used, offsets[index])
                    seen[index] = used
                offsets[index] += len(delta)
                yield chunk(index, delta, reason, first[index], logprobs)
                first[index] = False
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.name, "choices": [],
                            "usage": _usage(job)})
        except OpenAIError as e:  # mid-stream: the error object as the last event
            yield _sse(_error_object(e))
        finally:
            job.cancel()
            for t in tasks:
                t.cancel()
        yield "data: [DONE]\n\n"


def _tools(body: dict):
    """The request's ``tools`` (functions, as chat templates take them) and ``tool_choice``: "none",
    "auto", "required" or a function's name."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        return None, "none"
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and _TOOL_NAME.fullmatch(t["function"]["name"])
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise OpenAIError(f"tools must be a list of 1 to {MAX_TOOLS} {{type: function, function: {{name, "
                          "description, parameters}}}} (names of letters, digits, _ . -)", param="tools")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return tools, "auto"
    if choice in ("none", "auto", "required"):
        return tools, choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in names:
        return tools, choice["function"]["name"]
    raise OpenAIError("tool_choice must be none, auto, required or {type: function, function: {name}} naming one "
                      "of the tools", param="tool_choice")


def _response_format(body: dict, tools, tool_choice: str):
    """The reply's grammar as (kind, value) for llguidance (``llm.grammar``), or None: ``response_format``
    (json_schema, json_object), vLLM's ``guided_json``, ``guided_regex``, ``guided_choice`` and
    ``guided_grammar``, or a tool call that ``tool_choice`` requires. At most one of them."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise OpenAIError("response_format must be {type: text}, {type: json_object} or {type: json_schema, "
                              "json_schema: {name, schema}}", param="response_format")
        if fmt["type"] == "json_object":
            found.append(("json_object", None))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise OpenAIError("response_format json_schema needs {name, schema: {...}}", param="response_format")
            from ..llm.grammar import check_strict
            try:
                check_strict(spec)
            except InputError as e:
                raise OpenAIError(str(e), param="response_format") from None
            found.append(("json_schema", spec.get("schema", {})))
    for key, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            value = body[key]
            if kind == "json_schema" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise OpenAIError(f"{key} must be a JSON schema", param=key) from None
            found.append((kind, value))
    if found and tool_choice != "none":
        raise OpenAIError(f"tools with tool_choice {tool_choice!r} and a response format (response_format, guided_*) "
                          "conflict: a reply cannot be both a tool call and the format's text; pass tool_choice "
                          "'none' to constrain a reply to the format", param="tool_choice")
    if tool_choice not in ("none", "auto"):
        found.append(("grammar", _tool_grammar(tools, tool_choice)))
    if len(found) > 1:
        raise OpenAIError("give one of response_format, guided_json, guided_regex, guided_choice, guided_grammar "
                          "and a required tool call", param="response_format")
    return found[0] if found else None


def _tool_grammar(tools: list, choice: str) -> str:
    """A Lark grammar for one tool call in Qwen's and Hermes' form, ``<tool_call>`` then a JSON object of
    a function's name and arguments (its parameters' schema), then ``</tool_call>``."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools if choice == "required" or t["function"]["name"] == choice]
    schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls}, **{"x-guidance": {"whitespace_flexible": False}})
    return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'


def _tool_calls(text: str, names) -> tuple[list, str | None]:
    """The calls of declared tools (``names``) in a reply (Qwen's and Hermes' ``<tool_call>{json}</tool_call>``),
    and the text around them (None when there is none). Linear in the reply: each block is found with two
    ``find`` (a run of blanks with no closing tag is read once, where a regular expression backtracks over
    it); a block that is not a call of a declared tool (not JSON, nested past the JSON bounds, another
    name) stays in the text."""
    from ..untrusted import load_json
    calls, kept, at = [], [], 0
    while True:
        start = text.find(TOOL_CALL_OPEN, at)
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN)) if start >= 0 else -1
        if end < 0:
            break
        try:
            obj = load_json(text[start + len(TOOL_CALL_OPEN):end].strip(), "a tool call", error=ValueError)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and obj.get("name") in names:
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": obj["name"], "arguments": json.dumps(args)}})
            kept.append(text[at:start])
        else:
            kept.append(text[at:end + len(TOOL_CALL_CLOSE)])
        at = end + len(TOOL_CALL_CLOSE)
    if not calls:
        return [], text
    return calls, ("".join(kept) + text[at:]).strip() or None


async def _tool_calls_of(text: str, tools: list) -> tuple[list, str | None]:
    """:func:`_tool_calls` off the event loop (a reply may be long)."""
    import asyncio
    names = {t["function"]["name"] for t in tools}
    return await asyncio.get_running_loop().run_in_executor(None, _tool_calls, text, names)


def _token_names(ids: list, pieces: list) -> dict:
    """Each token's name in logprobs: its text, unless another token of the reply has the same text (byte
    tokens of a partial character all read "\ufffd"; completions' ``top_logprobs`` keys them by name): then
    its vocabulary entry (``<0xE2>``, ``âĢ``), and failing that its id."""
    count: dict = {}
    for text, _, _ in pieces:
        count[text] = count.get(text, 0) + 1
    name = {t: (text if count[text] == 1 else entry) for t, (text, entry, _) in zip(ids, pieces)}
    seen: dict = {}
    for t in ids:
        seen[name[t]] = seen.get(name[t], 0) + 1
    return {t: (n if seen[n] == 1 else f"token_id:{t}") for t, n in name.items()}


def _check_text(text: str, param: str) -> None:
    """Text a tokenizer takes: JSON's \\ud800-\\udfff escapes outside a pair decode to no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(f"{param} holds a lone UTF-16 surrogate (a \\udXXX escape outside a pair): not text",
                          param=param) from None


def _error_object(e: OpenAIError) -> dict:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": None}}


def _error_response(e: OpenAIError):
    from starlette.responses import JSONResponse
    return JSONResponse(_error_object(e), status_code=e.status)


def _plain_message(m: dict, images: list | None = None, where: str = "messages") -> dict:
    """A chat message as templates take it: role, content as a string (the text parts of a list), and
    for tool use the assistant's ``tool_calls`` (arguments as objects, as HF templates read them) and a
    tool message's ``tool_call_id`` and ``name``. With ``images`` (a vision-language model's server), a
    list's parts stay a list (``{"type": "text", "text"}``, ``{"type": "image"}``, as VLM templates take
    them), each ``image_url`` part's ``(where, url)`` appended to ``images``."""
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts
        if not all(isinstance(p, dict) for p in content):
            raise OpenAIError("a message's content parts must be objects", param="messages")
        texts = [p.get("text") for p in content if p.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise OpenAIError("a text content part's text must be a string", param="messages")
        pictures = [p for p in content if p.get("type") == "image_url"]
        if pictures and images is None:
            raise OpenAIError("this model takes no images (it is not a vision-language model)", param="messages")
        if images is None:
            content = "".join(texts)
        else:
            parts = []
            for k, p in enumerate(content):
                if p.get("type") == "text":
                    parts.append({"type": "text", "text": p["text"]})
                elif p.get("type") == "image_url":
                    url = p.get("image_url")
                    images.append((f"{where}.content[{k}]", url.get("url") if isinstance(url, dict) else url))
                    parts.append({"type": "image"})
            content = parts
    if content is not None and not isinstance(content, (str, list)):
        raise OpenAIError("a message's content must be a string or a list of content parts", param="messages")
    out = {"role": m["role"], "content": content or ""}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  and isinstance(c["function"].get("name"), str) for c in calls):
            raise OpenAIError("tool_calls must be a list of {id, type, function: {name, arguments}}",
                              param="messages")
        out["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get("arguments"))}} for c in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def _arguments(value):
    """A tool call's arguments as an object (OpenAI sends them as JSON text)."""
    if isinstance(value, str):
        from ..untrusted import load_json
        try:
            value = load_json(value, "a tool call's arguments", error=ValueError)
        except ValueError as e:
            raise OpenAIError(f"{e}: a tool call's arguments must be JSON text", param="messages") from None
    return value if isinstance(value, dict) else {}


def _earliest(text: str, stops, after: int):
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _usage(job: _Job) -> dict:
    made = sum(len(r.tokens) for r in job.requests)  # every choice's tokens (best_of's too), as OpenAI counts
    return {"prompt_tokens": job.prompt_len, "completion_tokens": made, "total_tokens": job.prompt_len + made}


def _id(kind: str) -> str:
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
