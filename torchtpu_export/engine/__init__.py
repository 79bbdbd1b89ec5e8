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
  takes the next waiting request at the following step;
- a light load steps through a smaller batch of the same step: the busy rows taken out of the batch's
  (the one-slot ``decode`` for one request, ``decode_batch_<b>`` for up to ``b``; exported for ``b`` = 4,
  16, ... below ``B`` by default), put back when the load outgrows it: a light load never pays for idle
  slots;
- prefix caching (:mod:`.prefix`): the KV cache of prefilled prompts' full pages stays in a page pool on
  the device, keyed by a hash chain of their tokens; a prompt starting with cached pages gets them copied
  into its own cache and prefills only the rest;
- a program exported with a paged KV cache (``tte.export_llm(..., kv_pages=P)``: ``decode_paged``,
  ``prefill_paged_<N>``) gets a :class:`PagedEngine` (:mod:`.paged`): one pool of pages shared by the
  rows, memory for live tokens, cached prefix pages read in place, a request admitted when its prompt
  fits and preempted (its pages kept, its state saved) when the pool runs short; on TPU, attention over
  the pages fetches only each row's live pages (JAX's paged attention kernel for decode rows, ours for
  prompt chunks and blocks).

:class:`Engine` runs in a thread of its own (``start``) for servers, or step by step in the caller's
thread (``generate``, tests). Nothing else runs these programs: no Python model code is needed.

A program sharded over several processes (JAX's multi-controller runtime, one process per host) has one
engine per process: process 0 takes the requests and broadcasts them at the start of each step, the
others run the same steps (``follow``), so that all call the same programs in the same order; the tokens
a step samples are replicated, so every process sees them.

The parts: :mod:`.request` (:class:`Request`, :class:`SamplingParams`), :mod:`.step` (the jitted device
calls and :func:`sample`), :mod:`.prefix` (the prefix cache's index, the paged cache's pages),
:mod:`.paged` (:class:`PagedEngine`; its policy of rows and pages without JAX, :mod:`.paged_policy`),
:mod:`.scheduler` (:class:`Engine`:
admission, prefill budget, slots, the loop, the start of each step), :mod:`.follow` (each step's events
broadcast to the other processes) and :mod:`.session` (an LLM file's engine, text workers and grammars, as
``serve`` and ``generate`` use them).
"""
from .paged import PagedEngine
from .request import Request, SamplingParams
from .scheduler import Engine
from .step import sample

__all__ = ["Engine", "PagedEngine", "Request", "SamplingParams", "sample"]
