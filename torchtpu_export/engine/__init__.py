"""Continuous batching over an LLM's exported programs, with the KV cache on the device.

The design is JetStream's (prefill into a slot, then insert it into the batch) with vLLM's scheduling
(requests join and leave at any step, long prompts prefilled in chunks within a per-step token budget):

- the decode program steps ``B`` sequences at once (``decode_batch``, exported with
  ``tte.export_llm(..., target="tpu", batch_size=B)``; a ``decode`` program alone gives one slot). Its
  state lives on the device: per slot the next input token, the position, the sampling key and
  parameters, and the ``[B, ...]`` caches. One decode step is one jitted call whose caches and state are
  donated (updated in place); it samples every slot on the device and sends back ``B`` int32 token ids,
  the only host traffic of a step;
- a request entering is prefilled alone (``prefill_<N>``, batch 1, its prompt in chunks of the exported
  lengths, its own cache), then inserted into a free slot (one jitted dynamic-update-slice); its last
  prompt token is the slot's next decode input, so its first new token comes from the next decode step.
  Requests arriving together (at least a quarter of the slots) are prefilled together instead
  (``prefill_batch_<N>``: every slot's row from its own start, straight into the batch's cache; rows
  taking no part start past the cache's end, so their writes are dropped): the weights are read once
  for all of them, as in the decode step;
- each scheduler step prefills at most ``prefill_budget`` prompt tokens while other slots are decoding
  (a long prompt takes several steps, never stalling the batch for all of it), then runs one decode step;
- a request leaves at a stop token, at ``max_new_tokens``, or when cancelled (a client gone); its slot
  takes the next waiting request at the following step.

:class:`Engine` runs in a thread of its own (``start``) for servers, or step by step in the caller's
thread (``generate``, tests). Nothing else runs these programs: no Python model code is needed.

A program sharded over several processes (JAX's multi-controller runtime, one process per host) has one
engine per process: process 0 takes the requests and broadcasts them at the start of each step
(``_sync``), the others run the same steps (``follow``), so that all call the same programs in the same
order; the tokens a step samples are replicated, so every process sees them.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
import time
from typing import Sequence

import numpy as np

from ..errors import InputError
from ..llm.contract import DECODE, DECODE_BATCH, PREFILL, PREFILL_BATCH, prefill_lengths

log = logging.getLogger("torchtpu_export")

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
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if prompt_len + self.max_new_tokens > cache_length:
            raise InputError(f"{prompt_len} prompt tokens and {self.max_new_tokens} new ones do not fit the cache of "
                             f"{cache_length} positions", hint="send fewer tokens, or export with a larger cache_length")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 1e6) \
                or (self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1)) \
                or (self.top_k is not None and not (_is_int(self.top_k) and 1 <= self.top_k < 2 ** 31)):
            raise InputError("temperature must be from 0 to 1e6, top_k from 1 to 2^31 - 1 and 0 < top_p <= 1")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2 ** 64):
            raise InputError(f"seed must be an integer from 0 to 2^64 - 1, got {self.seed!r}")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class Request:
    """One generation: its new tokens arrive as the engine makes them. Iterate it (blocking), ``async for``
    over ``astream()``, or wait with ``result()``. ``cancel()`` frees its slot at the next step."""

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

    def _push(self, token: int) -> None:
        with self._cond:
            if not self.tokens:
                self.times["first_token"] = time.perf_counter()
            self.tokens.append(token)
            self._notify()

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
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


@dataclasses.dataclass
class _Slot:
    request: Request | None = None
    caches: tuple | None = None  # the request's own cache while it is prefilled
    filled: int = 0  # prompt tokens (all but the last) in that cache
    decoding: bool = False
    direct: bool = False  # prefilled in place, in the batch's cache (prefill_batch_<N>)


class Engine:
    """Continuous batching over a ``.tpu`` LLM (``prefill_<N>`` and ``decode`` / ``decode_batch`` programs).

    ``submit(prompt_ids, max_new_tokens, ...)`` returns a :class:`Request` at once; ``start()`` runs the
    scheduler in a background thread (``stop()`` ends it), or call ``step()`` yourself. ``batched=False``
    uses the one-slot ``decode`` program even where a ``decode_batch`` exists."""

    def __init__(self, program, *, platform: str | None = None, batched: bool = True,
                 prefill_budget: int | None = None):
        import jax
        self._jax = jax
        sigs = program.signatures
        self.lengths = prefill_lengths(sigs)
        decode_sig = DECODE_BATCH if batched and DECODE_BATCH in sigs else DECODE
        if decode_sig not in sigs or not self.lengths:
            raise InputError(f"serving an LLM needs prefill_<N> and decode programs; this artifact has {sigs}",
                             hint="export the model with tte.export_llm(..., target='tpu')")
        self.program = program
        self.runners = {sig: program.runner(sig, platform) for sig in [PREFILL.format(n) for n in self.lengths]}
        self.decode_runner = program.runner(decode_sig, platform)
        spec = {s.name: s for s in self.decode_runner.inputs}
        missing = {"tokens", "input_pos", "mask"} - set(spec)
        if missing:
            raise InputError(f"program {decode_sig} has no {sorted(missing)} input: it is not an export_llm program")
        self.cache_names = [n for n in spec if n.startswith("kv_cache_")]
        self.slots = spec["tokens"].shape[0]
        self.length = spec["mask"].shape[-1]
        self.prefill_budget = prefill_budget or self.lengths[-1]
        import torch.utils._pytree as pytree
        from .. import treespec
        outs = pytree.tree_unflatten(list(self.decode_runner.outputs),
                                     treespec.loads(program._call_metadata(decode_sig)["out_spec"]))
        if not isinstance(outs, dict) or "logits" not in outs:
            raise InputError(f"program {decode_sig} has no logits output: it is not an export_llm program")
        self.vocab = outs["logits"].shape[-1]
        weights = self.decode_runner.weights
        self.device = next(iter(weights.values())).devices().pop() if weights else jax.devices()[0]
        # where the engine's arrays live: one device, or for a sharded program its mesh (token ids and
        # positions replicated, each cache split as the plan says: by KV head). A sharded program under
        # several processes (jax.distributed) has one engine per process: process 0 takes the requests
        from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
        mesh = self.decode_runner.mesh
        self.processes = jax.process_count() if mesh is not None else 1
        self.lead = self.processes == 1 or jax.process_index() == 0
        self._small = SingleDeviceSharding(self.device) if mesh is None else NamedSharding(mesh, PartitionSpec())
        batch_sh = _cache_shardings(self.decode_runner, self.cache_names, self._small)
        slot_sh = _cache_shardings(self.runners[PREFILL.format(self.lengths[0])], self.cache_names, self._small)
        self._slot_specs = [(tuple(spec[n].shape[1:]), np.dtype(spec[n].dtype)) for n in self.cache_names]
        self._fns = {sig: self._prefill_fn(sig) for sig in self.runners}
        # prefill of several slots at once, straight into the batch's cache (requests arriving together)
        self.batch_lengths = [n for n in self.lengths if decode_sig == DECODE_BATCH and PREFILL_BATCH.format(n) in sigs]
        for n in self.batch_lengths:
            sig = PREFILL_BATCH.format(n)
            self.runners[sig] = program.runner(sig, platform)
            self._fns[sig] = self._prefill_fn(sig, slots=True)
        self._set_row = jax.jit(_set_row, donate_argnums=(0,))
        self._decode = self._decode_fn(decode_sig)
        self._insert = jax.jit(_insert, donate_argnums=(0, 1))
        shapes = self._slot_specs
        self._zeros = jax.jit(lambda: tuple(jax.numpy.zeros((1, *s), d) for s, d in shapes),
                              out_shardings=slot_sh)
        self._state = self._put(_state_rows(self.slots))
        self._caches = jax.jit(lambda: tuple(jax.numpy.zeros((self.slots, *s), d) for s, d in shapes),
                               out_shardings=batch_sh)()
        self._slots = [_Slot() for _ in range(self.slots)]
        self._waiting: collections.deque[Request] = collections.deque()  # the scheduler's (see _sync)
        self._inbox: collections.deque[Request] = collections.deque()  # submitted since the last step
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._halted = False  # the lead said stop (several processes: they have all left their loops)
        self.stats = {"decode_steps": 0, "tokens": 0, "prefill_tokens": 0, "requests": 0,
                      "decode_bytes_to_device": 0, "decode_bytes_to_host": 0, "busy_slot_steps": 0}

    # ---- the device functions -------------------------------------------------------------------

    def _call(self, runner, sig, slots: bool):
        import torch.utils._pytree as pytree
        from .. import treespec
        names = [s.name for s in runner.inputs]
        out_spec = treespec.loads(self.program._call_metadata(sig)["out_spec"])
        exported, n_out, length, cache_names = runner.exported, len(runner.outputs), self.length, self.cache_names

        def call(weights, tokens, pos, caches):
            import jax.numpy as jnp
            # [B, N]: each query's position (slots: input_pos is each row's first position)
            rows = pos[:, None] + jnp.arange(tokens.shape[1], dtype=pos.dtype) if slots else pos[None]
            visible = jnp.arange(length)[None, None, :] <= rows[:, :, None]
            feed = {"tokens": tokens, "input_pos": pos, "mask": jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min)
                    .astype(jnp.float32)[:, None], **dict(zip(cache_names, caches))}
            outs = pytree.tree_unflatten(list(exported.call(weights, *[feed[n] for n in names]))[:n_out], out_spec)
            return outs.get("logits"), tuple(outs[n] for n in cache_names)
        return call

    def _prefill_fn(self, sig: str, slots: bool = False):
        call = self._call(self.runners[sig], sig, slots)

        def prefill(weights, tokens, start, caches):
            import jax.numpy as jnp
            pos = start if slots else start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
            return call(weights, tokens, pos, caches)[1]
        return self._jax.jit(prefill, donate_argnums=(3,))

    def _decode_fn(self, sig: str):
        jax = self._jax
        call = self._call(self.decode_runner, sig, sig == DECODE_BATCH)
        last = self.length - 1

        def decode(weights, state, caches):
            import jax.numpy as jnp
            tokens, pos, keys, temp, top_k, top_p = state
            logits, caches = call(weights, tokens[:, None], pos, caches)
            keys = jax.vmap(jax.random.split)(keys)  # [B, 2, 2]: the slot's next key, this step's key
            logits = logits[:, -1].astype(jnp.float32)
            nxt = jax.lax.cond(jnp.any(temp > 0),
                               lambda: jax.vmap(sample)(logits, keys[:, 1], temp, top_k, top_p),
                               lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))
            return nxt, (nxt, jnp.minimum(pos + 1, last), keys[:, 0], temp, top_k, top_p), caches
        return jax.jit(decode, donate_argnums=(1, 2))

    def _put(self, x):
        """Host values (a tree of them) on the engine's devices, replicated; under several processes every
        process passes the same values (the steps are the same everywhere)."""
        from ..runtimes.xla import _place
        return self._jax.tree.map(lambda v: _place(np.asarray(v), self._small)[0], x)

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, stop: Sequence[int] = (),
               seed: int | None = None) -> Request:
        """Queues a generation; raises InputError at once for a request that cannot run."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise InputError("a request needs at least one prompt token")
        vocab = self.vocab
        if any(not 0 <= t < vocab for t in ids):
            raise InputError(f"prompt token ids must be in [0, {vocab})")
        if _is_int(top_k) and top_k > vocab:  # more than the vocabulary is all of it
            top_k = vocab
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, tuple(int(s) for s in stop), seed)
        params.check(len(ids), self.length)
        if not self.lead:
            raise InputError(f"this engine is process {self._jax.process_index()} of {self.processes}: requests are "
                             "taken by process 0", hint="submit on process 0; here call engine.follow()")
        request = Request(ids, params)
        with self._cv:
            if self._stopping or self._halted:
                raise InputError("the engine is stopping")
            self._inbox.append(request)
            self.stats["requests"] += 1
            self._cv.notify_all()
        return request

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

    def _sync(self) -> bool:
        """The start of a step: requests submitted and cancelled since the last one become the scheduler's,
        a snapshot that nothing changes while the step runs. Under several processes process 0 takes them
        and broadcasts them, so that every process schedules the same steps and calls its programs in the
        same order (the multi-controller contract); the tokens a step makes are replicated, so every
        process then sees the same. Returns False once the engine stops (process 0 says so)."""
        with self._cv:
            new, stopping = list(self._inbox), self._stopping
            self._inbox.clear()
        live = {r.id: r for r in self._waiting} | {s.request.id: s.request for s in self._slots if s.request}
        cancelled = [i for i, r in live.items() if r.cancelled and not r.dropped]
        if self.processes > 1:
            new, cancelled, stopping = self._broadcast(new, cancelled, stopping)
        for i in cancelled:
            live[i].dropped = True
        self._waiting.extend(new)
        self._halted = self._halted or stopping
        return not self._halted

    def _broadcast(self, new: list, cancelled: list, stopping: bool):
        """Process 0's step events to every process: their length first (one small collective per step,
        all an idle step costs), then the events themselves when there are any."""
        from jax.experimental import multihost_utils
        msg = b""
        if self.lead and (new or cancelled or stopping):
            msg = json.dumps({"new": [[r.id, r.prompt, dataclasses.asdict(r.params)] for r in new],
                              "cancelled": cancelled, "stop": stopping}).encode()
        n = int(multihost_utils.broadcast_one_to_all(np.array([len(msg)], np.int32))[0])
        if not n:
            return [], [], False
        buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.uint8)  # a few shapes: a few compilations
        buf[:len(msg)] = np.frombuffer(msg, np.uint8)
        if self.lead:
            multihost_utils.broadcast_one_to_all(buf)
            return new, cancelled, stopping
        event = json.loads(multihost_utils.broadcast_one_to_all(buf)[:n].tobytes())
        requests = []
        for rid, prompt, params in event["new"]:  # this process's copies: nobody reads their tokens
            r = Request(prompt, SamplingParams(**dict(params, stop=tuple(params["stop"]))))
            r.id = rid
            requests.append(r)
        return requests, event["cancelled"], event["stop"]

    def follow(self) -> None:
        """Under several processes, on every process but 0: runs the steps process 0 schedules (the same
        programs in the same order, over this process's devices) until process 0's engine stops."""
        if self.lead:
            raise InputError("follow() is for the engines of processes 1.. of a multi-process program; this one "
                             "takes the requests itself", hint="submit() and step() or start() here")
        while not self._halted:
            self._guarded_step()
        self._reset(InputError("the engine stopped"))

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
            return self.busy
        weights = self.decode_runner.weights
        nxt, self._state, self._caches = self._decode(weights, self._state, self._caches)
        tokens = np.asarray(jax.device_get(nxt))
        self.stats["decode_steps"] += 1
        self.stats["decode_bytes_to_host"] += tokens.nbytes
        for i, slot in enumerate(self._slots):
            if slot.decoding:
                self.stats["busy_slot_steps"] += 1
                self._deliver(i, slot, int(tokens[i]))
        return True

    def _deliver(self, i: int, slot: _Slot, token: int) -> None:
        r = slot.request
        if r.dropped:
            self._free(i, "cancelled")
        elif token in r.params.stop:
            self._free(i, "stop")
        else:
            r._push(token)
            self.stats["tokens"] += 1
            if len(r.tokens) >= r.params.max_new_tokens:
                self._free(i, "length")

    def _free(self, i: int, reason: str) -> None:
        slot = self._slots[i]
        slot.request._finish(reason)
        self._slots[i] = _Slot()

    def _admit(self, budget) -> None:
        """Waiting requests into free slots while the prefill budget lasts."""
        for i, slot in enumerate(self._slots):
            if budget is not None and budget <= 0:
                return
            if slot.request is not None:
                continue
            while self._waiting and self._waiting[0].dropped:
                self._waiting.popleft()._finish("cancelled")
            if not self._waiting:
                return
            request = self._waiting.popleft()
            self._slots[i] = _Slot(request, self._zeros(), 0, False)
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
                for take, n in self._chunks(len(todo) - slot.filled):
                    if budget is not None and budget <= 0:
                        return budget
                    chunk = np.zeros((1, n), np.int32)
                    chunk[0, :take] = todo[slot.filled:slot.filled + take]
                    sig = PREFILL.format(n)
                    slot.caches = self._fns[sig](self.runners[sig].weights, self._put(chunk),
                                                 self._put(np.int32(slot.filled)), slot.caches)
                    slot.filled += take
                    self.stats["prefill_tokens"] += take
                    if budget is not None:
                        budget -= n
                self._activate(i, slot)
        return budget

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
                    self._slots[i].request._finish("error", e)
                    self._slots[i] = _Slot()

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
            while self._waiting and self._waiting[0].dropped:
                self._waiting.popleft()._finish("cancelled")
            if not self._waiting:
                break
            self._slots[i] = _Slot(self._waiting.popleft(), None, 0, False, direct=True)
        for slot in self._slots:
            if slot.request is not None and not slot.decoding and slot.filled == 0 and slot.caches is None:
                slot.direct = True
        with self._alone([i for i, s in enumerate(self._slots) if s.direct and not s.decoding]):
            budget = self._prefill_rows(budget)
        for i, s in enumerate(self._slots):
            if s.direct and not s.decoding and s.request is not None and s.filled == len(s.request.prompt) - 1:
                with self._alone([i]):
                    self._activate(i, s)
        return budget

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
            sig = PREFILL_BATCH.format(n)
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
        length plus the shortest length again (a call reads all the weights once, however short)."""
        plan = _plan(count, tuple(self.lengths))
        done = 0
        for n in plan:
            take = min(n, count - done)
            yield take, n
            done += take

    def _activate(self, i: int, slot: _Slot) -> None:
        """Inserts a prefilled request into the batch: slot ``i``'s cache and state."""
        r, p = slot.request, slot.request.params
        seed = 0 if p.seed is None else int(p.seed)
        row = (np.int32(r.prompt[-1]), np.int32(len(r.prompt) - 1),
               np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32), np.float32(p.temperature),
               np.int32(p.top_k or 0), np.float32(1.0 if p.top_p is None else p.top_p))
        if slot.direct:  # its cache rows are in place already
            self._state = self._set_row(self._state, self._put(np.int32(i)), self._put(row))
        else:
            self._state, self._caches = self._insert(self._state, self._caches, slot.caches,
                                                     self._put(np.int32(i)), self._put(row))
        slot.caches, slot.decoding = None, True

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
                slot.request._finish("error", error)
                self._slots[i] = _Slot()
        if self._stopping or self._halted:
            with self._cv:
                left = list(self._waiting) + list(self._inbox)
                self._waiting.clear()
                self._inbox.clear()
            for r in left:
                r._finish("error", error)
        self._state = self._put(_state_rows(self.slots))


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


