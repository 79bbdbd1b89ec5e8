"""Continuous batching over a paged KV cache (``tte.export_llm(..., target="tpu", kv_pages=...)``).

Every cache is one pool of pages shared by the batch's rows (``decode_paged``, ``prefill_paged_<N>``): a
row's sequence is in the pages of its ``page_table`` row, taken from the pool as it grows and given back
when it ends, so memory holds live tokens, not rows x cache length. :class:`PagedEngine` is the
:class:`~.scheduler.Engine` for such a program (``Engine(program)`` gives one); its requests, sampling,
processors and thread are the engine's. What differs:

- prompts are prefilled in place, in their rows' pages: with no row decoding, every row still filling
  advances by one chunk per call (``prefill_paged_<N>``, each row from its own start); rows taking no part
  point at page 0, which no sequence owns. While rows decode, a step is one packed call for all (a mixed
  step, as vLLM TPU's: ``mixed_paged_<N>``): one sequence of the decoding rows' next tokens, each at its own
  row's pages and position, then the next chunk of the filling row that arrived first; when more than one
  prompt's chunk fits the N tokens (a burst of short prompts), they share the step, in blocks of N / k
  (``mixed_paged_<N>_blocks_<k>``) given in the order they arrived. So the weights are read once per step and
  a decode row costs one token, not a row padded to the chunk (``prefill_budget`` does not apply: a step
  carries N prompt tokens);
- prefix caching shares pages instead of copying them (:class:`.prefix.PagePool`): a prompt's full pages
  stay in the pool, keyed by a hash chain of their tokens, when their request ends; a later prompt starting
  with the same tokens reads them in place and prefills only the rest. Cached pages nobody holds are
  evicted in the order they were let go when a page is wanted;
- a request is admitted when the pool can hold its prompt (its pages reserved then) beside the pages the
  decoding rows take at the next step; a sequence then takes pages as it grows. When a decode step needs more
  pages than the pool has, the requests that arrived last are preempted (as vLLM does): their full pages are kept in
  the pool under their tokens' hash chain, their pages let go, their decode state saved, and they go back to
  the front of the line; readmitted, they read their kept pages (or prefill their prompt and tokens again)
  and go on from their saved state, so a preempted request's tokens are those it would have made. The
  first waiting request that does not fit waits for pages (first come, first served). Those decisions are
  :class:`.paged_policy.PagedPolicy`'s (no device); this class does the device work.

Attention reads each row's pages through ``tte::paged_attention`` (:mod:`torchtpu_export.llm.paged`): gathered
in sequence order by XLA, or on TPU by kernels that fetch only each row's live pages: JAX's paged attention
kernel for rows of one query (a decode step, a packed step's decode tokens), ours for rows of several (prompt
chunks, a packed step's blocks)."""
from __future__ import annotations

import collections
import threading

import numpy as np

from ..errors import InputError
from ..llm.plan import DECODE_PAGED, StepPlan, mixed_chunks
from .follow import StepEvents
from .paged_policy import PagedPolicy
from .prefix import PagePool
from .request import TOP_LOGPROBS
from .scheduler import Engine, decode_program, first_device, part_rows
from .step import (Executables, cache_shardings, devices_of, jit_decode, jit_decode_rows, jit_get_row, jit_mixed,
                   jit_prefill, jit_set_row, jit_zeros, mask_words, output_tree, state_row, state_rows)


