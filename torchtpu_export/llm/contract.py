"""The contract between an LLM's exported programs and whoever runs them (LiteRT-LM, the serving engine, the
host loop): the cache layout (``kv_cache_k_<i>`` / ``kv_cache_v_<i>``, ``[B, kv_heads, C,
head_dim]``; a recurrent layer's states ``kv_cache_c_<i>`` / ``kv_cache_c_ssm_<i>``), a step's inputs, and how
a prompt is cut into prefill chunks. Targets and the engine read it; it imports no target."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..errors import InputError

@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The KV cache of a model's steps: per layer a key and a value tensor ``[B, heads, C, dim]``. ``shapes``
    (per layer, ``((key heads, key dim), (value heads, value dim))``) is what the model itself writes, found
    by :func:`llm.step.probe_layout`: multi-query attention's one head, multi-head latent attention's
    compressed latents (DeepSeek: the latent as "key", the rotary part as "value"), per-layer head counts.
    Without it every layer has ``kv_heads`` heads of ``head_dim`` (the config's).

    A layer with a recurrent state (a Mamba mixer, a gated delta net, LFM2's short convolution) has no KV
    cache (``shapes[i]`` is None) and carries its states instead: ``states`` holds ``(name, shape, dtype)``
    per state tensor (``shape`` without the batch), a convolution's last inputs (``kv_cache_c_<i>``) and
    a state-space or linear-attention state (``kv_cache_c_ssm_<i>``), as the model itself keeps them. A step
    reads and replaces them; a sequence starts from zeros, and its prompt is never padded
    (:func:`prefill_chunks` with ``exact``): a padding token would move the state. LiteRT-LM bundles are the
    exception: LiteRT-LM pads a prompt's last chunk, and their steps find the real tokens themselves
    (``llm.step.CacheStep`` with ``padded``)."""
    layers: int
    kv_heads: int
    head_dim: int
    length: int  # C: positions the cache holds
    dtype: str = "float32"  # bfloat16 for tpu programs of the bf16 recipe
    shapes: tuple = ()
    states: tuple = ()

    def shape(self, name: str, batch: int = 1) -> tuple:
        """The cache tensor ``name``'s shape (``kv_cache_k_<i>`` / ``kv_cache_v_<i>``, or a state)."""
        for state, shape, _ in self.states:
            if state == name:
                return (batch, *shape)
        if not self.shapes:
            return (batch, self.kv_heads, self.length, self.head_dim)
        kind, layer = name.split("_")[2], int(name.rsplit("_", 1)[1])
        heads, dim = self.shapes[layer][0 if kind == "k" else 1]
        return (batch, heads, self.length, dim)

    def attention_layers(self) -> list[int]:
        """The layers with a KV cache."""
        return [i for i in range(self.layers) if not self.shapes or self.shapes[i] is not None]

    @classmethod
    def of(cls, config, length: int, dtype: str = "float32") -> "CacheLayout":
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv, head_dim, length, dtype)

    def names(self) -> list[str]:
        return [f"kv_cache_{kv}_{i}" for i in self.attention_layers() for kv in "kv"] + [n for n, _, _ in self.states]

    def empty(self, dtype=None, batch: int = 1) -> dict:
        kinds = {n: d for n, _, d in self.states}
        return {n: torch.zeros(self.shape(n, batch), dtype=getattr(torch, kinds[n]) if n in kinds else
                               dtype or getattr(torch, self.dtype)) for n in self.names()}


# recurrent states are named as LiteRT-LM's executor carries them from step to step: it takes the tensors
# named kv_cache_k_*, kv_cache_v_* and kv_cache_c_* as caches (and finds a model's caches by kv_cache_k_0 or
# kv_cache_c_0). Artifacts written before 2026-12-05 named them kv_cache_conv_<i> and kv_cache_ssm_<i>.
STATE_PREFIXES = ("kv_cache_c", "kv_cache_ssm")


