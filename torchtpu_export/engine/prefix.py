"""Prefix caching: the KV cache of prompts' full pages kept on the device after their request is prefilled, keyed
by their tokens, and copied into a later request's own cache when its prompt starts the same way (a system
prompt, a conversation's earlier turns), which then prefills only the rest.

A page holds ``page`` positions of every KV cache tensor. Its key is a hash chain, as vLLM's: the SHA-256 of
the previous page's key and this page's tokens, so a page matches only after the same tokens at the same
positions. Keys are digests, not Python hashes: one user's prompt never matches another's by collision.
Pages are evicted least recently used first when the pool is full; a page is only ever copied (never shared
by live sequences), so any page may go at any time and no request waits for memory."""
from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


PAGE_SIZE = 16  # positions per page (the engine's default)


def default_pages(slots: int, length: int, page: int = PAGE_SIZE) -> int:
    """The pool's default size: as many positions as the batch's cache (``slots`` of ``length``; two at least)."""
    return max(2, slots) * (length // page)


def page_keys(tokens: Sequence[int], page: int) -> list[bytes]:
    """The hash chain of ``tokens``' full pages (a partial last page has no key)."""
    keys, prev = [], b""
    for p in range(len(tokens) // page):
        chunk = np.asarray(tokens[p * page:(p + 1) * page], np.int64).tobytes()
        prev = hashlib.sha256(prev + chunk).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Which page of the device pool holds which prompt page (``pages`` of ``page`` positions), least
    recently used first. The pool itself is the engine's (:func:`.step.jit_page_store` /
    :func:`.step.jit_page_load`); this is its index."""

    def __init__(self, pages: int, page: int, stats: dict | None = None):
        self.pages, self.page = pages, page
        self._where: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> page, LRU first
        self._free = list(range(pages - 1, -1, -1))
        self.stats = stats if stats is not None else {}
        for k in ("prefix_hit_tokens", "prefix_pages_stored", "prefix_evictions"):
            self.stats.setdefault(k, 0)

    def holds(self, key: bytes) -> bool:
        return key in self._where

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The pool pages of the longest run of ``keys`` from the first that the pool holds (touched)."""
        found = []
        for k in keys:
            p = self._where.get(k)
            if p is None:
                break
            self._where.move_to_end(k)
            found.append(p)
        return found

    def claim(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """Pages for the keys the pool lacks, as ``(index in keys, pool page)`` (evicting the least recently
        used); the keys it holds are touched. At most the pool's size, from the first key: a page is only
        found after all the pages before it."""
        keys = list(keys)[:self.pages]
        for k in keys:
            if k in self._where:
                self._where.move_to_end(k)
        new = []
        for i, k in enumerate(keys):
            if k in self._where:
                continue
            if not self._free:
                old, p = self._where.popitem(last=False)
                self.stats["prefix_evictions"] += 1
                self._free.append(p)
            p = self._free.pop()
            self._where[k] = p
            new.append((i, p))
        self.stats["prefix_pages_stored"] += len(new)
        return new

    def clear(self) -> None:
        self._where.clear()
        self._free = list(range(self.pages - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._where)