class PagedEngine(Engine):
    """:class:`~.scheduler.Engine` over a paged program (see the module). ``prefix_cache=False`` keeps no
    page after its request; the pool's size and page length are the program's (``kv_pages`` and
    ``page_size`` at export)."""

    @classmethod
    def serves(cls, program, batched: bool = True, **kwargs) -> bool:
        return batched and program is not None and DECODE_PAGED in program.signatures

    takes_images = False  # a VLM is exported without paged programs (export_llm refuses kv_pages there)

    def __init__(self, program, *, platform: str | None = None, batched: bool = True,
                 prefill_budget: int | None = None, prefix_cache: bool = True, prefix_pages: int | None = None,
                 page_size: int | None = None):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
        self._jax = jax
        self._abstract = program.abstract
        self.vision = None
        sigs = program.signatures
        plan = StepPlan.of(sigs)
        self.lengths = plan.paged_lengths
        if not plan.has(DECODE_PAGED) or not self.lengths:
            raise InputError(f"a paged engine needs decode_paged and prefill_paged_<N> programs; this artifact has "
                             f"{sigs}", hint="export the model with tte.export_llm(..., target='tpu', kv_pages=...)")
        if prefix_pages is not None:
            raise InputError("prefix_pages sizes the slots' prefix pool; a paged program keeps its prefix pages in its "
                             "cache's pool (kv_pages at export)")
        self.program = program
        self.decode_runner, spec, self.vocab = decode_program(program, DECODE_PAGED, platform,
                                                              ("tokens", "input_pos", "page_table"))
        self.cache_names = [n for n in spec if n.startswith("kv_cache_")]
        pool = spec[self.cache_names[0]].shape  # [kv heads, pages, page, dim]
        self.pages, self.page_size = pool[1], pool[2]
        if page_size is not None and page_size != self.page_size:
            raise InputError(f"this program's pages hold {self.page_size} positions, not {page_size}")
        self.slots = spec["tokens"].shape[0]
        plan = self.plan = plan.with_rows(self.slots)  # which program takes each of the engine's calls
        self._max_pages = spec["page_table"].shape[1]
        self.length = self._max_pages * self.page_size
        self.exact = False
        self.prefill_budget = prefill_budget or self.lengths[-1]
        # a sharded program under several processes: one engine per process, process 0 taking the requests
        # and every process running the same steps (the pages each sequence gets, the prefix cache's hits and
        # preemptions are decided by the same requests and tokens everywhere)
        mesh = self.decode_runner.mesh
        self.processes = jax.process_count() if mesh is not None else 1
        self.lead = self.processes == 1 or jax.process_index() == 0
        self._events = StepEvents(self.lead) if self.processes > 1 else None
        weights = self.decode_runner.weights
        self.device = first_device(weights)
        self._small = SingleDeviceSharding(self.device) if mesh is None else NamedSharding(mesh, PartitionSpec())
        self.runners = {plan.prefill_paged(n, self.slots): program.runner(plan.prefill_paged(n, self.slots), platform)
                        for n in self.lengths}
        self._fns = {sig: jit_prefill(r, output_tree(program, sig), self.length, self.cache_names, slots=True)
                     for sig, r in self.runners.items()}
        self._decodes: dict = {}
        self._mixeds: dict = {}  # (mixed signature, alternatives reported) -> jitted mixed step
        # a light load steps its own rows through a smaller program (decode_paged_<b>): no idle row stepped
        self._buckets = {b: program.runner(plan.decode_paged_bucket(b), platform)
                         for b in plan.decode_buckets() if b < self.slots}
        self._row_decodes: dict = {}
        # prefill chunks (and mixed steps) of fewer rows: (length, rows) -> signature, the batch's own among them
        self._fill = {(n, self.slots): plan.prefill_paged(n, self.slots) for n in self.lengths}
        for b in sorted(self._buckets):
            if all(plan.has(plan.prefill_paged(n, b)) for n in self.lengths):
                for n in self.lengths:
                    sig = self._fill[n, b] = plan.prefill_paged(n, b)
                    self.runners[sig] = program.runner(sig, platform)
                    self._fns[sig] = jit_prefill(self.runners[sig], output_tree(program, sig), self.length,
                                                 self.cache_names, slots=True)
        # packed mixed steps: (chunk length, decode lanes, blocks of prompt tokens) -> signature (none in an
        # artifact of an older version: its arrivals are then prefilled between decode steps); a step of one
        # prompt's chunk, or of several (B lanes, ``mixed_paged_<N>_blocks_<k>``) when more than one rides
        self._mixes = {(n, b, 1): plan.mixed(n, b) for n in self.lengths for b in [self.slots] + sorted(self._buckets)
                       if plan.has(plan.mixed(n, b))}
        for n in self.lengths:
            k = mixed_chunks(n, self.slots)
            if plan.has(plan.mixed(n, self.slots, k)) and (n, self.slots, 1) in self._mixes:
                self._mixes[n, self.slots, k] = plan.mixed(n, self.slots, k)
        for sig in self._mixes.values():
            self.runners[sig] = program.runner(sig, platform)
        self._set_row, self._get_row = jit_set_row(), jit_get_row()
        self.stats = {"decode_steps": 0, "tokens": 0, "prefill_tokens": 0, "requests": 0,
                      "decode_bytes_to_device": 0, "decode_bytes_to_host": 0, "busy_slot_steps": 0,
                      "batched_prefill_calls": 0, "prefill_row_chunks": 0, "mixed_steps": 0, "most_pages_in_use": 0,
                      "preemptions": 0, "small_prefill_calls": 0, "mixed_chunks": 0, "most_chunks_in_a_step": 0}
        self._executables = Executables(program, devices_of(self.decode_runner, self.device), self.stats)
        self._pool_zeros = jit_zeros(None, [(tuple(spec[n].shape), np.dtype(spec[n].dtype)) for n in self.cache_names],
                                     cache_shardings(self.decode_runner, self.cache_names, self._small))
        self._caches = self._made(self._pool_zeros, "pages_zeros")
        self._pool = PagePool(self.pages, self.page_size, prefix_cache, self.stats)
        self._prefix = self._pool if prefix_cache else None
        self._waiting = collections.deque()
        # which requests hold the rows and which pages each holds (admission, growth, preemption)
        self._policy = PagedPolicy(self.slots, self._pool, self._max_pages, self.stats, self._waiting,
                                   self._next_waiting)
        self._state = self._put(state_rows(self.slots, self.vocab))
        self._everything = self._put(np.full((self.slots, mask_words(self.vocab)), -1, np.int32))
        self._everything_rows = {b: self._put(np.full((b, mask_words(self.vocab)), -1, np.int32))
                                 for b in self._buckets}
        self._everything_rows[self.slots] = self._everything
        self._slots = self._policy.rows
        self._inbox = collections.deque()
        self._cv = threading.Condition()
        self._thread = None
        self._stopping = self._halted = False

    # ---- the scheduler ------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler step: admit what the pool holds; then, while rows decode, one call for all (a mixed
        step: each filling row's next prompt chunk and each decoding row's next token, the weights read once),
        or with none decoding the prompts prefilled and one decode step. Returns whether there was anything
        to do."""
        if not self._sync():
            return False
        self._policy.admit()
        busy = self._policy.room(self._policy.decoding(), self._save_row)
        if busy and self._filling():
            if self._mixes:
                self._mixed(busy)
                return True
            self._prefill_rows()
        if not busy:
            self._prefill_rows()
            busy = self._policy.room(self._policy.decoding(), self._save_row)
        if not busy:
            return self.busy
        top, asked = self._top(busy)
        table = self._policy.decode_table(busy)
        rows = min((b for b in self._buckets if b >= len(busy)), default=None)
        if rows is not None:
            out = self._rows_step(busy, rows, top, table)
        else:
            decode = self._decode_fn(DECODE_PAGED, top)
            out, self._state, self._caches = decode(self.decode_runner.weights, self._state, self._caches,
                                                    self._allowed(), self._put(table))
        self.stats["decode_steps"] += 1
        self._hand_out(busy, out, asked)
        return True

    def _mixed(self, busy: list[int]) -> None:
        """One packed call (``mixed_paged_<N>``, or ``mixed_paged_<N>_rows_<b>`` for fewer decoding rows): every
        decoding row's next token, then ``N`` prompt tokens, one sequence of ``b + N`` tokens (each token with
        its own row's pages and position). The N are the next chunk of the filling row that arrived first, or,
        where that leaves a block of ``mixed_paged_<N>_blocks_<k>`` for the next, blocks given to the filling
        rows in the order they arrived (each row's next chunk in as many blocks as it fills and are left)."""
        top, asked = self._top(busy)
        filling = sorted(self._filling(), key=lambda x: x[1].request.id)
        left = [len(r.seq) - 1 - r.filled for _, r in filling]
        n = self._chunk_length(sum(left))
        # several prompts' chunks in blocks where the first leaves a block for the next, else one's
        blocks = max((k for m, b, k in self._mixes if m == n and len(filling) > 1 and -(-left[0] // (n // k)) < k),
                     default=1)
        lanes = min(b for m, b, k in self._mixes if m == n and k == blocks and b >= len(busy))
        sig, size = self._mixes[n, lanes, blocks], n // blocks
        table = np.zeros((lanes + blocks, self._max_pages), np.int32)
        table[:len(busy)] = self._policy.decode_table(busy)[busy]
        tokens = np.zeros(n, np.int32)
        positions = np.tile(np.arange(size, dtype=np.int32), blocks)  # a block taking no part: page 0
        taken, takes, used = [], {}, 0  # used: blocks given
        for (i, r), k in zip(filling, left):
            if used == blocks:
                break
            takes[i] = take = min(k, (blocks - used) * size)
            whole = -(-take // size) * size  # its blocks, padding after its tokens at the next positions
            at = used * size
            tokens[at:at + take] = r.seq[r.filled:r.filled + take]
            positions[at:at + whole] = r.filled + np.arange(whole)
            self._policy.grow(r, r.filled + take)
            table[lanes + used:lanes + used + whole // size, :len(r.pages)] = r.pages
            taken.append((i, r))
            used += whole // size
        with self._alone([i for i, _ in taken] + busy):
            out, self._state, self._caches = self._mixed_fn(sig, top)(
                self.runners[sig].weights, self._state, self._caches, self._part_allowed(busy, lanes, self._mask()),
                self._put(table), self._put(tokens), self._put(positions), self._put(self._index(busy, lanes)))
            self._filled(taken, takes)
            self.stats["mixed_steps"] += 1
            self.stats["decode_steps"] += 1
            self.stats["mixed_chunks"] += len(taken)
            self.stats["most_chunks_in_a_step"] = max(self.stats["most_chunks_in_a_step"], len(taken))
            if lanes < self.slots:
                self.stats["small_mixed_steps"] = self.stats.get("small_mixed_steps", 0) + 1
            self._hand_out(busy, self._whole(out, busy), asked)
        self._filling()  # a row whose prompt is in now enters the decode batch

    def _decode_fn(self, sig: str, top: int = 0):
        if top not in self._decodes:
            self._decodes[top] = jit_decode(self.decode_runner, output_tree(self.program, sig), self.length,
                                            self.cache_names, True, top)
        return self._decodes[top]

    def _rows_fn(self, rows: int, top: int):
        if (rows, top) not in self._row_decodes:
            self._row_decodes[rows, top] = jit_decode_rows(
                self._buckets[rows], output_tree(self.program, self.plan.decode_paged_bucket(rows)), self.length,
                self.cache_names, top)
        return self._row_decodes[rows, top]

    def _rows_step(self, busy: list[int], rows: int, top: int, table: np.ndarray) -> tuple:
        """A decode step of the rows ``busy`` alone through the smaller program of ``rows`` rows
        (``decode_paged_<rows>``, its other rows padding on page 0); its outputs as the batch's (``[B, ...]``,
        the other rows zero)."""
        out, self._state, self._caches = self._rows_fn(rows, top)(
            self._buckets[rows].weights, self._state, self._caches, self._part_allowed(busy, rows, self._mask()),
            self._put(part_rows(table, busy, rows)), self._put(self._index(busy, rows)))
        key = "one_row_steps" if rows == 1 else "small_batch_steps"
        self.stats[key] = self.stats.get(key, 0) + 1
        return self._whole(out, busy)

    def _index(self, part: list[int], rows: int) -> np.ndarray:
        """The batch rows ``part`` of a ``rows``-row call, padded with one past the batch (no row)."""
        return np.array(part + [self.slots] * (rows - len(part)), np.int32)

    def _fill_rows(self, count: int) -> int:
        """The rows of the prefill call for ``count`` rows: the smallest exported that holds them."""
        return min((b for n, b in self._fill if n == self.lengths[0] and b >= count), default=self.slots)

    def _mixed_fn(self, sig: str, top: int):
        if (sig, top) not in self._mixeds:
            self._mixeds[sig, top] = jit_mixed(self.runners[sig], output_tree(self.program, sig), self.length,
                                               self.cache_names, top)
        return self._mixeds[sig, top]

    def calls(self):
        B, table, i32 = self.slots, self._host((self.slots, self._max_pages)), self._host(())
        allowed = self._host((B, mask_words(self.vocab)))
        for (n, b), sig in sorted(self._fill.items()):
            h = self._host
            yield sig, self._fns[sig], (self.runners[sig].weights, h((b, n)), h((b,)), self._caches,
                                        h((b, self._max_pages)))
        for (n, b, blocks), sig in sorted(self._mixes.items()):
            h = self._host
            for top in (0, TOP_LOGPROBS):
                yield f"{sig}.top{top}", self._mixed_fn(sig, top), (
                    self.runners[sig].weights, self._state, self._caches, h((b, allowed.shape[1])),
                    h((b + blocks, self._max_pages)), h((n,)), h((n,)), h((b,)))
        for top in (0, TOP_LOGPROBS):
            yield f"{DECODE_PAGED}.top{top}", self._decode_fn(DECODE_PAGED, top), (
                self.decode_runner.weights, self._state, self._caches, allowed, table)
        for b, runner in sorted(self._buckets.items()):
            for top in (0, TOP_LOGPROBS):
                yield f"{self.plan.decode_paged_bucket(b)}.top{top}", self._rows_fn(b, top), (
                    runner.weights, self._state, self._caches, self._host((b, allowed.shape[1])),
                    self._host((b, self._max_pages)), self._host((b,)))
        yield f"set_row.{B}", self._set_row, (self._state, i32, self._row_abstract())
        yield f"get_row.{B}", self._get_row, (self._state, i32)
        yield "pages_zeros", self._pool_zeros, ()

    def _top(self, busy: list[int]):
        """How many alternatives the step reports (0 unless a decoding request asked for logprobs), and
        whether any asked for logprobs."""
        asked = [self._slots[i].request.params.logprobs for i in busy
                 if self._slots[i].request.params.logprobs is not None]
        return (TOP_LOGPROBS if any(asked) else 0), bool(asked)

    def _allowed(self):
        mask = self._mask()
        return self._everything if mask is None else self._put(mask)

    def _hand_out(self, busy: list[int], out, asked: bool) -> None:
        """A step's sampled tokens (and log-probabilities where asked) to the decoding rows' requests."""
        jax = self._jax
        tokens = np.asarray(jax.device_get(out[0]))
        logprobs = jax.device_get(out[1:]) if asked else None
        self.stats["decode_bytes_to_host"] += tokens.nbytes + (sum(a.nbytes for a in logprobs) if asked else 0)
        for i in busy:
            row = self._slots[i]
            row.position += 1
            self.stats["busy_slot_steps"] += 1
            k = row.request.params.logprobs
            lp = None if k is None else (float(logprobs[0][i]), [(int(t), float(v)) for t, v in
                                                              zip(logprobs[2][i][:k], logprobs[1][i][:k])])
            self._deliver(i, row, int(tokens[i]), lp)

    def _save_row(self, i: int) -> tuple:
        """Row ``i``'s decode state, on the host (a preempted request's, to go on from where it was)."""
        state = self._jax.device_get(self._get_row(self._state, self._put(np.int32(i))))
        return tuple(np.asarray(x) for x in state)

    def _filling(self) -> list:
        """The rows with prompt tokens left to prefill, as ``(row index, row)``; on the way, cancelled requests
        leave and rows whose prompt is in enter the decode batch."""
        rows = []
        for i, r in enumerate(self._slots):
            if r.request is None or r.decoding:
                continue
            if r.request.dropped:
                self._free(i, "cancelled")
            elif r.filled == len(r.seq) - 1:
                with self._alone([i]):
                    self._activate(i, r)
            else:
                rows.append((i, r))
        return rows

    def _chunk(self, rows):
        """One call's prompt chunks for ``rows``: its length ``N`` (the longest that the longest prompt left
        fills, else the shortest that holds it: little padding), tokens ``[B, N]``, each row's start, the page
        table (pages taken for the chunk), and how many tokens each row takes."""
        left = {i: len(r.seq) - 1 - r.filled for i, r in rows}
        n = self._chunk_length(max(left.values()))
        tokens = np.zeros((self.slots, n), np.int32)
        start = np.zeros(self.slots, np.int32)
        table = np.zeros((self.slots, self._max_pages), np.int32)
        takes = {}
        for i, r in rows:
            takes[i] = take = min(n, left[i])
            tokens[i, :take] = r.seq[r.filled:r.filled + take]
            start[i] = r.filled
            self._policy.grow(r, r.filled + take)
            table[i, :len(r.pages)] = r.pages
        return n, tokens, start, table, takes

    def _chunk_length(self, left: int) -> int:
        """A call's prompt chunk length for ``left`` tokens to prefill: the longest exported that they fill, else
        the shortest (little padding)."""
        return max((k for k in self.lengths if k <= left), default=self.lengths[0])

    def _filled(self, rows, takes) -> None:
        for i, r in rows:
            r.filled += takes[i]
            self.stats["prefill_tokens"] += takes[i]
        self.stats["prefill_row_chunks"] += len(rows)

    def _prefill_rows(self) -> None:
        """With no row decoding: every filling row advances one chunk per call, in place, until every prompt
        is in (nobody waits for it); each row then enters the decode batch."""
        while True:
            rows = self._filling()
            if not rows:
                return
            n, tokens, start, table, takes = self._chunk(rows)
            part = [i for i, _ in rows]
            b = self._fill_rows(len(part))
            sig = self._fill[n, b]
            if b < self.slots:  # only the filling rows (padding rows write page 0)
                tokens, start, table = (part_rows(x, part, b) for x in (tokens, start, table))
                self.stats["small_prefill_calls"] += 1
            with self._alone(part):
                self._caches = self._fns[sig](self.runners[sig].weights, self._put(tokens), self._put(start),
                                              self._caches, self._put(table))
                self._filled(rows, takes)
                self.stats["batched_prefill_calls"] += 1

    def _activate(self, i: int, row) -> None:
        """A prefilled request into the decode batch: its state row set (a preempted request's saved one), its
        full prompt pages kept for later prompts."""
        r = row.request
        if r.resume is not None:
            state, r.resume = r.resume[1], None
        else:
            state = state_row(r.params, r.prompt, 0 if r.params.seed is None else int(r.params.seed), self.vocab)
        self._state = self._set_row(self._state, self._put(np.int32(i)), self._put(state))
        self._policy.activated(row)

    def _free(self, i: int, reason: str, error: BaseException | None = None) -> None:
        self._slots[i].request.finish(reason, error)
        self._policy.release(i)

    def _lost(self) -> None:
        if any(getattr(x, "is_deleted", lambda: False)() for x in self._caches):  # the pool went with a failed call
            self._caches = self._pool_zeros()
            self._pool.clear()
