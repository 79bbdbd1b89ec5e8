"""LLMs: a causal LM from transformers (a local folder or a factory), wrapped once with a KV cache of the
project's own, exported as prefill and decode programs for any target (``tte.export_llm`` in
:mod:`torchtpu_export.api`).

- :mod:`.contract`: signature names, the cache layout, step inputs, prefill chunks (what targets and the
  serving engine read);
- :mod:`.text`: the tokenizer, special tokens and chat template an artifact carries;
- :mod:`.source`: loading a model folder (checked first, :mod:`.hf_folder`), a factory or a model object;
- :mod:`.step`: :class:`CacheStep`, the transformers model with the step's cache in place of its own;
- :mod:`.paged`: attention over a paged cache as one op (``tte::paged_attention``);
- :mod:`.host`: the host loop, the reference that drives any target's programs.

So no architecture is re-authored: one that transformers builds from these blocks works.
"""
from .contract import (CacheLayout, cache_shardings, mixed_inputs, paged_inputs, prefill_chunks, slot_inputs,
                       step_inputs)
from .host import HostLoop, host_generate, next_token_logits
from .plan import (DECODE, DECODE_BATCH, DECODE_BUCKET, DECODE_PAGED, DECODE_PAGED_BUCKET, DECODE_PAGED_ONE, MIXED_CHUNKS,
                   MIXED_PAGED, MIXED_PAGED_BLOCKS, MIXED_PAGED_BUCKET, PREFILL, PREFILL_BATCH, PREFILL_PAGED,
                   PREFILL_PAGED_BUCKET, StepPlan, mixed_chunks)
from .source import LlmSource, load_source
from .step import CacheStep
from .text import LlmTokenizer, parts_template

__all__ = ["DECODE", "DECODE_BATCH", "DECODE_BUCKET", "DECODE_PAGED", "DECODE_PAGED_BUCKET", "DECODE_PAGED_ONE",
           "MIXED_CHUNKS", "MIXED_PAGED", "MIXED_PAGED_BLOCKS", "MIXED_PAGED_BUCKET", "PREFILL", "PREFILL_BATCH",
           "PREFILL_PAGED", "PREFILL_PAGED_BUCKET", "CacheLayout", "CacheStep", "HostLoop", "LlmSource", "LlmTokenizer",
           "StepPlan", "cache_shardings", "host_generate", "load_source", "mixed_chunks", "mixed_inputs",
           "next_token_logits", "paged_inputs", "parts_template", "prefill_chunks", "slot_inputs", "step_inputs"]
