"""The OpenAI routes on KServe's FastAPI application, and what a request goes through between its body and
the engine: its fields checked, its prompt tokenized (and its images read), its response format compiled,
its choices queued, then its replies collected or streamed."""
from __future__ import annotations

import json
import time

from ...engine.request import SamplingParams
from ...errors import InputError
from ..common import Limits, one_line
from .logprobs import logprobs_of
from .protocol import (MAX_CHOICES, Job, OpenAIError, check_text, error_response, field, json_body, logprobs_shown,
                       plain_message, reply_id, response_format, sampling_params, stop_strings, text_work, usage)
from .streaming import collect, events
from .tools import requested_tools, tool_calls_of, tool_grammar


class OpenAIServer:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over a served file's
    :class:`~torchtpu_export.engine.session.LlmSession`. Text work (tokenizing, the chat template,
    detokenizing) runs in its text workers' processes, never on the event loop."""

    def __init__(self, name: str, session, limits: Limits | None = None, image_budget: float = 10.0):
        self.name, self.session = name, session
        engine = self.engine = session.engine
        self.text, self.stop_ids = session.text, session.stop_ids
        self.grammars = None  # structured outputs: llguidance's grammars (the session's), once made
        self.images = None  # a VLM's image workers
        if engine.vision is not None:
            from ...images import ImageWorkers
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
                    body = await json_body(raw, self.limits.body)
                    job = await self._submit(kind, body)
                    if body.get("stream"):
                        options = body.get("stream_options")
                        usage_ = isinstance(options, dict) and bool(options.get("include_usage"))
                        return StreamingResponse(events(job, self.name, self.text, usage_),
                                                 media_type="text/event-stream")
                    return JSONResponse(await self._complete(job))
                except OpenAIError as e:
                    return error_response(e)
            return handle

        async def models(raw):
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        async def model(raw):
            if raw.path_params["model_name"] != self.name:
                return error_response(OpenAIError(f"no model {raw.path_params['model_name']!r}", 404, "model"))
            return JSONResponse(self._model_card())

        app.add_route("/v1/completions", handler("text_completion"), methods=["POST"])
        app.add_route("/v1/chat/completions", handler("chat.completion"), methods=["POST"])
        app.add_route("/v1/models", models, methods=["GET"])
        app.add_route("/v1/models/{model_name}", model, methods=["GET"])

    def close(self) -> None:
        """Ends the image workers (the text and grammar workers are the session's)."""
        if self.images is not None:
            self.images.close()

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "torchtpu-export",
                "max_model_len": self.engine.length}

    async def _submit(self, kind: str, body: dict) -> Job:
        """Checks every field, then tokenizes (in a text worker), compiles a response format (in a thread)
        and queues the request's choices."""
        model = body.get("model")
        if model is not None and model != self.name:
            raise OpenAIError(f"no model {model!r}; this server serves {self.name!r}", 404, "model")
        for unsupported in ("echo", "suffix"):
            if body.get(unsupported):
                raise OpenAIError(f"{unsupported} is not supported by this server", param=unsupported)
        chat = kind == "chat.completion"
        stream = field(body, "stream", bool, False, None, "true or false")
        n = field(body, "n", int, 1, lambda v: 1 <= v <= MAX_CHOICES, f"an integer from 1 to {MAX_CHOICES}")
        best_of = field(body, "best_of", int, n, lambda v: n <= v <= MAX_CHOICES,
                        f"an integer from n to {MAX_CHOICES}")
        if stream and best_of > n:
            raise OpenAIError("best_of above n cannot be streamed (the best choices are known at the end)",
                              param="best_of")
        limit_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = field(body, limit_key, int, None, lambda v: v >= 1, "a positive integer")
        params = sampling_params(body, chat, self.engine.vocab, self.stop_ids)
        if best_of > n and params["logprobs"] is None:
            params["logprobs"] = 0  # the best choices are those of the highest log-probability
        shown = logprobs_shown(body, chat)
        tools, tool_choice = requested_tools(body) if chat else (None, "none")
        required = tool_grammar(tools, tool_choice) if tool_choice not in ("none", "auto") else None
        format_ = response_format(body, tool_choice, required)
        stops = stop_strings(body.get("stop"), self.limits.chars, self.text is not None)
        found: list = []  # a chat's image_url parts, in order
        ids = await (self._chat_ids(body, tools if tool_choice != "none" else None, found) if chat
                     else self._prompt_ids(body))
        images = await self._images(found) if found else None
        if max_tokens is None:
            max_tokens = 16 if not chat else max(1, self.engine.length - len(ids))
        constraints = None
        if format_ is not None:
            constraints = await self._matchers(format_, best_of)
        self._check_for_engine(ids, images, max_tokens, params["min_tokens"], "messages" if chat else "prompt",
                               limit_key)
        try:
            requests = self.engine.submit_many(ids, best_of, max_tokens, constraints=constraints, images=images,
                                               **params)
        except InputError as e:  # not a field's: the fields it checks were checked above
            raise OpenAIError(one_line(e)) from None
        as_ids = field(body, "return_tokens_as_token_ids", bool, False, None, "true or false")
        return Job(kind, requests, n, len(ids), stops, shown, tools if tool_choice != "none" else None, as_ids)

    def _check_for_engine(self, ids: list, images, max_tokens: int, min_tokens: int, prompt_key: str,
                          limit_key: str) -> None:
        """What the engine's ``submit_many`` would refuse in this request's fields, refused here first, in the
        engine's words, naming the field (the engine's InputError does not say which input it is about):
        the prompt's token ids, its image tokens against the request's images (a VLM's), its length with
        ``max_tokens`` against the cache, and ``min_tokens`` against ``max_tokens``."""
        vocab = self.engine.vocab
        if not ids:
            raise OpenAIError("a request needs at least one prompt token", param=prompt_key)
        if any(not 0 <= t < vocab for t in ids):
            raise OpenAIError(f"prompt token ids must be in [0, {vocab})", param=prompt_key)
        vision = self.engine.vision
        if vision is not None:
            token, rows, count = vision["image_token_id"], vision["rows"], len(images or ())
            places = ids.count(token)
            if places and not count:
                raise OpenAIError(f"the prompt holds {places} image tokens and the request no image", param=prompt_key)
            if count and (places != count * rows or ids[-1] == token):
                raise OpenAIError(f"the prompt holds {places} image tokens, and {count} images take {count * rows} "
                                  f"(each {rows}, before the prompt's last token)", param=prompt_key)
        try:
            SamplingParams(max_tokens, min_tokens=min_tokens).check(len(ids), self.engine.length)
        except InputError as e:  # the length first, as check reads them
            fits = len(ids) + max_tokens <= self.engine.length
            raise OpenAIError(one_line(e), param="min_tokens" if fits else limit_key) from None

    async def _matchers(self, format_: tuple, count: int) -> list:
        """A grammar matcher per choice for ``format_`` (kind, value): checked in the grammar worker, then
        compiled here off the event loop (its cost now bounded by the worker's limits)."""
        import asyncio
        try:
            if self.grammars is None:  # its tokenizer loaded and its worker started off the event loop, once
                self.grammars = await asyncio.get_running_loop().run_in_executor(None, self.session.grammars)
            text = await self.grammars.compile_async(*format_)

            def make():
                from ...llm.grammar import Matcher
                first = Matcher(self.grammars, text)
                return [first] + [first.copy() for _ in range(count - 1)]
            return await asyncio.get_running_loop().run_in_executor(None, make)
        except InputError as e:
            raise OpenAIError(one_line(e), param="response_format") from None

    async def _images(self, found: list) -> list:
        """The images of a chat's ``image_url`` parts (data URLs), decoded and resized as the model's image
        processor does, in the image workers (``images.ImageWorkers``: bounded in bytes, pixels and seconds,
        apart from the text work); one bad image is a 400 naming its part."""
        from ...images import MAX_IMAGES, data_url_bytes
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
        vision = self.engine.vision is not None
        plain = [plain_message(m, found if vision else None, f"messages[{i}]") for i, m in enumerate(messages)]
        text = json.dumps(plain, ensure_ascii=False) + (json.dumps(tools, ensure_ascii=False) if tools else "")
        check_text(text, "messages")
        size = len(text)
        if size > self.limits.chars:
            raise OpenAIError(f"the messages hold {size:,} characters, more than the model's {self.engine.length} "
                              f"positions can hold (at most {self.limits.chars:,} are read)", 413, "messages")
        return await text_work("messages", self.text.chat(plain, tools))

    async def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            if self.text is None:
                raise OpenAIError("this model was exported without a tokenizer: send prompt as token ids",
                                  param="prompt")
            check_text(prompt, "prompt")
            if len(prompt) > self.limits.chars:
                raise OpenAIError(f"the prompt is {len(prompt):,} characters, more than the model's "
                                  f"{self.engine.length} positions can hold (at most {self.limits.chars:,} are read)",
                                  413, "prompt")
            return await text_work("prompt", self.text.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if len(prompt) > self.engine.length:
                raise OpenAIError(f"{len(prompt):,} prompt tokens do not fit the model's {self.engine.length} "
                                  "positions", param="prompt")
            return prompt
        raise OpenAIError("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")

    async def _complete(self, job: Job) -> dict:
        import asyncio
        try:
            results = await asyncio.gather(*(collect(r, job.stops, self.text) for r in job.requests))
        finally:
            job.cancel()
        order = list(range(len(job.requests)))
        if len(order) > job.n:  # best_of: the choices of the highest total log-probability
            order.sort(key=lambda i: -sum(lp for lp, _ in job.requests[i].logprobs[:results[i][2]]))
        choices = []
        for index, i in enumerate(order[:job.n]):
            text, reason, used = results[i]
            logprobs = await logprobs_of(job, job.requests[i], 0, used, 0, self.text) \
                if job.logprobs is not None else None
            choices.append(await self._choice(job, index, text, reason, logprobs))
        return {"id": reply_id(job.kind), "object": job.kind, "created": int(time.time()), "model": self.name,
                "choices": choices, "usage": usage(job)}

    async def _choice(self, job: Job, index: int, text: str, reason, logprobs) -> dict:
        if job.kind == "text_completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        message = {"role": "assistant", "content": text}
        if job.tools:
            calls, content = await tool_calls_of(text, job.tools)
            if calls:
                message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
