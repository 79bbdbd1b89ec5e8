"""What an OpenAI request may hold and what a refusal looks like: every field checked before a request is
queued (sampling, logprobs, stop strings, messages, response formats), OpenAI's error object, and
:class:`Job`, what an accepted request became."""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from ...engine.request import MAX_LOGIT_BIAS, TOP_LOGPROBS
from ...errors import InputError

MAX_CHOICES = 16  # n and best_of
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


@dataclasses.dataclass
class Job:
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


def field(body: dict, key: str, kinds, default=None, check=None, what: str = ""):
    """``body[key]`` (``default`` when absent or null) if it is one of ``kinds`` and passes ``check``; else
    a 400 saying it must be ``what``."""
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise OpenAIError(f"{key} must be {what}", param=key)
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise OpenAIError(f"{key} must be {what}", param=key)
    return value


def sampling_params(body: dict, chat: bool, vocab: int, stop_ids: tuple) -> dict:
    """The engine's sampling parameters from the request's fields (OpenAI's names, and vLLM's extra
    ones: ``top_k``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``); ``stop_ids``, the
    model's own stop tokens, come first."""
    number = (int, float)
    temperature = float(field(body, "temperature", number, 1.0, lambda v: 0 <= v <= 2, "from 0 to 2"))
    top_p = field(body, "top_p", number, None, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = field(body, "top_k", int, None, lambda v: v >= -1, "a positive integer, or -1 for all")
    seed = field(body, "seed", int, None, lambda v: 0 <= v < 2 ** 64, "an integer from 0 to 2^64 - 1")
    presence = float(field(body, "presence_penalty", number, 0.0, lambda v: -2 <= v <= 2, "from -2 to 2"))
    frequency = float(field(body, "frequency_penalty", number, 0.0, lambda v: -2 <= v <= 2, "from -2 to 2"))
    repetition = float(field(body, "repetition_penalty", number, 1.0, lambda v: 0 < v <= 10,
                             "above 0 and at most 10"))
    min_tokens = field(body, "min_tokens", int, 0, lambda v: v >= 0, "a non-negative integer")
    extra_stops = field(body, "stop_token_ids", list, [], lambda v: len(v) <= 64 and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in v),
        f"a list of at most 64 token ids below {vocab}")
    bias = field(body, "logit_bias", dict, {}, None, "an object of token ids to biases")
    logit_bias = []
    for key, value in bias.items():
        if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key) and int(key) < vocab) \
                or isinstance(value, bool) \
                or not isinstance(value, number) or not -100 <= value <= 100 or len(bias) > MAX_LOGIT_BIAS:
            raise OpenAIError(f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids (below {vocab}) to "
                              "biases from -100 to 100", param="logit_bias")
        logit_bias.append((int(key), float(value)))
    return dict(temperature=temperature, top_p=top_p, top_k=None if top_k in (None, -1, 0) else top_k, seed=seed,
                stop=tuple(dict.fromkeys((*stop_ids, *extra_stops))), presence_penalty=presence,
                frequency_penalty=frequency, repetition_penalty=repetition, min_tokens=min_tokens,
                logit_bias=tuple(logit_bias), logprobs=logprobs_shown(body, chat))


def logprobs_shown(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the reply reports (None: no logprobs): chat's ``logprobs: true``
    with ``top_logprobs``, completions' ``logprobs: N``."""
    if chat:
        want = field(body, "logprobs", bool, False, None, "true or false")
        top = field(body, "top_logprobs", int, None, lambda v: 0 <= v <= TOP_LOGPROBS,
                    f"an integer from 0 to {TOP_LOGPROBS}")
        if top is not None and not want:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if want else None
    return field(body, "logprobs", int, None, lambda v: 0 <= v <= TOP_LOGPROBS,
                 f"an integer from 0 to {TOP_LOGPROBS}")


def stop_strings(stop, chars: int, tokenizer: bool) -> list[str]:
    """The request's ``stop``: up to 4 strings of at most ``chars`` characters each; they need a
    ``tokenizer`` (the replies' text)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(
            isinstance(s, str) and 0 < len(s) <= chars for s in stops):
        raise OpenAIError("stop must be a string or up to 4 non-empty strings", param="stop")
    if stops and not tokenizer:
        raise OpenAIError("stop strings need the model's tokenizer, which this artifact does not carry",
                          param="stop")
    return stops


def response_format(body: dict, tool_choice: str, tool_grammar: str | None):
    """The reply's grammar as (kind, value) for llguidance (``llm.grammar``), or None: ``response_format``
    (json_schema, json_object), vLLM's ``guided_json``, ``guided_regex``, ``guided_choice`` and
    ``guided_grammar``, or ``tool_grammar``, the tool call that ``tool_choice`` requires. At most one of
    them."""
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
            from ...llm.grammar import check_strict
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
    if tool_grammar is not None:
        found.append(("grammar", tool_grammar))
    if len(found) > 1:
        raise OpenAIError("give one of response_format, guided_json, guided_regex, guided_choice, guided_grammar "
                          "and a required tool call", param="response_format")
    return found[0] if found else None


def plain_message(m: dict, images: list | None = None, where: str = "messages") -> dict:
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
        from ...untrusted import load_json
        try:
            value = load_json(value, "a tool call's arguments", error=ValueError)
        except ValueError as e:
            raise OpenAIError(f"{e}: a tool call's arguments must be JSON text", param="messages") from None
    return value if isinstance(value, dict) else {}


def check_text(text: str, param: str) -> None:
    """Text a tokenizer takes: JSON's \\ud800-\\udfff escapes outside a pair decode to no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(f"{param} holds a lone UTF-16 surrogate (a \\udXXX escape outside a pair): not text",
                          param=param) from None


async def text_work(param: str, work):
    """A text worker's answer (``work``, awaited); its refusal a 400 naming ``param``."""
    from ...llm.textproc import TextError
    try:
        return await work
    except TextError as e:
        raise OpenAIError(str(e), param=param) from None


async def json_body(raw, limit: int) -> dict:
    """The request's body, a JSON object of at most ``limit`` bytes."""
    from ...untrusted import load_json
    data = await raw.body()
    if len(data) > limit:
        raise OpenAIError(f"the request body is {len(data):,} bytes, more than the {limit:,} this model's requests "
                          "can need", 413)
    body = load_json(data, "the request body", max_bytes=limit, error=OpenAIError)
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def error_object(e: OpenAIError) -> dict:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": None}}


def error_response(e: OpenAIError):
    from starlette.responses import JSONResponse
    return JSONResponse(error_object(e), status_code=e.status)


def usage(job: Job) -> dict:
    made = sum(len(r.tokens) for r in job.requests)  # every choice's tokens (best_of's too), as OpenAI counts
    return {"prompt_tokens": job.prompt_len, "completion_tokens": made, "total_tokens": job.prompt_len + made}


def reply_id(kind: str) -> str:
    return f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