def state_name(kind: str, layer: int, index: int = 0) -> str:
    """A recurrent state's tensor name: ``kv_cache_c_<layer>`` for a convolution's last inputs,
    ``kv_cache_c_ssm_<layer>`` for a scan's state (``kv_cache_c_conv<index>_<layer>`` /
    ``kv_cache_c_ssm<index>_<layer>`` for a layer's further states)."""
    tag = ("ssm" if kind == "ssm" else "conv" if index else "") + (str(index) if index else "")
    return f"kv_cache_c_{tag}_{layer}" if tag else f"kv_cache_c_{layer}"


def has_state(names) -> bool:
    """Whether a step's cache tensors (by name) include recurrent states: its prompts are never padded."""
    return any(n.startswith(STATE_PREFIXES) for n in names)


def step_inputs(layout: CacheLayout, n: int, hidden: int | None = None, lora=None) -> dict:
    """Sample inputs of an ``n``-token step (the runtime's names, shapes and dtypes); with ``hidden``, the
    step takes ``embeddings [1, n, hidden]`` instead of ``tokens`` (a VLM's: image rows merged by the runtime);
    with ``lora`` (an ``llm.lora.LoraLayout``), a LoRA adapter's inputs after the caches."""
    first = dict(tokens=torch.zeros(1, n, dtype=torch.int32)) if hidden is None else \
        dict(embeddings=torch.zeros(1, n, hidden))
    return dict(**first, input_pos=torch.arange(n, dtype=torch.int32), mask=torch.zeros(1, 1, n, layout.length),
                **layout.empty(), **(lora.zeros() if lora is not None else {}))


def image_inputs(layout: CacheLayout, n: int, hidden: int) -> dict:
    """Sample inputs of an ``n``-token ``prefill_image_<n>`` step: a one-sequence step's, and ``image_rows [1,
    n, hidden]`` (row ``i`` the image's where token ``i`` is the image token, else unread)."""
    return dict(step_inputs(layout, n), image_rows=torch.zeros(1, n, hidden))


def slot_inputs(layout: CacheLayout, slots: int, n: int = 1) -> dict:
    """Sample inputs of a batched step over ``slots`` sequences (``n`` tokens each)."""
    return dict(tokens=torch.zeros(slots, n, dtype=torch.int32), input_pos=torch.zeros(slots, dtype=torch.int32),
                mask=torch.zeros(slots, 1, n, layout.length), **layout.empty(batch=slots))