def _cache_shardings(runner, cache_names: list[str], default) -> tuple:
    """The sharding of each cache input of ``runner``'s program (its plan's), or ``default``."""
    by_name = dict(zip([s.name for s in runner.inputs], runner._input_shardings or ()))
    return tuple(by_name.get(n, default) for n in cache_names)


def _state_rows(slots: int):
    return (np.zeros(slots, np.int32), np.zeros(slots, np.int32), np.zeros((slots, 2), np.uint32),
            np.zeros(slots, np.float32), np.zeros(slots, np.int32), np.ones(slots, np.float32))


def _set_row(state, slot, row):
    return tuple(s.at[slot].set(v) for s, v in zip(state, row))


def _insert(state, caches, slot_caches, slot, row):
    import jax
    state = tuple(s.at[slot].set(v) for s, v in zip(state, row))
    caches = tuple(jax.lax.dynamic_update_slice_in_dim(c, s, slot, axis=0) for c, s in zip(caches, slot_caches))
    return state, caches


def sample(logits, key, temperature, top_k, top_p):
    """The next token from ``logits [vocab]`` on the device: argmax at temperature 0, else a draw from
    the tempered distribution restricted to the ``top_k`` most likely tokens (0: all) and the smallest
    set whose probability reaches ``top_p``."""
    import jax
    import jax.numpy as jnp
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)
    ranked = scaled[order]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(jnp.arange(vocab) < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked)
    keep = (jnp.cumsum(probs) - probs) < top_p  # the smallest prefix reaching top_p (the first always kept)
    filtered = jnp.full_like(scaled, -jnp.inf).at[order].set(jnp.where(keep, ranked, -jnp.inf))
    drawn = jax.random.categorical(key, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits).astype(jnp.int32))
