"""What the server's parts share: what one request may carry (:class:`Limits`, used by the v2 and the
OpenAI side and enforced by the guard), an engine request's tokens as an async stream, and a
:class:`TteError` as one line for an HTTP error."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import TteError
from ..llm.textproc import TextWorkers
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
        chars = TextWorkers.chars_for(length)
        return cls(chars=chars, messages=length, body=(1 << 20) + 12 * chars)

    @classmethod
    def for_inputs(cls, specs) -> "Limits":
        """A v2 model's: its inputs' elements as JSON numbers (at most 32 bytes each) when every shape is known."""
        if not all(isinstance(d, int) and d >= 0 for s in specs for d in s.shape):
            return cls(chars=0, messages=0, body=MAX_V2_BODY)
        return cls(chars=0, messages=0, body=(1 << 20) + 32 * sum(int(np.prod(s.shape)) for s in specs))


async def stream_tokens(request):
    """An engine request's tokens as they come."""
    try:
        async for t in request.astream():
            yield t
    finally:
        request.cancel()  # a no-op once done; frees the slot when the reader went away


def one_line(e: TteError) -> str:
    return " ".join(line.strip() for line in e.user_message().splitlines())