def paged_inputs(layout: CacheLayout, slots: int, n: int, pages: int, page: int) -> dict:
    """Sample inputs of a paged step over ``slots`` sequences (``n`` tokens each, row ``b``'s from position
    ``input_pos[b]``): each KV cache a pool ``[heads, pages, page, dim]`` (the layout of JAX's paged attention
    kernel), and ``page_table [slots, C / page]`` int32, row ``b``'s pool page for each ``page`` positions of
    its sequence. No mask: a row attends causally to its own positions. Pool page 0 belongs to no sequence:
    rows taking no part in a step point there (and a chunk's padding past the cache's end is written there);
    it is never read unmasked."""
    pools = {name: torch.zeros((shape[1], pages, page, shape[3]), dtype=cache.dtype)
             for name, cache in layout.empty().items() for shape in [cache.shape]}
    return dict(tokens=torch.zeros(slots, n, dtype=torch.int32), input_pos=torch.zeros(slots, dtype=torch.int32),
                page_table=torch.zeros(slots, layout.length // page, dtype=torch.int32), **pools)


def mixed_inputs(layout: CacheLayout, lanes: int, n: int, pages: int, page: int, chunks: int = 1) -> dict:
    """Sample inputs of a packed mixed step (``MIXED_PAGED``) over a paged cache: ``tokens [1, lanes + n]``,
    the first ``lanes`` one decode token each (of page table row ``i``, at position ``input_pos[i]``), then
    ``chunks`` blocks of ``n / chunks`` prompt tokens, block ``j`` of page table row ``lanes + j`` at
    consecutive positions (``input_pos [lanes + n]`` is each token's position; a prompt's chunk takes one
    block or several, each with its row of pages), ``page_table [lanes + chunks, C / page]``, and the pools
    (:func:`paged_inputs`). A lane or block taking no part points at page 0. Its logits are the lanes'
    (``[1, lanes, V]``)."""
    feed = paged_inputs(layout, lanes + chunks, 1, pages, page)
    return dict(feed, tokens=torch.zeros(1, lanes + n, dtype=torch.int32),
                input_pos=torch.zeros(lanes + n, dtype=torch.int32))


def cache_shardings(layout: CacheLayout, mesh, paged=()) -> dict:
    """Each cache ``[slots, kv_heads, length, head_dim]`` split by KV head over the mesh's ``model``
    axis, when the heads divide over it (else replicated, as XLA would gather them anyway). The paged
    programs ``paged`` take each cache as a pool ``[kv_heads, pages, page, head_dim]``: split the same way
    (``"<program>:<cache>"`` keys, the converter's per-program input shardings)."""
    try:
        axes = dict(mesh.items() if hasattr(mesh, "items") else mesh)
    except (TypeError, ValueError):
        return {}  # the converter says what is wrong with the mesh
    n = axes.get("model", 1)
    if not isinstance(n, int) or n <= 1:
        return {}
    kv = [name for name in layout.names() if not has_state([name])]  # recurrent states stay whole on each chip
    shapes = {name: layout.shape(name) for name in kv}
    if all(s[1] % n == 0 for s in shapes.values()):
        split = {name: [None, "model", None, None] for name in kv}
    elif all(s[3] % n == 0 for s in shapes.values()):  # more chips than KV heads (GQA): split each head's features
        split = {name: [None, None, None, "model"] for name in kv}
    else:
        return {}
    return split | {f"{sig}:{name}": [spec[1], None, None, spec[3]] for sig in paged for name, spec in split.items()}


def prefill_chunks(count: int, lengths: Sequence[int], exact: bool = False):
    """``(start, tokens, prefill length)`` for ``count`` prompt tokens: each chunk the shortest exported
    length that holds the rest, else the longest (a short chunk is padded by the step). With ``exact``
    (a model with recurrent states) no chunk is padded: each is the longest length the rest fills
    (``lengths`` then holds 1)."""
    if exact and 1 not in lengths:
        raise InputError("a model with recurrent states needs a prefill of 1 token (prefill_1): its prompts "
                         "are never padded", hint="export it again with tte.export_llm")
    done = 0
    while done < count:
        left = count - done
        n = max(k for k in lengths if k <= left) if exact else next((k for k in lengths if k >= left), lengths[-1])
        yield done, min(n, left), n
        done += min(n, left)


@dataclasses.dataclass(frozen=True)
class Generation:
    """What an LLM artifact's ``generate`` gives, whatever the target: the text and the token ids of the
    reply (the prompt left out), and why it ended (``"stop"``: a stop token; ``"length"``:
    ``max_new_tokens``). ``text`` is None for a program that carries no tokenizer; ``str(g)`` is the text."""

    text: str | None
    ids: list[int]
    finish_reason: str

    def __str__(self) -> str:
        return self.text if self.text is not None else " ".join(map(str, self.ids))


def prompt_ids(prompt, vocab: int | None = None) -> list[int] | None:
    """The prompt as token ids when it was given as ids (a sequence of ints), None when it is text;
    anything else is refused, text that is not UTF-8 (a lone surrogate, as Python decodes bad bytes of
    a command line) too."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a tokenizer (in the tpu target's text worker) fails on it
            raise InputError(f"the prompt is not valid text (character {e.start} cannot be written as UTF-8)") \
                from None
        return None
    try:
        ids = [int(t) for t in prompt]
        bad = [t for t, i in zip(prompt, ids) if isinstance(t, bool) or t != i]
    except (TypeError, ValueError):
        bad, ids = [prompt], []
    if bad or not ids or any(i < 0 or (vocab is not None and i >= vocab) for i in ids):
        raise InputError("the prompt is text (a str) or a non-empty sequence of token ids"
                         + (f" below the vocabulary of {vocab}" if vocab else ""))
    return ids
