"""The scheduler: :class:`Engine` admits requests into the decode batch's slots, prefills their prompts
within a per-step token budget, runs one decode step of every slot, and hands each slot's new token to
its request. Its device calls are built in :mod:`.step`; the broadcast of each step's events to the other
processes (a program sharded over several) is :mod:`.follow`'s."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Sequence

import numpy as np

from ..errors import InputError
from ..images import MAX_IMAGES
from ..llm.contract import has_state, prefill_chunks
from ..llm.plan import DECODE, DECODE_BATCH, VISION, StepPlan
from .follow import StepEvents
from .prefix import PAGE_SIZE, PrefixCache, default_pages, page_keys
from .request import TOP_LOGPROBS, Request, SamplingParams, is_int
from .step import (Executables, cache_shardings, devices_of, jit_decode, jit_insert, jit_page_load, jit_page_store, jit_prefill,
                   jit_prefill_image, jit_put_rows, jit_set_row, jit_take_rows, jit_vision, jit_zeros, mask_words,
                   output_tree, put, state_row, state_rows)

log = logging.getLogger("torchtpu_export")


@dataclasses.dataclass
class _Slot:
    request: Request | None = None
    caches: tuple | None = None  # the request's own cache while it is prefilled
    filled: int = 0  # prompt tokens (all but the last) in that cache
    decoding: bool = False
    direct: bool = False  # prefilled in place, in the batch's cache (prefill_batch_<N>)
    image_rows: np.ndarray | None = None  # a request with images: each prompt position's image row (``_rows``)


class Engine:
    """Continuous batching over a ``.tpu`` LLM (``prefill_<N>`` and ``decode`` / ``decode_batch`` programs).

    ``submit(prompt_ids, max_new_tokens, ...)`` returns a :class:`Request` at once; ``start()`` runs the
    scheduler in a background thread (``stop()`` ends it), or call ``step()`` yourself. ``batched=False``
    uses the one-slot ``decode`` program even where a ``decode_batch`` exists.

    The engine picks the decode program by load: while the busy slots fit a smaller batch of the step (the
    one-slot ``decode``, ``decode_batch_<b>``), their rows are taken out of the batch's state and caches and
    stepped through the smallest that holds them (put back when the load no longer fits it), so a light load
    never pays for idle slots.

    ``prefix_cache`` (on by default): the KV cache of each prefilled prompt's full pages (``page_size``
    positions) stays on the device, in a pool of ``prefix_pages`` pages (default: as many positions as the
    batch's cache), and a later prompt that starts with the same pages gets them copied in and prefills only
    the rest (:mod:`.prefix`). Not for models with recurrent states (a state is not kept per page) nor under
    several processes.

    A program exported with a paged KV cache (``kv_pages``: ``decode_paged``) gives a
    :class:`~.paged.PagedEngine` (unless ``batched=False``)."""

    def __new__(cls, program=None, *args, **kwargs):
        if cls is Engine:  # the engine for the program's programs: a subclass that says it serves them
            cls = next((sub for sub in Engine.__subclasses__() if sub.serves(program, **kwargs)), Engine)
        return super().__new__(cls)

    takes_images = True  # a VLM's image requests (the paged engine's steps take none)

    @classmethod
    def serves(cls, program, **kwargs) -> bool:
        """Whether ``Engine(program, **kwargs)`` is this subclass."""
        return False

    def __init__(self, program, *, platform: str | None = None, batched: bool = True,
                 prefill_budget: int | None = None, prefix_cache: bool = True, prefix_pages: int | None = None,
                 page_size: int = PAGE_SIZE):
        import jax
        self._jax = jax
        self._abstract = program.abstract  # aot.TopologyProgram: chips not attached
        sigs = program.signatures
        plan = self.plan = StepPlan.of(sigs)  # which program takes each of the engine's calls
        self.lengths = list(plan.lengths)
        decode_sig = DECODE_BATCH if batched and plan.has(DECODE_BATCH) else DECODE
        if decode_sig not in sigs or not self.lengths:
            raise InputError(f"serving an LLM needs prefill_<N> and decode programs; this artifact has {sigs}",
                             hint="export the model with tte.export_llm(..., target='tpu')")
        self.program = program
        self.runners = {sig: program.runner(sig, platform) for sig in [plan.prefill(n) for n in self.lengths]}
        self.decode_runner, spec, self.vocab = decode_program(program, decode_sig, platform, ("tokens", "input_pos",
                                                                                             "mask"))
        self.cache_names = [n for n in spec if n.startswith("kv_cache_")]
        # recurrent states (Mamba, linear attention): a padding token would move them, so a prompt is cut into
        # chunks it fills exactly, and never prefilled in the batch's rows (whose other rows would step too)
        self.exact = has_state(self.cache_names)
        self.slots = spec["tokens"].shape[0]
        self.length = spec["mask"].shape[-1]
        self.prefill_budget = prefill_budget or self.lengths[-1]
        weights = self.decode_runner.weights
        self.device = first_device(weights)
        # where the engine's arrays live: one device, or for a sharded program its mesh (token ids and
        # positions replicated, each cache split as the plan says: by KV head). A sharded program under
        # several processes (jax.distributed) has one engine per process: process 0 takes the requests
        from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
        mesh = self.decode_runner.mesh
        self.processes = jax.process_count() if mesh is not None else 1
        self.lead = self.processes == 1 or jax.process_index() == 0
        self._events = StepEvents(self.lead) if self.processes > 1 else None
        self.stats = {"decode_steps": 0, "tokens": 0, "prefill_tokens": 0, "requests": 0,
                      "decode_bytes_to_device": 0, "decode_bytes_to_host": 0, "busy_slot_steps": 0}
        self._executables = Executables(program, devices_of(self.decode_runner, self.device), self.stats)
        self._small = SingleDeviceSharding(self.device) if mesh is None else NamedSharding(mesh, PartitionSpec())
        batch_sh = cache_shardings(self.decode_runner, self.cache_names, self._small)
        slot_sh = cache_shardings(self.runners[plan.prefill(self.lengths[0])], self.cache_names, self._small)
        self._slot_specs = [(tuple(spec[n].shape[1:]), np.dtype(spec[n].dtype)) for n in self.cache_names]
        self._slot_sh = slot_sh
        self._fns = {sig: self._prefill_fn(sig) for sig in self.runners}
        # prefill of several slots at once, straight into the batch's cache (requests arriving together)
        self.batch_lengths = [n for n in self.lengths if decode_sig == DECODE_BATCH and plan.has(plan.prefill_batch(n))
                              and not self.exact]
        for n in self.batch_lengths:
            sig = plan.prefill_batch(n)
            self.runners[sig] = program.runner(sig, platform)
            self._fns[sig] = self._prefill_fn(sig, slots=True)
        self.vision = vision_of(program, self.vocab, self.length) if self.takes_images else None
        if self.vision is not None:  # a VLM (llm.plan.VISION): image requests prefill through prefill_image_<N>
            self._vision_runner = program.runner(VISION, platform)
            self._vision = jit_vision(self._vision_runner, output_tree(program, VISION))
            for n in self.lengths:
                sig = plan.prefill_image(n)
                self.runners[sig] = program.runner(sig, platform)
                self._fns[sig] = jit_prefill_image(self.runners[sig], output_tree(program, sig), self.length,
                                                   self.cache_names)
        self._set_row = jit_set_row()
        self._decode_sig = decode_sig
        self._decodes = {0: self._decode_fn(decode_sig)}  # by the number of alternatives reported (0, 20)
        # a light load: the busy rows taken out and stepped through a smaller batch of the step (the batch's
        # step reads every slot's cache), put back when the load outgrows it. By rows: (signature, runner)
        self._buckets: dict = {}
        if decode_sig == DECODE_BATCH:
            self._buckets = {b: (plan.decode_bucket(b), program.runner(plan.decode_bucket(b), platform))
                             for b in plan.decode_buckets() if b < self.slots}
            if plan.has(DECODE):
                self._buckets[1] = (DECODE, program.runner(DECODE, platform))
        self._part: list | None = None  # [slot of each row (-1: none), their state, their caches] while in use
        self._part_decodes: dict = {}  # (rows, alternatives reported) -> jitted decode
        # rows stepped beyond a smaller batch's since the load fell to it (:meth:`_rows_for`; None: idle before)
        self._waste = None
        self._takes = {b: jit_take_rows() for b in self._buckets}
        self._puts = {b: jit_put_rows() for b in self._buckets}
        self._everything_rows = {b: self._put(np.full((b, mask_words(self.vocab)), -1, np.int32))
                                 for b in self._buckets}
        self._insert = jit_insert()
        self._zeros = jit_zeros(1, self._slot_specs, slot_sh)
        self._state = self._put(state_rows(self.slots, self.vocab))
        self._everything = self._put(np.full((self.slots, mask_words(self.vocab)), -1, np.int32))  # no mask
        self._batch_zeros = jit_zeros(self.slots, self._slot_specs, batch_sh)
        self._caches = self._made(self._batch_zeros, f"batch_zeros.{self.slots}")
        self._prefix = None
        if prefix_cache and not self.exact and self.processes == 1 and 1 <= page_size <= self.length and all(
                len(shape) == 3 and shape[1] == self.length for shape, _ in self._slot_specs):
            self.page_size, self._max_pages = page_size, self.length // page_size
            pages = prefix_pages if prefix_pages is not None else default_pages(self.slots, self.length, page_size)
            if not is_int(pages) or pages < 1:
                raise InputError(f"prefix_pages must be a positive integer, got {pages!r}")
            self._prefix = PrefixCache(pages, page_size, self.stats)
            self._pool_zeros = jit_zeros(pages, [((s[0], page_size, s[2]), d) for s, d in self._slot_specs], slot_sh)
            self._pool = self._made(self._pool_zeros, f"pool_zeros.{pages}x{page_size}")
            self._page_store = jit_page_store(page_size)
            self._page_store_batch = jit_page_store(page_size)  # the batch's cache rows: other shapes
            self._page_load = jit_page_load(page_size, self._slot_specs, slot_sh)
        self._slots = [_Slot() for _ in range(self.slots)]
        self._waiting: collections.deque[Request] = collections.deque()  # the scheduler's (see _sync)
        self._inbox: collections.deque[Request] = collections.deque()  # submitted since the last step
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._halted = False  # the lead said stop (several processes: they have all left their loops)

    # ---- the device functions -------------------------------------------------------------------

    def _prefill_fn(self, sig: str, slots: bool = False):
        return jit_prefill(self.runners[sig], output_tree(self.program, sig), self.length, self.cache_names, slots)

    def _decode_fn(self, sig: str, top: int = 0):
        return jit_decode(self.decode_runner, output_tree(self.program, sig), self.length, self.cache_names,
                          sig == DECODE_BATCH, top)

    def warm(self) -> float:
        """Readies every device function the engine may call, for the shapes it calls it with, so that serving
        compiles nothing (a server does this before it takes requests): see :meth:`.step.Executables.warm`.
        Returns the seconds taken."""
        return self._executables.warm(self.calls())

    def _host(self, shape, dtype=np.int32):
        """The abstract value of a host array that :meth:`_put` places."""
        return self._jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=self._small)

    def _row_abstract(self) -> tuple:
        """The abstract value of one slot's state row (:func:`state_row`)."""
        return tuple(self._host(x.shape[1:], x.dtype) for x in state_rows(1, self.vocab))

    def calls(self):
        """``(name, function, arguments)`` for every device function this engine may call (the arguments
        abstract where the engine makes them per call), the functions made now where they are made on first
        use. A name says the same call with the same shapes in every engine of one file."""
        B, words, i32 = self.slots, mask_words(self.vocab), self._host(())
        one = tuple(self._jax.ShapeDtypeStruct((1, *s), d, sharding=sh)
                    for (s, d), sh in zip(self._slot_specs, self._slot_sh))
        for n in self.lengths:
            sig = self.plan.prefill(n)
            yield sig, self._fns[sig], (self.runners[sig].weights, self._host((1, n)), i32, one)
        for n in self.batch_lengths:
            sig = self.plan.prefill_batch(n)
            yield sig, self._fns[sig], (self.runners[sig].weights, self._host((B, n)), self._host((B,)),
                                        self._caches)
        if self.vision is not None:
            v = self.vision
            for n in self.lengths:
                sig = self.plan.prefill_image(n)
                yield sig, self._fns[sig], (self.runners[sig].weights, self._host((1, n)), i32, one,
                                            self._host((1, n, v["hidden"]), np.float32))
            yield VISION, self._vision, (self._vision_runner.weights,
                                         self._host((1, v["height"], v["width"], 3), np.float32))
        for top in (0, TOP_LOGPROBS):
            if top not in self._decodes:
                self._decodes[top] = self._decode_fn(self._decode_sig, top)
            yield f"{self._decode_sig}.top{top}", self._decodes[top], (self.decode_runner.weights, self._state,
                                                                      self._caches, self._host((B, words)))
        for b, (sig, runner) in sorted(self._buckets.items()):
            part_state = tuple(self._host((b, *x.shape[1:]), x.dtype) for x in self._state)
            part = tuple(self._jax.ShapeDtypeStruct((b, *s), d, sharding=sh)
                         for (s, d), sh in zip(self._slot_specs, self._slot_sh))
            for top in (0, TOP_LOGPROBS):
                yield f"{sig}.top{top}", self._part_decode(b, top), (runner.weights, part_state, part,
                                                                     self._host((b, words)))
            yield f"take_rows.{b}", self._takes[b], (self._state, self._caches, self._host((b,)))
            yield f"put_rows.{b}", self._puts[b], (self._state, self._caches, part_state, part, self._host((b,)))
        yield f"set_row.{B}", self._set_row, (self._state, i32, self._row_abstract())
        yield f"insert.{B}", self._insert, (self._state, self._caches, one, i32, self._row_abstract())
        yield "zeros", self._zeros, ()
        yield f"batch_zeros.{B}", self._batch_zeros, ()
        if self._prefix is not None:
            ids = self._host((self._max_pages,))
            pool = f"{self._prefix.pages}x{self.page_size}"  # the pool's shape: an engine's options, not the file's
            yield f"pool_zeros.{pool}", self._pool_zeros, ()
            yield f"page_load.{pool}", self._page_load, (self._pool, ids, i32)
            yield f"page_store.{pool}", self._page_store, (self._pool, one, i32, ids, ids)
            yield f"page_store.{B}.{pool}", self._page_store_batch, (self._pool, self._caches, i32, ids, ids)

    def _put(self, x):
        """Host values (a tree of them) on the engine's devices, replicated; under several processes every
        process passes the same values (the steps are the same everywhere). An engine of chips not attached
        (ahead-of-time compilation) has their abstract values."""
        if self._abstract:
            return self._jax.tree.map(lambda v: self._host(np.shape(v), np.asarray(v).dtype), x)
        return put(x, self._small)

    def _made(self, fn, name: str):
        """What ``fn()`` (the engine call ``name``) makes on the devices (:meth:`.step.Executables.made`)."""
        return self._executables.made(fn, name)

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, stop: Sequence[int] = (),
               seed: int | None = None, constraint=None, **processors) -> Request:
        """Queues a generation; raises InputError at once for a request that cannot run. ``processors``:
        the other fields of :class:`SamplingParams` (penalties, ``min_tokens``, ``logit_bias``,
        ``logprobs``). ``constraint``: a grammar's matcher (``fill(mask row)``, ``consume(token)``,
        ``stopped``, ``error``) that decides which tokens each step may sample. Without a ``seed`` a
        sampling request draws one of its own."""
        return self.submit_many(prompt_ids, 1, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                stop=stop, seed=seed, constraints=[constraint], **processors)[0]

    def submit_many(self, prompt_ids: Sequence[int], n: int, max_new_tokens: int = 64, *, seed: int | None = None,
                    constraints=None, images=None, **params) -> list[Request]:
        """``n`` generations after one prompt (OpenAI's ``n``), each with its own seed (``seed + i`` when a
        seed is given, else drawn): the prompt is prefilled once and its cache copied into each one's
        slot (where slots are free at that step; a choice that finds none is prefilled on its own later).
        ``images`` (a VLM's): float32 ``[H, W, 3]`` arrays in [0, 1] at the model's image size, one for each
        image of the prompt (its runs of ``vision["rows"]`` image tokens, in order)."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise InputError("a request needs at least one prompt token")
        vocab = self.vocab
        if any(not 0 <= t < vocab for t in ids):
            raise InputError(f"prompt token ids must be in [0, {vocab})")
        images = self._check_images(ids, images)
        if not is_int(n) or not 1 <= n <= self.slots * 16:
            raise InputError(f"n must be an integer from 1 to {self.slots * 16}, got {n!r}")
        top_k = params.get("top_k")
        if is_int(top_k) and top_k > vocab:  # more than the vocabulary is all of it
            params["top_k"] = vocab
        params["stop"] = tuple(int(s) for s in params.get("stop", ()))
        params["logit_bias"] = tuple((int(t), float(b)) for t, b in dict(params.get("logit_bias") or {}).items()) \
            if isinstance(params.get("logit_bias"), dict) else tuple(params.get("logit_bias") or ())
        constraints = [None] * n if constraints is None or constraints == [None] else list(constraints)
        if len(constraints) != n:  # a matcher follows one reply: each choice needs its own
            raise InputError(f"{len(constraints)} constraints for {n} choices")
        if (n > 1 or any(c is not None for c in constraints)) and self.processes > 1:
            raise InputError("several choices (n > 1) and structured outputs run on one process (not with "
                             "serve --distributed)")
        if seed is None and params.get("temperature"):
            import secrets
            seed = secrets.randbits(64)  # sampling without a seed: a draw of its own (none repeats another's)
        requests = []
        for i in range(n):
            p = SamplingParams(max_new_tokens, seed=(int(seed) + i) % 2 ** 64 if is_int(seed) else seed, **params)
            p.check(len(ids), self.length, vocab)
            requests.append(Request(ids, p))
            requests[-1].constraint = constraints[i]
            if images:  # never a prefix cache hit: its image tokens are the same ids whatever the image
                requests[-1].images, requests[-1].page_keys = images, []
        if not self.lead:
            raise InputError(f"this engine is process {self._jax.process_index()} of {self.processes}: requests are "
                             "taken by process 0", hint="submit on process 0; here call engine.follow()")
        leader, others = requests[0], requests[1:]
        leader.siblings = others
        with self._cv:
            if self._stopping or self._halted:
                raise InputError("the engine is stopping")
            self._inbox.append(leader)
            self.stats["requests"] += n
            self._cv.notify_all()
        return requests

    def _check_images(self, ids: list[int], images) -> list | None:
        """``images`` as float32 arrays, checked against the prompt's image tokens; InputError otherwise."""
        v = self.vision
        token = v["image_token_id"] if v is not None else None
        places = ids.count(token) if v is not None else 0
        if not images:
            if places:
                raise InputError(f"the prompt holds {places} image tokens and the request no image")
            return None
        if v is None:
            raise InputError("this model takes no images (it is not a vision-language model)")
        if not isinstance(images, (list, tuple)) or len(images) > MAX_IMAGES:
            raise InputError(f"images must be a list of at most {MAX_IMAGES} arrays")
        shape = (v["height"], v["width"], 3)
        arrays = [np.asarray(im, np.float32) for im in images]
        if any(a.shape != shape or not np.isfinite(a).all() for a in arrays):
            raise InputError(f"each image must be a finite float32 array of shape {list(shape)} (values in [0, 1])")
        if places != len(arrays) * v["rows"] or ids[-1] == token:
            raise InputError(f"the prompt holds {places} image tokens, and {len(arrays)} images take "
                             f"{len(arrays) * v['rows']} (each {v['rows']}, before the prompt's last token)")
        return arrays

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, **params) -> list[int]:
        """One request run to its end in this thread (no background thread needed)."""
        request = self.submit(prompt_ids, max_new_tokens, **params)
        while not request.done:
            if self._thread is None:
                self.step()
            else:
                return request.result()
        return request.result()

    # ---- the scheduler ------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._inbox) or bool(self._waiting) or any(s.request is not None for s in self._slots)

    def step(self) -> bool:
        """One scheduler step: admit and prefill within the budget, then one decode step of every slot.
        Returns whether there was anything to do."""
        jax = self._jax
        if not self._sync():
            return False
        decoding = any(s.decoding for s in self._slots)
        budget = self.prefill_budget if decoding else None  # nothing to delay: prefill what fits
        budget = self._prefill_together(budget)
        budget = self._prefill(budget)
        self._admit(budget)
        if not any(s.decoding for s in self._slots):
            self._waste = None  # no load to fall from: the next one starts in the smallest that holds it
            return self.busy
        asked = [s.request.params.logprobs for s in self._slots if s.decoding and s.request.params.logprobs is not None]
        top = TOP_LOGPROBS if any(asked) else 0
        busy = [i for i, s in enumerate(self._slots) if s.decoding]
        mask = self._mask()
        rows = self._rows_for(busy)
        if rows < self.slots:
            out = self._part_step(busy, rows, top, mask)
        else:
            self._unpart()
            if top not in self._decodes:
                self._decodes[top] = self._decode_fn(self._decode_sig, top)
            allowed = self._everything if mask is None else self._put(mask)
            out, self._state, self._caches = self._decodes[top](self.decode_runner.weights, self._state,
                                                                self._caches, allowed)
        tokens = np.asarray(jax.device_get(out[0]))
        logprobs = jax.device_get(out[1:]) if asked else None  # only when a request asked: B floats (+ top)
        self.stats["decode_steps"] += 1
        self.stats["decode_bytes_to_host"] += tokens.nbytes + (sum(a.nbytes for a in logprobs) if asked else 0)
        for i, slot in enumerate(self._slots):
            if slot.decoding:
                self.stats["busy_slot_steps"] += 1
                k = slot.request.params.logprobs
                lp = None if k is None else (float(logprobs[0][i]), [(int(t), float(v)) for t, v in
                                                                  zip(logprobs[2][i][:k], logprobs[1][i][:k])])
                self._deliver(i, slot, int(tokens[i]), lp)
        return True

    def _rows_for(self, busy: list[int]) -> int:
        """The rows of the batch to step the busy slots ``busy`` through: the smallest that holds them (a bucket, or
        the whole batch). A load that fell to a smaller one stays where it is until stepping the larger one has
        read as many extra rows as moving to the smaller one and back would read and write (four times its
        rows): a load at a bucket's edge (a request ending as another starts) does not move its rows each step."""
        fit = min((b for b in self._buckets if b >= len(busy)), default=self.slots)
        now = self.slots if self._part is None else len(self._part[0])
        if self._waste is not None and fit < now and (self._part is None or set(busy) <= set(self._part[0])):
            self._waste += now - fit
            if self._waste < 4 * fit:
                return now
        self._waste = 0
        return fit

    def _part_decode(self, rows: int, top: int):
        """The jitted decode step of the smaller batch of ``rows`` rows (reporting ``top`` alternatives)."""
        if (rows, top) not in self._part_decodes:
            sig, runner = self._buckets[rows]
            self._part_decodes[rows, top] = jit_decode(runner, output_tree(self.program, sig), self.length,
                                                       self.cache_names, sig != DECODE, top)
        return self._part_decodes[rows, top]

    def _part_step(self, busy: list[int], rows: int, top: int, mask):
        """One decode step of the busy slots ``busy`` through the smaller batch of ``rows`` rows (their rows
        taken out of the batch's where they are not there already); its outputs as the batch's (``[B, ...]``,
        the other rows zero)."""
        if self._part is None or len(self._part[0]) != rows or not set(busy) <= set(self._part[0]):
            self._unpart()
            slots = busy + [-1] * (rows - len(busy))
            taken = self._takes[rows](self._state, self._caches, self._put(np.array([max(i, 0) for i in slots],
                                                                                   np.int32)))
            self._part = [slots, *taken]
        slots = self._part[0]
        runner = self._buckets[rows][1]
        out, self._part[1], self._part[2] = self._part_decode(rows, top)(runner.weights, self._part[1],
                                                                         self._part[2],
                                                                         self._part_allowed(slots, rows, mask))
        key = "one_row_steps" if rows == 1 else "small_batch_steps"
        self.stats[key] = self.stats.get(key, 0) + 1
        return self._whole(out, slots)

    def _part_allowed(self, part: list[int], rows: int, mask):
        """The allowed-token bitmask of a ``rows``-row call over the batch rows ``part`` (-1: no row), from the
        batch's ``mask`` (:meth:`_mask`; None: every token)."""
        if mask is None:
            return self._everything_rows[rows]
        return self._put(part_rows(mask, part, rows, fill=-1))

    def _whole(self, out, part: list[int]) -> tuple:
        """A smaller call's outputs for the batch rows ``part`` (-1, or past the list: no row) as the batch's
        (``[B, ...]``, the other rows zero)."""
        keep = [k for k, i in enumerate(part) if i >= 0]
        at = [part[k] for k in keep]
        full = []
        for o in self._jax.device_get(out):
            whole = np.zeros((self.slots, *o.shape[1:]), o.dtype)
            whole[at] = o[keep]
            full.append(whole)
        return tuple(full)

    def _unpart(self) -> None:
        """The smaller batch's rows back into the batch's state and caches (those of requests still there)."""
        if self._part is not None:
            slots, state, caches = self._part
            self._part = None
            back = np.array([i if i >= 0 else self.slots for i in slots], np.int32)  # past the batch: dropped
            self._state, self._caches = self._puts[len(slots)](self._state, self._caches, state, caches,
                                                               self._put(back))

    def _mask(self):
        """This step's allowed-token bitmask ``[B, words]`` (host): None for every token, unless a decoding
        slot has a grammar (its matcher fills its row) or has not reached ``min_tokens`` (its stop tokens
        are masked); then one upload of ``B * V / 8`` bytes."""
        rows = [(i, s.request) for i, s in enumerate(self._slots) if s.decoding and (
            s.request.constraint is not None or len(s.request.tokens) < s.request.params.min_tokens)]
        if not rows:
            return None
        mask = np.full((self.slots, mask_words(self.vocab)), -1, np.int32)
        for i, r in rows:
            if r.constraint is not None:
                r.constraint.fill(mask[i])
            if len(r.tokens) < r.params.min_tokens:
                bits = mask[i].view(np.uint32)
                for t in r.params.stop:
                    if 0 <= t < self.vocab:
                        bits[t // 32] &= ~np.uint32(1 << (t % 32))
            if not mask[i].any():  # nothing may follow: the grammar cannot go on (its error ends the request)
                mask[i] = -1
        self.stats["decode_bytes_to_device"] += mask.nbytes
        return mask

    def _deliver(self, i: int, slot: _Slot, token: int, logprob=None) -> None:
        r = slot.request
        c = r.constraint
        if r.dropped:
            self._free(i, "cancelled")
        elif c is not None and (c.error or not c.consume(token)):
            self._free(i, "error", InputError(f"the response format cannot go on: {c.error or 'token refused'}"))
        elif token in r.params.stop:
            self._free(i, "stop")
        else:
            r.push(token, logprob)
            self.stats["tokens"] += 1
            if len(r.tokens) >= r.params.max_new_tokens:
                self._free(i, "length")
            elif c is not None and c.stopped:  # the grammar is complete and nothing may follow
                self._free(i, "stop")

    def _free(self, i: int, reason: str, error: BaseException | None = None) -> None:
        if self._part is not None and i in self._part[0]:
            self._part[0][self._part[0].index(i)] = -1  # its rows are no one's now: never put back
        slot = self._slots[i]
        slot.request.finish(reason, error)
        self._slots[i] = _Slot()

    def _next_waiting(self) -> Request | None:
        """The first waiting request (cancelled ones before it end here), or None."""
        while self._waiting and self._waiting[0].dropped:
            self._waiting.popleft().finish("cancelled")
        return self._waiting[0] if self._waiting else None

    def _admit(self, budget) -> None:
        """Waiting requests into free slots while the prefill budget lasts."""
        for i, slot in enumerate(self._slots):
            if budget is not None and budget <= 0:
                return
            if slot.request is not None:
                continue
            if self._next_waiting() is None:
                return
            request = self._waiting.popleft()
            self._slots[i] = _Slot(request, *self._prefix_start(request))
            budget = self._prefill(budget, only=i)

    def _prefill(self, budget, only: int | None = None):
        """Prefills the slots still filling (the oldest first), at most ``budget`` tokens (None: all)."""
        for i, slot in enumerate(self._slots):
            if slot.request is None or slot.decoding or slot.direct or (only is not None and i != only):
                continue
            r = slot.request
            if r.dropped:
                self._free(i, "cancelled")
                continue
            with self._alone([i]):
                todo = r.prompt[:-1]
                rows = self._rows(slot) if r.images else None
                chunks = self._chunks(len(todo) - slot.filled) if rows is None else self._image_chunks(r, slot.filled)
                for take, n in chunks:
                    if budget is not None and budget <= 0:
                        return budget
                    chunk = np.zeros((1, n), np.int32)
                    chunk[0, :take] = todo[slot.filled:slot.filled + take]
                    sig = self.plan.prefill(n) if rows is None else self.plan.prefill_image(n)
                    more = ()
                    if rows is not None:  # the image rows of this chunk's positions
                        aligned = np.zeros((1, n, rows.shape[1]), np.float32)
                        aligned[0, :take] = rows[slot.filled:slot.filled + take]
                        more = (self._put(aligned),)
                    slot.caches = self._fns[sig](self.runners[sig].weights, self._put(chunk),
                                                 self._put(np.int32(slot.filled)), slot.caches, *more)
                    slot.filled += take
                    self.stats["prefill_tokens"] += take
                    if budget is not None:
                        budget -= n
                self._activate(i, slot)
        return budget

    def _rows(self, slot: _Slot) -> np.ndarray:
        """Each prompt position's image row (``[len(prompt) - 1, D]``, zeros at text): the request's images
        through the ``vision`` program (once per request), in the order of its image tokens."""
        if slot.image_rows is None:
            r, v = slot.request, self.vision
            weights = self._vision_runner.weights
            rows = np.concatenate([np.asarray(self._jax.device_get(self._vision(weights, self._put(im[None]))))[0]
                                   for im in r.images]).astype(np.float32)
            todo = np.asarray(r.prompt[:-1])
            slot.image_rows = np.zeros((len(todo), rows.shape[1]), np.float32)
            slot.image_rows[todo == v["image_token_id"]] = rows
        return slot.image_rows

    def _image_chunks(self, request: Request, start: int):
        """``(tokens, prefill length)`` chunks of an image request's prompt from ``start``: the longest length
        the rest fills, else the shortest that holds it; where the model's image rows attend to one another
        (``vision["bidirectional"]``) a chunk ends before an image it would cut, or holds the whole image."""
        image = np.asarray(request.prompt[:-1]) == self.vision["image_token_id"]
        total, s, out = len(image), start, []
        while s < total:
            left = total - s
            take = min(left, max((k for k in self.lengths if k <= left), default=self.lengths[0]))
            end = s + take
            if self.vision["bidirectional"] and end < total and image[end] and image[end - 1]:
                first = end - 1
                while first > s and image[first - 1]:
                    first -= 1
                if first > s:
                    take = first - s
                else:  # the chunk starts at the image: all of it in one chunk
                    while end < total and image[end]:
                        end += 1
                    take = end - s
            n = next((k for k in self.lengths if k >= take), None)
            if n is None:
                raise InputError(f"an image's {take} rows do not fit one prefill step of this model "
                                 f"(at most {self.lengths[-1]})")
            out.append((take, n))
            s += take
        return out

    @contextlib.contextmanager
    def _alone(self, slots: list[int]):
        """Work for the requests in ``slots`` only: if it fails, those requests end with the error and the
        step goes on for the others, unless the failure took the batch's own arrays with it (a donated
        call that ran), which ends the step for all (``_guarded_step``)."""
        try:
            yield
        except Exception as e:
            if any(getattr(x, "is_deleted", lambda: False)() for x in self._jax.tree.leaves((self._state, self._caches))):
                raise
            log.error("a request's prefill failed (%s: %s); the other requests go on", type(e).__name__, e)
            for i in slots:
                if self._slots[i].request is not None:
                    self._free(i, "error", e)

    def _prefill_together(self, budget):
        """Several requests at once through ``prefill_batch_<N>``, straight into their slots' rows of the
        batch's cache: waiting requests take free slots, and every slot not yet started or started this
        way advances by one chunk per call. Rows taking no part start at position C (their writes are
        dropped). Used when at least a quarter of the slots (and two) have a prompt to fill."""
        if not self.batch_lengths:
            return budget
        free = [i for i, s in enumerate(self._slots) if s.request is None]
        fresh = [s for s in self._slots if s.request is not None and not s.decoding and s.filled == 0
                 and s.caches is None]
        ongoing = any(s.direct and not s.decoding and s.request is not None for s in self._slots)
        if not ongoing and len(fresh) + min(len(free), len(self._waiting)) < max(2, self.slots // 4):
            return budget
        for i in free:
            nxt = self._next_waiting()
            if nxt is None or nxt.siblings or nxt.images or self._prefix_hit(nxt):
                break  # n > 1 shares a cache of its own, a prefix hit starts from the pool's pages, images go
                # through prefill_image_<N>: not in place
            self._slots[i] = _Slot(self._waiting.popleft(), None, 0, False, direct=True)
            self._park(i)
        for i, slot in enumerate(self._slots):
            if slot.request is not None and not slot.decoding and slot.filled == 0 and slot.caches is None:
                if not slot.direct:
                    self._park(i)
                slot.direct = True
        with self._alone([i for i, s in enumerate(self._slots) if s.direct and not s.decoding]):
            budget = self._prefill_rows(budget)
        for i, s in enumerate(self._slots):
            if s.direct and not s.decoding and s.request is not None and s.filled == len(s.request.prompt) - 1:
                with self._alone([i]):
                    self._activate(i, s)
        return budget

    def _park(self, i: int) -> None:
        """Slot ``i``'s state row parked past the cache (position C) before its prompt is prefilled in place:
        a decode step steps every row, and an idle row's stale position (the last request's, advancing each
        step) would write its token's keys and values into the prompt's positions."""
        row = tuple(np.asarray(a)[0] for a in state_rows(1, self.vocab))
        row = (row[0], np.int32(self.length), *row[2:])
        with self._alone([i]):  # failing, it ends this request only
            self._state = self._set_row(self._state, self._put(np.int32(i)), self._put(row))

    def _prefill_rows(self, budget):
        """``_prefill_together``'s calls: one chunk of every row started in place per call, within ``budget``."""
        while budget is None or budget > 0:
            rows = [(i, s) for i, s in enumerate(self._slots) if s.direct and not s.decoding]
            for i, s in rows:
                if s.request.dropped:
                    self._free(i, "cancelled")
            rows = [(i, s) for i, s in rows if s.request is not None]
            left = {i: len(s.request.prompt) - 1 - s.filled for i, s in rows}
            if not any(left.values()):
                break
            # the longest length that the longest prompt fills, else the shortest that holds it: little padding
            most = max(left.values())
            n = max((k for k in self.batch_lengths if k <= most), default=self.batch_lengths[0])
            tokens = np.zeros((self.slots, n), np.int32)
            start = np.full(self.slots, self.length, np.int32)  # rows taking no part write nothing
            for i, s in rows:
                take = min(n, left[i])
                if take:
                    tokens[i, :take] = s.request.prompt[s.filled:s.filled + take]
                    start[i] = s.filled
            sig = self.plan.prefill_batch(n)
            self._caches = self._fns[sig](self.runners[sig].weights, self._put(tokens), self._put(start),
                                          self._caches)
            for i, s in rows:
                s.filled += min(n, left[i])
                self.stats["prefill_tokens"] += min(n, left[i])
            self.stats["batched_prefill_calls"] = self.stats.get("batched_prefill_calls", 0) + 1
            if budget is not None:
                budget -= n * len(rows)
        return budget

    def _chunks(self, count: int):
        """``(tokens, prefill length)`` chunks for ``count`` prompt tokens, padding least: each call costs its
        length plus the shortest length again (a call reads all the weights once, however short). A model
        with recurrent states takes chunks it fills exactly."""
        if self.exact:
            yield from ((take, n) for _, take, n in prefill_chunks(count, self.lengths, exact=True))
            return
        plan = _plan(count, tuple(self.lengths))
        done = 0
        for n in plan:
            take = min(n, count - done)
            yield take, n
            done += take

    def _activate(self, i: int, slot: _Slot) -> None:
        """Inserts a prefilled request into the batch: slot ``i``'s cache and state."""
        r = slot.request
        row = state_row(r.params, r.prompt, 0 if r.params.seed is None else int(r.params.seed), self.vocab)
        self._prefix_store(r, *((self._caches, i, self._page_store_batch) if slot.direct else (slot.caches, 0)))
        if slot.direct:  # its cache rows are in place already
            self._state = self._set_row(self._state, self._put(np.int32(i)), self._put(row))
        else:
            self._state, self._caches = self._insert(self._state, self._caches, slot.caches,
                                                     self._put(np.int32(i)), self._put(row))
            # the other choices of the same prompt (n > 1): the same cache, each in a free slot of its own
            for sibling in list(r.siblings):
                free = next((j for j, s in enumerate(self._slots) if s.request is None), None)
                if free is None:
                    break
                r.siblings.remove(sibling)
                self._slots[free] = _Slot(sibling, None, len(r.prompt) - 1, True)
                srow = state_row(sibling.params, sibling.prompt, 0 if sibling.params.seed is None
                                 else int(sibling.params.seed), self.vocab)
                self._state, self._caches = self._insert(self._state, self._caches, slot.caches,
                                                         self._put(np.int32(free)), self._put(srow))
        if r.siblings:  # no free slot for these now: each is prefilled on its own, first in line
            self._waiting.extendleft(reversed(r.siblings))
            r.siblings = []
        slot.caches, slot.decoding = None, True

    # ---- prefix caching -----------------------------------------------------------------------

    def _keys(self, request: Request) -> list[bytes]:
        if request.page_keys is None:  # the pages of what is prefilled (all but the last prompt token)
            request.page_keys = page_keys(request.prompt[:-1], self.page_size)[:self._max_pages]
        return request.page_keys

    def _prefix_hit(self, request: Request) -> bool:
        return self._prefix is not None and bool(self._keys(request)) and self._prefix.holds(self._keys(request)[0])

    def _prefix_start(self, request: Request) -> tuple:
        """``(caches, filled)`` of a request entering a slot with a cache of its own: the pool's
        pages of its prompt's longest cached prefix copied in (``filled`` positions), else zeros."""
        hit = self._prefix.match(self._keys(request)) if self._prefix is not None else []
        if not hit:
            return self._zeros(), 0
        ids = np.zeros(self._max_pages, np.int32)
        ids[:len(hit)] = hit
        try:
            caches = self._page_load(self._pool, self._put(ids), self._put(np.int32(len(hit))))
        except Exception as e:  # the pool is a cache: a failed copy is a miss
            log.error("prefix cache load failed (%s: %s); the prompt is prefilled whole", type(e).__name__, e)
            return self._zeros(), 0
        self.stats["prefix_hit_tokens"] += len(hit) * self.page_size
        return caches, len(hit) * self.page_size

    def _prefix_store(self, request: Request, caches, row: int, store=None) -> None:
        """The full pages of a prefilled prompt (cache row ``row`` of ``caches``) the pool lacks, into it."""
        if self._prefix is None:
            return
        new = self._prefix.claim(self._keys(request))
        if not new:
            return
        src = np.zeros(self._max_pages, np.int32)
        dst = np.full(self._max_pages, self._prefix.pages, np.int32)  # past the pool: no page
        for j, (index, page) in enumerate(new):
            src[j], dst[j] = index, page
        try:
            self._pool = (store or self._page_store)(self._pool, caches, self._put(np.int32(row)), self._put(src),
                                                     self._put(dst))
        except Exception as e:  # the pool is a cache: lose it, never a request
            log.error("prefix cache store failed (%s: %s); the cache starts empty", type(e).__name__, e)
            self._prefix_clear()

    def _prefix_clear(self) -> None:
        if self._prefix is not None:
            self._prefix.clear()
            self._pool = self._pool_zeros()

    # ---- the start of each step, and the other processes' part --------------------------------

    def _sync(self) -> bool:
        """The start of a step: requests submitted and cancelled since the last one become the scheduler's,
        a snapshot that nothing changes while the step runs. Under several processes process 0 takes them
        and broadcasts them (:class:`~.follow.StepEvents`), so that every process schedules the same steps
        and calls its programs in the same order (the multi-controller contract); the tokens a step makes
        are replicated, so every process then sees the same. Returns False once the engine stops (process 0
        says so)."""
        with self._cv:
            new, stopping = list(self._inbox), self._stopping
            self._inbox.clear()
        live = {r.id: r for r in self._waiting} | {s.request.id: s.request for s in self._slots if s.request}
        cancelled = [i for i, r in live.items() if r.cancelled and not r.dropped]
        if self._events is not None:
            new, cancelled, stopping = self._events.exchange(new, cancelled, stopping)
        for i in cancelled:
            live[i].dropped = True
        self._waiting.extend(new)
        self._halted = self._halted or stopping
        return not self._halted

    def follow(self) -> None:
        """Under several processes, on every process but 0: runs the steps process 0 schedules (the same
        programs in the same order, over this process's devices) until process 0's engine stops."""
        if self.lead:
            raise InputError("follow() is for the engines of processes 1.. of a multi-process program; this one "
                             "takes the requests itself", hint="submit() and step() or start() here")
        while not self._halted:
            self._guarded_step()
        self._reset(InputError("the engine stopped"))

    # ---- the background thread ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Engine":
        if not self.lead:
            raise InputError("start() takes requests, which process 0 does", hint="call engine.follow() here")
        if self._thread is None:
            if self._halted and self.processes > 1:
                raise InputError("this engine has stopped, and so have the other processes' engines")
            self._stopping = self._halted = False
            self._thread = threading.Thread(target=self._loop, name="tte-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the scheduler (its requests end with an error); under several processes, every process's."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self.lead and not self._halted:  # stepped by the caller (generate): say stop to the others
            self._guarded_step()
            self._reset(InputError("the engine stopped"))

    # while idle under several processes, process 0 still steps this often: the others wait for its word
    # in a collective, and none should wait long in one
    idle_tick = 1.0

    def _loop(self) -> None:
        while not self._halted:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self.busy,
                                  self.idle_tick if self.processes > 1 else None)
            self._guarded_step()
        self._reset(InputError("the engine stopped"))

    def _guarded_step(self) -> None:
        try:
            self.step()
        except Exception as e:  # a failed step fails the requests in it, never the engine
            log.error("engine step failed: %s: %s", type(e).__name__, e)
            self._reset(e)

    def _reset(self, error: BaseException) -> None:
        for i, slot in enumerate(self._slots):
            if slot.request is not None:
                self._free(i, "error", error)
        if self._stopping or self._halted:
            with self._cv:
                left = list(self._waiting) + list(self._inbox)
                self._waiting.clear()
                self._inbox.clear()
            for r in left:
                r.finish("error", error)
        self._state = self._put(state_rows(self.slots, self.vocab))
        self._lost()

    def _lost(self) -> None:
        """After a failed step: what the failure may have taken with it (a donated call that ran) made anew."""
        self._part = None
        if self._prefix is not None and any(getattr(x, "is_deleted", lambda: False)() for x in self._pool):
            self._prefix_clear()


def vision_of(program, vocab: int, length: int) -> dict | None:
    """A VLM file's ``llm.vision`` (what puts images into a prompt), checked against its programs, or None for a
    model without images; ArtifactError for a file whose vision entry its programs do not bear out."""
    from ..errors import ArtifactError
    v = (program.llm or {}).get("vision")
    if v is None:
        return None
    sigs = program.signatures
    wanted = [VISION, *(StepPlan.prefill_image(n) for n in StepPlan.of(sigs).lengths)]
    if any(s not in sigs for s in wanted):
        raise ArtifactError(f"this file names a vision model but lacks the programs "
                            f"{[s for s in wanted if s not in sigs]}")
    # the program's shapes as its manifest records them (an engine over a TPU topology has no runnable program)
    spec = program.manifest["programs"][VISION]
    images, rows = ([list(t["shape"]) for t in spec[k]] for k in ("inputs", "outputs"))
    if (not 0 < v["rows"] <= length or not v["image_token_id"] < vocab or not v["marker"]
            or images != [[1, v["height"], v["width"], 3]] or rows != [[1, v["rows"], v["hidden"]]]):
        raise ArtifactError(f"this file's vision entry ({v['rows']} rows of {v['hidden']} for a "
                            f"{v['height']}x{v['width']} image, token {v['image_token_id']}) does not match its "
                            f"vision program ({images} -> {rows}) and vocabulary of {vocab}")
    return v


def first_device(weights: dict):
    """The device of the first weight (of the first of a sharded one's devices): the engine's."""
    import jax
    if not weights:
        return jax.devices()[0]
    w = next(iter(weights.values()))
    return w.devices().pop() if hasattr(w, "devices") else min(w.sharding.device_set, key=lambda d: d.id)


def decode_program(program, sig: str, platform, inputs: Sequence[str]):
    """``(runner, its inputs by name, vocabulary)`` of an LLM's decode program ``sig``, checked to be an
    ``export_llm`` step (``inputs`` among its inputs, logits among its outputs)."""
    import torch.utils._pytree as pytree
    runner = program.runner(sig, platform)
    spec = {s.name: s for s in runner.inputs}
    missing = set(inputs) - set(spec)
    if missing:
        raise InputError(f"program {sig} has no {sorted(missing)} input: it is not an export_llm program")
    outs = pytree.tree_unflatten(list(runner.outputs), output_tree(program, sig))
    if not isinstance(outs, dict) or "logits" not in outs:
        raise InputError(f"program {sig} has no logits output: it is not an export_llm program")
    return runner, spec, outs["logits"].shape[-1]


@functools.lru_cache(maxsize=4096)
def _plan(count: int, lengths: tuple) -> tuple:
    """The prefill lengths that cover ``count`` tokens at the least cost (see ``Engine._chunks``)."""
    overhead = lengths[0]
    cost, pick = [0] * (count + 1), [0] * (count + 1)
    for c in range(1, count + 1):  # cost[c]: the cheapest cover of c tokens
        cost[c] = -1
        for n in lengths:
            total = n + overhead + (cost[c - n] if n < c else 0)
            if cost[c] < 0 or total < cost[c]:
                cost[c], pick[c] = total, n
    plan, c = [], count
    while c > 0:
        plan.append(pick[c])
        c -= pick[c]
    return tuple(plan)


def part_rows(x: np.ndarray, part: list[int], rows: int, fill=0) -> np.ndarray:
    """Rows ``part`` of the batch's host array ``x`` (-1: no row) as a ``rows``-row call's, the others ``fill``."""
    out = np.full((rows, *x.shape[1:]), fill, x.dtype)
    keep = [k for k, i in enumerate(part) if i >= 0]
    out[keep] = x[[part[k] for k in keep]]
    return out
