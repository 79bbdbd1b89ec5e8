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


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop: tuple[int, ...] = ()  # token ids that end the request (not returned)
    seed: int | None = None

    def check(self, prompt_len: int, cache_length: int) -> None:
        """Every field in the range the device step takes (int32 top-k, two uint32 words of seed, finite
        floats): a request that passes cannot fail a step for the others."""
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if prompt_len + self.max_new_tokens > cache_length:
            raise InputError(f"{prompt_len} prompt tokens and {self.max_new_tokens} new ones do not fit the cache of "
                             f"{cache_length} positions", hint="send fewer tokens, or export with a larger cache_length")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 1e6) \
                or (self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1)) \
                or (self.top_k is not None and not (is_int(self.top_k) and 1 <= self.top_k < 2 ** 31)):
            raise InputError("temperature must be from 0 to 1e6, top_k from 1 to 2^31 - 1 and 0 < top_p <= 1")
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2 ** 64):
            raise InputError(f"seed must be an integer from 0 to 2^64 - 1, got {self.seed!r}")


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

    def push(self, token: int) -> None:
        """A new token (the engine's)."""
        with self._cond:
            if not self.tokens:
                self.times["first_token"] = time.perf_counter()
            self.tokens.append(token)
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
