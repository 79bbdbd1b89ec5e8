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


class PagePool:
    """The pages of a paged KV cache (``decode_paged``): which pool page each live sequence holds, and which
    full prompt pages are kept for later prompts (prefix caching by sharing: a cached page is read in place
    by every sequence whose prompt starts with its tokens, never copied).

    Page 0 belongs to no sequence (``llm.contract.paged_inputs``). A page is free, held (a count of the live
    sequences reading it), or cached (keyed by its hash chain, held by none, evicted in the order they were let go
    when a page is wanted). A sequence only writes pages it alone holds: a cached page is full and its
    tokens are the prompt's, so nobody writes it again. ``reserved`` counts the pages promised to admitted
    prompts and not yet taken; the engine preempts a request rather than take a page the pool lacks."""

    def __init__(self, pages: int, page: int, prefix: bool = True, stats: dict | None = None):
        self.pages, self.page, self.prefix = pages, page, prefix
        self._free = list(range(pages - 1, 0, -1))
        self._held = [0] * pages
        self._keyed: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> page, LRU first
        self._key_of: dict[int, bytes] = {}
        # the cached pages held by none (what ``take`` may evict), least recently let go first: counted and
        # evicted in O(1), not by a scan of every cached page per admission
        self._idle: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.reserved = 0  # pages promised to admitted requests and not yet taken
        self.stats = stats if stats is not None else {}
        for k in ("prefix_hit_tokens", "prefix_pages_stored", "prefix_evictions"):
            self.stats.setdefault(k, 0)

    def available(self) -> int:
        """Pages that can be taken now (free, or cached and held by none), less those reserved."""
        return len(self._free) + len(self._idle) - self.reserved

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of ``keys`` from the first, each now held once more."""
        found = []
        for k in keys if self.prefix else ():
            p = self._keyed.get(k)
            if p is None:
                break
            self._keyed.move_to_end(k)
            self._idle.pop(k, None)
            self._held[p] += 1
            found.append(p)
        return found

    def take(self) -> int:
        """A page for a sequence to write (held once): a free one, else the cached page that no sequence holds
        and that was let go longest ago (its key forgotten)."""
        if self._free:
            p = self._free.pop()
        else:
            if not self._idle:
                raise RuntimeError("the page pool is exhausted")  # the engine preempts first: never reached
            key, p = self._idle.popitem(last=False)
            del self._keyed[key]
            del self._key_of[p]
            self.stats["prefix_evictions"] += 1
        self._held[p] = 1
        return p

    def publish(self, key: bytes, page: int) -> None:
        """A held page full of prompt tokens, kept under ``key`` for later prompts once nobody holds it (a key
        cached already keeps its page)."""
        if self.prefix and key not in self._keyed and page not in self._key_of:
            self._keyed[key] = page
            self._key_of[page] = key
            if not self._held[page]:
                self._idle[key] = page
            self.stats["prefix_pages_stored"] += 1

    def release(self, pages: Sequence[int]) -> None:
        """A sequence's pages let go: each cached page stays cached, the others are free."""
        for p in pages:
            self._held[p] -= 1
            if self._held[p]:
                continue
            if p in self._key_of:
                self._idle[self._key_of[p]] = p  # the most recently let go
            else:
                self._free.append(p)

    def in_use(self) -> int:
        return sum(1 for h in self._held if h)

    def cached(self) -> int:
        return len(self._keyed)

    def clear(self) -> None:
        """Everything forgotten (the pool's contents were lost): no page held, none cached."""
        self.__init__(self.pages, self.page, self.prefix, self.stats)
