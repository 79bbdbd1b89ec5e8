"""A choice's text as the engine makes its tokens (detokenized in the text workers, cut at a stop string),
whole or as server-sent events."""
from __future__ import annotations

import json
import time

from ...errors import InputError, TteError
from ..common import one_line, stream_tokens
from .logprobs import logprobs_of
from .protocol import Job, OpenAIError, error_object, reply_id, usage
from .tools import tool_calls_of


async def deltas(request, stops: list, text):
    """(text delta, finish reason or None, tokens read so far) triples of an engine request; stop strings
    end it early. ``text``: the text workers (None: a model without a tokenizer, tokens shown as ``<id>``)."""
    from ...llm.textproc import Detokenizer, TextError
    detok = Detokenizer(text) if text else None
    said, reason, used = "", None, 0
    try:
        async for token in stream_tokens(request):
            used += 1
            if detok is None:
                yield f"<{token}>", None, used
                continue
            delta = await detok.add(token)
            if stops and delta:
                cut = _earliest(said + delta, stops, len(said))
                if cut is not None:
                    yield (said + delta)[len(said):cut], None, used
                    reason = "stop"
                    request.cancel()
                    break
            said += delta
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


async def collect(request, stops: list, text):
    """A choice's whole text, its finish reason and the tokens it read (:func:`deltas` joined)."""
    said, reason, used = "", None, 0
    async for delta, finish, used in deltas(request, stops, text):
        said += delta
        reason = finish or reason
    return said, reason, used


async def events(job: Job, model: str, text, include_usage: bool):
    """Server-sent events: each choice's deltas as they come (several choices interleaved, each chunk
    naming its index). With tools, a choice's text is read whole at its end, then sent as its content
    or its tool calls."""
    import asyncio
    kind = job.kind
    obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
    rid, created = reply_id(kind), int(time.time())
    queue: asyncio.Queue = asyncio.Queue()

    async def run(index: int, request):
        try:
            async for item in deltas(request, job.stops, text):
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
        return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

    tasks = [asyncio.get_running_loop().create_task(run(i, r)) for i, r in enumerate(job.requests)]
    try:
        first = [True] * len(tasks)
        seen, said, offsets = [0] * len(tasks), [""] * len(tasks), [0] * len(tasks)
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
                said[index] += delta
                if reason is None:
                    continue
                calls, content = await tool_calls_of(said[index], job.tools)
                if calls:
                    reason = "tool_calls"
                yield chunk(index, content or "", reason, first[index], calls=calls or None)
                first[index] = False
                continue
            if not (delta or reason or first[index]):
                continue
            logprobs = None
            if job.logprobs is not None and used > seen[index]:
                logprobs = await logprobs_of(job, job.requests[index], seen[index], used, offsets[index], text)
                seen[index] = used
            offsets[index] += len(delta)
            yield chunk(index, delta, reason, first[index], logprobs)
            first[index] = False
        if include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": usage(job)})
    except OpenAIError as e:  # mid-stream: the error object as the last event
        yield _sse(error_object(e))
    finally:
        job.cancel()
        for t in tasks:
            t.cancel()
    yield "data: [DONE]\n\n"


def _earliest(text: str, stops, after: int):
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
