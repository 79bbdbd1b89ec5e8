"""OpenAI's routes over the continuous-batching engine: ``/v1/completions``, ``/v1/chat/completions``
(streamed as server-sent events with ``"stream": true``, usage with ``stream_options.include_usage``) and
``/v1/models``, mounted on KServe's FastAPI application. KServe's own OpenAI layer is built on vLLM's
request types (it imports vLLM, a GPU engine); these routes are this package's. Every field is checked
before a request is queued, so a bad request gets a 4xx with OpenAI's error object and never touches
other requests; stop strings end a request early; a client that goes away mid-stream frees its slot at
the next engine step.

The parts, as vLLM's ``entrypoints/openai`` splits them: :mod:`.routes` (:class:`OpenAIServer`: the
routes, a request's way to the engine and its replies back), :mod:`.protocol` (what a request may hold,
OpenAI's error object), :mod:`.tools` (tools, a required call's grammar, the calls read back from a
reply), :mod:`.streaming` (a choice's text as it comes, server-sent events) and :mod:`.logprobs`."""
from __future__ import annotations

from .protocol import MAX_CHOICES, OpenAIError
from .routes import OpenAIServer
from .tools import MAX_TOOLS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_calls

__all__ = ["MAX_CHOICES", "MAX_TOOLS", "OpenAIError", "OpenAIServer", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN",
           "tool_calls"]
