"""Which requests hold a paged batch's rows, and which pages each row holds: admission while the pool can hold a
prompt, a row's pages as its sequence grows, preemption when a decode step needs more pages than the pool has,
and each step's page table. Plain Python over the page pool (:class:`.prefix.PagePool`): no device, no JAX.
The paged engine (:mod:`.paged`) asks it at each step and does the device work (a preempted decoding row's
saved state comes from it through ``save``); a test drives it with a stand-in for that."""
from __future__ import annotations

import collections

import numpy as np

from .prefix import PagePool, page_keys


class Row:
    """A row of the batch: its request, the tokens it prefills (the prompt; a preempted request's prompt and
    tokens), their pages' hash chain, its pool pages in sequence order, the positions written, and the pages
    still reserved for it."""

    def __init__(self, request=None, pages=(), filled: int = 0, owed: int = 0, seq=(), keys=()):
        self.request, self.pages, self.filled, self.owed = request, list(pages), filled, owed
        self.seq, self.keys = list(seq), list(keys)
        self.decoding = False
        self.position = 0  # while decoding: the position the next decode step writes


class PagedPolicy:
    """The rows (``rows``, one per slot of the batch) and the pool (``pool``) of a paged batch of ``slots``
    rows whose sequences hold at most ``max_pages`` pages of ``page_size`` positions. ``waiting``: the
    engine's line of requests (first come, first served; a preempted request goes back to its front);
    ``next_waiting()`` its first live request, or None."""

    def __init__(self, slots: int, pool: PagePool, max_pages: int, stats: dict, waiting: collections.deque,
                 next_waiting):
        self.rows = [Row() for _ in range(slots)]
        self.pool, self.page_size, self.max_pages = pool, pool.page, max_pages
        self.stats, self.waiting, self.next_waiting = stats, waiting, next_waiting

    def decoding(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r.decoding]

    def admit(self) -> None:
        """Waiting requests into free rows, first come first served, while the pool can hold each one's prompt
        and its first new token, and the pages the decoding rows start at the next step."""
        for i, row in enumerate(self.rows):
            if row.request is not None:
                continue
            request = self.next_waiting()
            if request is None:
                return
            seq = request.prompt if request.resume is None else request.resume[0]
            if request.page_keys is None:  # the full pages of what is prefilled (all but the last token)
                request.page_keys = page_keys(seq[:-1], self.page_size)[:self.max_pages]
            hit = self.pool.match(request.page_keys)
            owed = -(-len(seq) // self.page_size) - len(hit)
            if owed + self.short(self.decoding()) > self.pool.available():
                self.pool.release(hit)
                return  # it waits for pages (and those after it wait for it)
            self.waiting.popleft()
            if request.siblings:  # n > 1: each choice a request of its own, next in line
                self.waiting.extendleft(reversed(request.siblings))
                request.siblings = []
            self.pool.reserved += owed
            self.rows[i] = Row(request, hit, len(hit) * self.page_size, owed, seq, request.page_keys)
            self.stats["prefix_hit_tokens"] += len(hit) * self.page_size

    def room(self, busy: list[int], save) -> list[int]:
        """The decoding rows ``busy`` that this step's pages are there for: where more of them start a page than
        the pool has pages to take, the requests that arrived last (decoding or filling) are preempted
        (:meth:`preempt`, ``save(i)`` giving a decoding row's state) until the rest fit; the first to arrive
        always does (the pool holds a sequence of the whole cache)."""
        while busy and self.short(busy) > self.pool.available():
            victim = max((i for i, r in enumerate(self.rows) if r.request is not None),
                         key=lambda i: self.rows[i].request.id)
            self.preempt(victim, save(victim) if self.rows[victim].decoding else None)
            busy = [i for i in busy if i != victim]
        return busy

    def short(self, busy: list[int]) -> int:
        """How many of the decoding rows ``busy`` start a page at their next position beyond their reservation."""
        return sum(1 for i in busy if self.rows[i].owed == 0
                   and self.rows[i].position + 1 > len(self.rows[i].pages) * self.page_size)

    def preempt(self, i: int, state) -> None:
        """Row ``i``'s request out of the batch, back to the front of the line: the full pages it has written
        kept in the pool under their hash chain (its readmission reads them), its pages let go; a decoding
        request's decode ``state`` (its row, on the host) kept, to go on from where it was."""
        row, r = self.rows[i], self.rows[i].request
        if row.decoding:
            seq = r.prompt + r.tokens  # its next decode input is the last of them, at position len(seq) - 1
            r.resume, written = (seq, state), seq[:-1]
        else:  # still filling: its prompt (or its earlier preemption's tokens) again, from what is written
            written = row.seq[:row.filled]
        for key, page in zip(page_keys(written, self.page_size), row.pages):
            self.pool.publish(key, page)
        self.release(i)
        r.page_keys = None
        self.waiting.appendleft(r)
        self.stats["preemptions"] += 1

    def grow(self, row: Row, positions: int) -> None:
        """Pages for ``row``'s first ``positions`` positions: from its reservation, then from the pool (which
        :meth:`room` made sure has them)."""
        while len(row.pages) * self.page_size < positions:
            row.pages.append(self.pool.take())
            if row.owed:
                row.owed -= 1
                self.pool.reserved -= 1
        self.stats["most_pages_in_use"] = max(self.stats["most_pages_in_use"], self.pool.in_use())

    def decode_table(self, busy: list[int]) -> np.ndarray:
        """The page table of a decode step: each decoding row's pages (one more taken where its next position
        starts a page), the other rows' page 0."""
        table = np.zeros((len(self.rows), self.max_pages), np.int32)
        for i in busy:
            row = self.rows[i]
            self.grow(row, row.position + 1)
            table[i, :len(row.pages)] = row.pages
        return table

    def activated(self, row: Row) -> None:
        """``row``'s prompt is in: its full prompt pages kept for later prompts, the row decoding."""
        for key, page in zip(row.keys, row.pages):
            self.pool.publish(key, page)
        row.decoding, row.position = True, len(row.seq) - 1

    def release(self, i: int) -> None:
        """Row ``i`` free: its pages and what is still reserved for it back to the pool."""
        row = self.rows[i]
        self.pool.release(row.pages)
        self.pool.reserved -= row.owed
        self.rows[i] = Row()
