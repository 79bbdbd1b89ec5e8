"""A request to the engine and its sampling parameters: the tokens of one generation, handed to its
reader (blocking, or asyncio) as the engine's thread makes them."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from typing import Sequence

import numpy as np

from ..errors import InputError

_FINISH = ("stop", "length", "cancelled", "error")


TOP_LOGPROBS = 20  # the most alternatives a step reports per token (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # token biases one request may carry (OpenAI's limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Beyond temperature, top-k and top-p, the logits processors run on the
    device in the decode step: ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``:
    a token of the prompt or the reply has its logit divided by it, multiplied where negative),
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's: subtracted once for a token the reply holds,
    and per time it holds it), ``logit_bias`` (``(token, bias)`` pairs added to the logits) and
    ``min_tokens`` (stop tokens masked until the reply has that many). ``logprobs``: None, or report the
    sampled token's log-probability and that many alternatives (0 to 20), from the model's own
    distribution (the log-softmax of its logits, before any processor)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop: tuple[int, ...] = ()  # token ids that end the request (not returned)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def check(self, prompt_len: int, cache_length: int, vocab: int | None = None) -> None:
        """Every field in the range the device step takes (int32 top-k, two uint32 words of seed, finite
        floats): a request that passes cannot fail a step for the others."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if prompt_len + self.max_new_tokens > cache_length:
            raise InputError(f"{prompt_len} prompt tokens and {self.max_new_tokens} new ones do not fit the cache of "
                             f"{cache_length} positions", hint="ask for fewer new tokens (max_new_tokens, run --max-new-tokens) or send a "
                                  "shorter prompt, or export with a larger cache_length")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 1e6) \
                or (self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1)) \
                or (self.top_k is not None and not (is_int(self.top_k) and 1 <= self.top_k < 2 ** 31)):
            raise InputError("temperature must be from 0 to 1e6, top_k from 1 to 2^31 - 1 and 0 < top_p <= 1")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2 ** 64):
            raise InputError(f"seed must be an integer from 0 to 2^64 - 1, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and -2 <= v <= 2):
                raise InputError(f"{name} must be a number from -2 to 2, got {v!r}")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r <= 10):
            raise InputError(f"repetition_penalty must be a number above 0 and at most 10, got {r!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InputError(f"min_tokens must be an integer from 0 to max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
                is_int(t) and 0 <= t < (vocab or 2 ** 31) and isinstance(b, (int, float)) and not isinstance(b, bool)
                and -100 <= b <= 100 for t, b in self.logit_bias):
            raise InputError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids"
                             + (f" below the vocabulary of {vocab}" if vocab else "") + ", each with a bias from -100 to 100")
        if self.logprobs is not None and not (is_int(self.logprobs) and 0 <= self.logprobs <= TOP_LOGPROBS):
            raise InputError(f"logprobs must be an integer from 0 to {TOP_LOGPROBS}, got {self.logprobs!r}")

    @classmethod
    def from_json(cls, d: dict) -> "SamplingParams":
        """From ``dataclasses.asdict`` through JSON (lists back to the tuples the fields hold)."""
        return cls(**dict(d, stop=tuple(d.get("stop", ())),
                          logit_bias=tuple((int(t), float(b)) for t, b in d.get("logit_bias", ()))))


def is_int(v) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class Request:
    """One generation: its new tokens arrive as the engine makes them. Iterate it (blocking), ``async for``
    over ``astream()``, or wait with ``result()``. ``cancel()`` frees its slot at the next step.

    The engine's side: ``push(token)`` for each new token, ``finish(reason)`` once at the end."""

    _ids = itertools.count()

    def __init__(self, prompt: Sequence[int], params: SamplingParams):
        self.id = next(self._ids)
        self.prompt, self.params = list(prompt), params
        self.tokens: list[int] = []
        # per token with params.logprobs: (its log-probability, [(token, log-probability), ...] alternatives)
        self.logprobs: list[tuple[float, list]] = []
        self.siblings: list = []  # n > 1: the other choices of the same prompt, prefilled with this one
        self.constraint = None  # a grammar's matcher (structured outputs): fill(mask row), consume(token), stopped
        self.page_keys: list[bytes] | None = None  # prefix caching: its prompt's pages' hash chain (engine's)
        self.images: list | None = None  # a VLM's: the prompt's images, float32 [H, W, 3] in [0, 1] (engine's)
        self.resume: tuple | None = None  # preempted (paged engine): (prompt and tokens so far, its decode state row)
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.dropped = False  # the engine has seen the cancel (at the start of a step)
        self.times = {"submitted": time.perf_counter()}
        self._cond = threading.Condition()
        self._watchers: list = []  # (loop, asyncio.Event) of async readers

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        self.cancelled = True

    def _notify(self) -> None:
        self._cond.notify_all()
        for loop, event in list(self._watchers):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # its loop has closed: nobody is listening
                pass

    def push(self, token: int, logprob: tuple[float, list] | None = None) -> None:
        """A new token (the engine's), with its log-probabilities when the request asked for them."""
        with self._cond:
            if not self.tokens:
                self.times["first_token"] = time.perf_counter()
            self.tokens.append(token)
            if logprob is not None:
                self.logprobs.append(logprob)
            self._notify()

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """The end (the engine's): the first reason given stays."""
        with self._cond:
            if self.finish_reason is None:
                self.finish_reason, self.error = reason, error
                self.times["done"] = time.perf_counter()
                self._notify()

    def result(self, timeout: float | None = None) -> list[int]:
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} not done after {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self.tokens) > i or self.done)
                new, finished = self.tokens[i:], self.done
            yield from new
            i += len(new)
            if finished and i == len(self.tokens):
                if self.error is not None:
                    raise self.error
                return

    async def astream(self):
        """The new tokens as they come, for asyncio code (the engine runs in its own thread)."""
        event, loop = asyncio.Event(), asyncio.get_running_loop()
        with self._cond:
            self._watchers.append((loop, event))
        i = 0
        try:
            while True:
                event.clear()
                with self._cond:
                    new, finished = self.tokens[i:], self.done
                for t in new:
                    yield t
                i += len(new)
                if finished and i == len(self.tokens):
                    if self.error is not None:
                        raise self.error
                    return
                if not new:
                    await event.wait()
        finally:
            with self._cond:
                self._watchers.remove((loop, event))
