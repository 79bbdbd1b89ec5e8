"""The step wrapper: :class:`CacheStep` runs the transformers model itself (its embeddings, RoPE variant,
norms, attention, tied head and logit transforms) and replaces only its cache with the step's cache tensors
(the ``Cache.update`` protocol), writing a step of ``N`` tokens contiguously from ``input_pos[0]``
(LiteRT-LM pads a prefill chunk with zeros: a write per token at its own position would send the padding to
slot 0). The attention mask is an input; sliding-window layers mask further by position."""
from __future__ import annotations

import functools
import inspect
import re

import torch

from ..errors import InputError
from .adapt import adapted
from .contract import CacheLayout, state_name
from .paged import gather_pages


class _CacheProtocol:
    """What transformers' layers ask of any cache beside their own reads and writes: no past kept for
    cropping, no token count (positions are given), no intermediate scan states."""

    is_compileable = True

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        return 0

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass


class _StepCache(_CacheProtocol):
    """The transformers ``Cache`` protocol over the step's cache tensors: ``update`` writes a layer's new
    keys and values contiguously from ``start`` and gives the whole cache to attend over.

    A recurrent layer's states (transformers' linear-attention protocol: ``get_conv_state`` /
    ``update_conv_state``, ``get_recurrent_state`` / ``update_recurrent_state``) are always there: a
    sequence's first step finds zeros, which is what a fresh state is (a convolution's zero left context, a
    scan's zero initial state), so prefill chunks and decode steps alike continue from the state they get.
    The model updates some in place: each is a copy of the step's input, given back as the output."""

    def __init__(self, caches: dict, layout: CacheLayout, input_pos, slots: bool, sequential=frozenset(),
                 padded: bool = False, table=None, packed: bool = False):
        kv = set(layout.attention_layers())
        self.table = None if table is None else table.to(torch.int64)  # paged: [B, C / page] pool pages
        self.packed = packed  # one sequence [1, T] of tokens of several rows: token t is row t of table and pos
        self.sequential = sequential
        self.k = [caches[f"kv_cache_k_{i}"] if i in kv else None for i in range(layout.layers)]
        self.v = [caches[f"kv_cache_v_{i}"] if i in kv else None for i in range(layout.layers)]
        self.states = {name: caches[name].clone() for name, _, _ in layout.states}
        self.pos, self.slots = input_pos.to(torch.int64), slots
        n = self.pos.shape[0]
        self.real = None
        if padded and layout.states and not slots:
            # LiteRT-LM keeps its cache buffers from one session to the next: a sequence's first step (at
            # position 0) starts from zero states, whatever the buffers hold
            first = self.pos[0] == 0
            self.states = {name: torch.where(first, torch.zeros_like(state), state)
                           for name, state in self.states.items()}
            if n > 1:  # a padded chunk (LiteRT-LM's last: token 0 at position 0 after the real tokens): the real
                # tokens are the rows at their position, ``real`` of them (a tensor: one graph, every count)
                self.real = (self.pos == self.pos[0] + torch.arange(n, dtype=torch.int64)).to(torch.int64).sum()

    def _write(self, cache, new):
        new = new.to(cache.dtype)
        if self.packed:  # [1, heads, T, dim] -> T rows of one token each
            new = new.permute(2, 1, 0, 3)
        if self.table is not None:
            return self._write_pages(cache, new)
        if self.slots:  # each slot (batch row) from its own start (positions past the cache are dropped):
            # cache[row, :, pos] = new, a scatter of (heads, dim) windows, one per row and position. An
            # element-wise scatter (Tensor.scatter) makes XLA relayout the whole cache, layer by layer
            b, h, n, d = new.shape
            pos = self.pos.view(b, 1) + torch.arange(n, dtype=torch.int64).view(1, n)
            rows = torch.arange(b, dtype=torch.int64).view(b, 1).expand(b, n)
            return torch.ops.aten.index_put(cache, [rows, None, pos], new.transpose(1, 2))
        return cache.index_copy(2, self.pos[0] + torch.arange(new.shape[2], dtype=torch.int64), new)

    def _write_pages(self, pool, new):
        """A paged cache (``pool [heads, pages, page, dim]``): row ``b``'s position ``p`` is slot ``p % page`` of
        pool page ``table[b, p // page]``, written as the slots' step writes (a (heads, dim) window per row and
        position). Page 0 is no sequence's (``llm.contract.paged_inputs``): rows taking no part point there,
        and so do positions past the cache's end (a chunk's padding)."""
        b, h, n, d = new.shape
        page = pool.shape[2]
        pos = self.pos.view(b, 1) + torch.arange(n, dtype=torch.int64).view(1, n)
        pages = self.table.shape[1]
        where = self.table.gather(1, torch.clamp(pos // page, max=pages - 1))
        where = torch.where(pos < pages * page, where, torch.zeros_like(where))
        return torch.ops.aten.index_put(pool, [None, where, pos % page], new.permute(1, 0, 2, 3))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """The layer's new keys and values written; the whole cache to attend over (a paged cache: its pools,
        which :func:`grouped_attention` reads through the page table)."""
        self.k[layer_idx] = self._write(self.k[layer_idx], key_states)
        self.v[layer_idx] = self._write(self.v[layer_idx], value_states)
        if self.table is not None:
            _PAGED["pools"].update((id(self.k[layer_idx]), id(self.v[layer_idx])))
            _PAGED["updates"] += 1
        return self.k[layer_idx], self.v[layer_idx]

    # the linear-attention protocol (transformers' ``Cache``): recurrent layers' states
    def _state(self, kind: str, layer_idx: int, state_idx: int):
        name = state_name(kind, layer_idx, state_idx)
        if name not in self.states:
            raise InputError(f"layer {layer_idx} keeps a {kind} state the cache probe did not see")
        return name

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.states[self._state("conv", layer_idx, state_idx)]

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        """The step's inputs after the kept ones (the convolution's left context); the last of them kept."""
        name = self._state("conv", layer_idx, state_idx)
        kept = self.states[name]
        width = kept.shape[-1]
        full = torch.cat([kept.to(conv_states.dtype), conv_states], dim=-1)
        if self.real is None:
            self.states[name] = full[..., -width:].to(kept.dtype)
        else:  # the ``width`` inputs up to the last real token
            window = self.real + torch.arange(width, dtype=torch.int64)
            self.states[name] = full.index_select(-1, window).to(kept.dtype)
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.states[self._state("ssm", layer_idx, state_idx)]

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        name = self._state("ssm", layer_idx, state_idx)
        if isinstance(recurrent_states, torch.Tensor):
            last = recurrent_states
        elif self.real is None:
            last = recurrent_states[-1]
        else:  # the state after each token (all of them: ``get_recurrent_states_to_keep``): the last real one's
            every = torch.stack(list(recurrent_states))
            last = every.index_select(0, (self.real - 1 + len(every) - self.pos.shape[0]).reshape(1))[0]
        self.states[name] = last.to(self.states[name].dtype)
        return self.states[name]

    def get_recurrent_states_to_keep(self, layer_idx=None) -> int:
        """0 (the chunked scan, from the state given), but for layers whose chunked scan starts from zeros
        whatever the state (``SEQUENTIAL_SCAN``), and in a padded chunk, where the state wanted is the one
        after the last real token: every token through the recurrent form, each state kept."""
        return 1 << 30 if layer_idx in self.sequential or self.real is not None else 0

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return True


# mixers whose multi-token scan in transformers ignores the state it is given (Mamba's
# ``mamba_selective_scan`` starts from zeros: right for a prompt's first chunk only)
SEQUENTIAL_SCAN = re.compile(r"^(Mamba|FalconMamba)Mixer$")


def sequential_layers(model) -> frozenset:
    """The layer indices of ``model``'s ``SEQUENTIAL_SCAN`` mixers."""
    return frozenset(m.layer_idx for m in model.modules()
                     if SEQUENTIAL_SCAN.match(type(m).__name__) and isinstance(getattr(m, "layer_idx", None), int))


class _Recorder(_CacheProtocol):
    """The ``Cache`` protocol that keeps nothing: it notes the shape of each layer's keys and values, and of
    each recurrent state a layer keeps (its shape without the batch, its dtype)."""

    def __init__(self):
        self.shapes: dict = {}
        self.states: dict = {}  # (kind, layer, index) -> (shape, dtype)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.shapes[layer_idx] = ((key_states.shape[1], key_states.shape[3]),
                                  (value_states.shape[1], value_states.shape[3]))
        return key_states, value_states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        width = conv_kernel_size or conv_states.shape[-1]
        self.states[("conv", layer_idx, state_idx)] = ((*conv_states.shape[1:-1], width), conv_states.dtype)
        return conv_states

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        self.states[("ssm", layer_idx, state_idx)] = (tuple(last.shape[1:]), last.dtype)
        return last

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return False


def probe_layout(model, length: int, dtype: str = "float32") -> CacheLayout:
    """The cache layout the model itself writes: one token through it (on the meta device when its weights
    are abstract), each layer's keys and values noted as they reach the cache. Falls back to the config's
    numbers (``CacheLayout.of``) when the model cannot run such a probe."""
    guess = CacheLayout.of(model.config, length, dtype)
    recorder = _Recorder()
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    meta = any(p.is_meta for p in model.parameters())
    device = torch.device("meta") if meta else None
    mask = torch.zeros(1, 1, 1, 1, device=device)
    try:
        with torch.no_grad(), adapted(model):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                  attention_mask=layer_masks(model.config, mask),
                  position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True, **{kw: recorder})
    except Exception as e:  # noqa: BLE001 - a model the probe cannot drive: the config's numbers
        if recorder.states:  # a recurrent model's states cannot be guessed from its config
            raise InputError(f"the cache probe of this {type(model).__name__} failed ({type(e).__name__}: {e}): "
                             "its recurrent layers' states are not known") from None
        return guess
    states = tuple((state_name(kind, layer, index), tuple(shape), str(dt).removeprefix("torch."))
                   for (kind, layer, index), (shape, dt) in sorted(recorder.states.items(), key=lambda kv: kv[0][1:]))
    layers = {layer for _, layer, _ in recorder.states} | set(recorder.shapes)
    types = getattr(model.config, "layer_types", None) or getattr(model.config, "layers_block_type", None)
    missing = [i for i in range(guess.layers) if i not in layers]  # layers the probe did not see keep a cache
    if missing and not (states and isinstance(types, (list, tuple)) and len(types) == guess.layers
                        and all(types[i] in CACHELESS_TYPES for i in missing)):  # unless they are feed-forward only
        return guess
    shapes = tuple(recorder.shapes.get(i) for i in range(guess.layers))
    if not states and all(s == ((guess.kv_heads, guess.head_dim),) * 2 for s in shapes):
        return guess
    return CacheLayout(guess.layers, guess.kv_heads, guess.head_dim, length, dtype, shapes, states)


# layer types of hybrid models whose layers keep no cache and no state (Nemotron-H's feed-forward layers)
CACHELESS_TYPES = ("mlp", "moe")

# layer types (``config.layer_types``) whose layers do not attend (linear attention, Mamba, short
# convolutions, a feed-forward layer alone): they take no mask, as a step's tokens are never padding
UNMASKED_TYPES = ("linear_attention", "conv", "mamba", "mlp", "moe")


def layer_masks(config, mask, sliding=None):
    """The attention mask the model takes: ``mask`` as it is, or for a model with several layer types (its
    config's ``layer_types``) one per type: ``sliding`` for sliding-window layers, None for layers that do
    not attend (recurrent layers, which would read a 2-D padding mask), and None for a model none of whose
    layers attends (Mamba)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return mask if sliding is None else sliding  # sliding_window without layer types: every layer slides
    if all(t in UNMASKED_TYPES for t in types):
        return None
    # the types a model's forward looks up may be other than its layer types (falcon_h1's "hybrid" layers
    # take the "full_attention" and "linear_attention" masks)
    named = set(types) | {"full_attention", "linear_attention"}
    return {t: (sliding if t == "sliding_attention" and sliding is not None else
                None if t in UNMASKED_TYPES else mask) for t in named}


class CacheStep(torch.nn.Module):
    """One step of ``N`` tokens: ``(tokens [1,N] int32, input_pos [N] int32, mask [1,1,N,C] f32, caches)``
    → ``{"logits" [1,N,V] (decode only), caches}``, the caches updated under their own names. Given
    ``embeddings [1,N,D]`` instead of ``tokens``, the model takes them as its input embeddings (a VLM's
    steps: the runtime merges an image's rows into the prompt's).

    With ``padded`` (steps as LiteRT-LM drives them: it pads a prompt's last chunk, and keeps its cache
    buffers from one sequence to the next), a chunk's recurrent states are kept as they were after its last
    real token, and a step at position 0 starts from zero states.

    With ``slots`` (batched steps for serving), each batch row is a separate sequence:
    ``(tokens [B,N], input_pos [B] (each row's first position), mask [B,1,N,C], caches [B,...])``; writes
    past the cache's end are dropped (the engine parks rows that take no part at position C). ``first``: the
    Given a ``page_table [B, C / page]`` input as well (``llm.contract.paged_inputs``), each cache is a pool of
    pages shared by the rows (``[heads, pages, page, dim]``) and each row's positions are in its table's pages.
    With ``lanes`` (a packed mixed step, ``llm.contract.mixed_inputs``), the step is one sequence of tokens
    of several rows: ``lanes`` decode tokens, each of its own page table row and position, then blocks of
    prompt tokens, one per remaining table row; the logits are the lanes' (``[1, lanes, V]``).

    ``image`` (``(token id, bidirectional)``, a VLM on the tpu target): the step takes ``image_rows [1,N,D]``
    beside its tokens, and puts row ``i`` in where token ``i`` is the image token (transformers' merge); with
    ``bidirectional``, the rows of one image (a run of image tokens, all in this step) attend to one another,
    as transformers' Gemma 3 reads them (``token_type_ids``)."""

    def __init__(self, model, layout: CacheLayout, logits: bool, slots: bool = False, padded: bool = False,
                 lanes: int | None = None, image_end=None, lora=None, image=None):
        super().__init__()
        self.model, self.layout, self.logits, self.slots, self.padded = model, layout, logits, slots, padded
        self.lanes = lanes
        self.lora = lora  # an llm.lora.LoraLayout: the step takes a LoRA adapter's inputs too
        # a VLM's (llm.vision.VisionParts.image_end): the embedding row that closes an image's rows
        self.image_end = image_end
        self.image = image
        config = model.config
        self.window = getattr(config, "sliding_window", None)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" in params
        self.sequential = sequential_layers(model) if layout.states else frozenset()

    def _masks(self, mask, positions):
        """The full-attention mask as given, and, where the config has sliding-window layers, theirs
        (``positions`` [B, N]: each query's position)."""
        sliding = None
        if self.window:
            kv_pos = torch.arange(self.layout.length, dtype=torch.int64)
            far = (positions.to(torch.int64)[:, :, None] - kv_pos) >= self.window
            sliding = torch.where(far[:, None], torch.finfo(mask.dtype).min, mask)
        return layer_masks(self.model.config, mask, sliding)

    def forward(self, tokens=None, input_pos=None, mask=None, **caches):
        table = caches.pop("page_table", None)
        embeddings = caches.pop("embeddings", None)  # instead of tokens: a VLM's, image rows merged
        image_rows = caches.pop("image_rows", None)
        adapter = {n: caches.pop(n) for n in self.lora.names()} if self.lora is not None else None
        n = (tokens if tokens is not None else embeddings).shape[1]
        lanes = self.lanes
        rows = table
        if lanes is not None:  # packed: token t is written as a row of its own (a block's tokens: its row's pages)
            blocks, pages = table.shape[0] - lanes, table.shape[1]
            rows = torch.cat([table[:lanes], table[lanes:, None].expand(blocks, (n - lanes) // blocks, pages)
                              .reshape(n - lanes, pages)])
        cache = _StepCache(caches, self.layout, input_pos, self.slots, self.sequential, self.padded, rows,
                           packed=lanes is not None)
        positions = input_pos[:, None] + torch.arange(n, dtype=input_pos.dtype) if self.slots else input_pos[None]
        if lanes is not None:
            positions = input_pos[None]  # [1, T]: each token's own
        if table is not None:  # paged: causal by position (each row's pages hold its own positions only)
            visible = torch.arange(self.layout.length)[None, None, :] <= positions.to(torch.int64)[:, :, None]
            mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]
            _PAGED.update(table=table, start=input_pos, mask=mask, pools=set(), updates=0, attended=0, lanes=lanes)
        if embeddings is not None and self.image_end is not None:
            mask = image_end_causal(mask, embeddings, positions, self.image_end)
        if image_rows is not None:
            token_id, bidirectional = self.image
            is_image = tokens[0] == token_id  # [N]
            text = self.model.get_input_embeddings()(torch.where(is_image, 0, tokens).to(torch.int64))
            embeddings, tokens = torch.where(is_image[None, :, None], image_rows.to(text.dtype), text), None
            if bidirectional:
                mask = images_open(mask, is_image, positions)
        _GROUP_MASKS.clear()  # each trace of a step makes its own
        try:
            keep = {"logits_to_keep": torch.arange(lanes, dtype=torch.int64)} if lanes and self.keep_kw else {}
            with adapted(self.model), lora_applied(self.model, self.lora, adapter):
                given = dict(input_ids=tokens) if embeddings is None else dict(inputs_embeds=embeddings)
                out = self.model(**given, attention_mask=self._masks(mask, positions),
                                 position_ids=positions, use_cache=True, **{self.cache_kw: cache}, **keep)
            if table is not None and _PAGED["attended"] != _PAGED["updates"]:
                raise InputError(f"{type(self.model).__name__} attends to its cache outside transformers' attention "
                                 "interface: a paged cache cannot be read there", hint="export without kv_pages")
        finally:
            _GROUP_MASKS.clear()
            _PAGED.clear()
        result = {"logits": out.logits[:, :lanes] if lanes else out.logits} if self.logits else {}
        for i in self.layout.attention_layers():
            result[f"kv_cache_k_{i}"], result[f"kv_cache_v_{i}"] = cache.k[i], cache.v[i]
        result.update(cache.states)
        return result


def lora_applied(model, layout, weights):
    """``llm.lora.applied`` where the step has a LoRA layout, else nothing."""
    import contextlib
    if layout is None:
        return contextlib.nullcontext()
    from .lora import applied
    return applied(model, layout, weights)


def image_end_causal(mask, embeddings, positions, end):
    """``mask [1, 1, N, C]`` with the rows equal to ``end`` (``[D]``) kept causal both ways: LiteRT-LM's
    vision-bidirectional mask opens each image's rows to one another, the adapter's closing row (Gemma 3's
    ``<end_of_image>``) among them, which transformers' model reads as text (``token_type_ids`` 0). Rows are
    matched by value within 1e-5 of the row's scale, as transformers finds image rows among embeddings."""
    end = end.to(embeddings.dtype)
    scale = end.abs().max().clamp(min=1e-30)
    is_end = ((embeddings[0] - end).abs().amax(-1) <= 1e-5 * scale)  # [N]
    pos = positions[0].to(torch.int64)  # [N]
    kv = torch.arange(mask.shape[-1], dtype=torch.int64)
    end_at = ((kv[None, :] == pos[:, None]) & is_end[:, None]).any(0)  # [C]: positions of closing rows here
    later = kv[None, :] > pos[:, None]
    shut = later & (is_end[:, None] | end_at[None, :])
    return torch.where(shut[None, None], torch.finfo(mask.dtype).min, mask)


def images_open(mask, is_image, positions):
    """``mask [1, 1, N, C]`` with each image's rows (a run of ``is_image [N]``) open to one another both ways, as
    transformers' ``get_block_sequence_ids_for_mask`` groups them; the rest as it was."""
    before = torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]])
    block = torch.cumsum((is_image & ~before).to(torch.int64), 0)
    block = torch.where(is_image, block, torch.zeros_like(block))  # [N]: 1, 2, ... per image, 0 for text
    kv = torch.arange(mask.shape[-1], dtype=torch.int64)
    at = kv[None, :] == positions[0].to(torch.int64)[:, None]  # [N, C]: token i's cache position
    key_block = (at.to(torch.int64) * block[:, None]).sum(0)  # [C]: the image block written there (0: none)
    same = (block[:, None] == key_block[None, :]) & (block[:, None] > 0)
    return torch.where(same[None, None], torch.zeros((), dtype=mask.dtype), mask)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      **kwargs):
    """transformers' attention (the ``AttentionInterface`` signature) with grouped-query heads computed per
    group: the queries of a group are stacked against their shared key/value head, so the cache is read
    as it is, never repeated to every query head (``repeat_kv`` copies the whole cache per layer and step).
    Attention sinks (gpt-oss's ``s_aux``: a learned logit per query head that takes part in the softmax and
    attends to nothing) are one more column of the scores, dropped after the softmax, as transformers'
    eager attention does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    if _PAGED and id(key) in _PAGED["pools"]:  # a paged step's pools
        _PAGED["attended"] += 1
        causal = attention_mask is _PAGED["mask"] and softcap is None and sinks is None  # one paged attention op
        table, start, lanes = _PAGED["table"], _PAGED["start"], _PAGED["lanes"]
        attend = functools.partial(_paged, module, key_pages=key, value_pages=value, causal=causal, dropout=dropout,
                                   scaling=scaling, softcap=softcap, **kwargs)
        if lanes is None:
            return attend(query, mask=attention_mask, table=table, start=start).contiguous(), None
        # packed: the decode lanes as rows of one query each (queries and mask rows [1, h, lanes, .] as [lanes, h,
        # 1, .]), then the blocks of prompt tokens as rows of theirs
        m, blocks = attention_mask, table.shape[0] - lanes
        lane = attend(query[:, :, :lanes].transpose(0, 2), table=table[:lanes], start=start[:lanes],
                      mask=None if m is None else m[:, :, :lanes].transpose(0, 2))
        size = (query.shape[2] - lanes) // blocks
        chunk = attend(_blocks(query, lanes, blocks), table=table[lanes:], start=start[lanes::size],
                       mask=None if m is None else _blocks(m, lanes, blocks))  # [blocks, size, heads, dim]
        return torch.cat([lane.transpose(0, 1), chunk.flatten(0, 1)[None]], dim=1).contiguous(), None
    if key.dtype != query.dtype:  # a bf16 cache under a float32 trace (the bf16 recipe makes it all bf16)
        key, value = key.to(query.dtype), value.to(query.dtype)
    b, heads, n, d = query.shape
    groups, length = key.shape[1], key.shape[2]
    rep = heads // groups
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, groups, rep * n, d)  # head g * rep + r, as repeat_kv orders them
    mask = None if attention_mask is None else _group_mask(attention_mask, rep, length)
    if softcap is None and sinks is None:  # one fused attention node: the converters read the cache as it is
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(q, key.transpose(2, 3)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores + mask
        if sinks is not None:  # per query head, in the stacked order (head g * rep + r, each n rows)
            column = sinks.to(scores.dtype).reshape(1, groups, rep, 1, 1).expand(b, groups, rep, n, 1)
            scores = torch.cat([scores, column.reshape(b, groups, rep * n, 1)], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1)
        if sinks is not None:
            probs = probs[..., :-1]
        out = torch.matmul(probs.to(query.dtype), value)
    return out.reshape(b, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None  # v's dim may differ (MLA)


def _blocks(x, lanes: int, blocks: int):
    """``x [1, h, lanes + N, ...]`` (a packed step's queries or mask rows): its last N as ``blocks`` rows of
    ``N / blocks`` (``[blocks, h, N / blocks, ...]``)."""
    part = x[0, :, lanes:]
    return part.reshape(part.shape[0], blocks, part.shape[1] // blocks, *part.shape[2:]).transpose(0, 1)


def _paged(module, query, *, key_pages, value_pages, mask, table, start, causal: bool, dropout, scaling, softcap,
           **kwargs):
    """Attention of ``query [b, heads, n, dim]`` over the rows ``table [b, T]`` of a paged step's pools, from
    positions ``start [b]`` → ``[b, n, heads, dim]``: one paged attention op where it is causal, else the pages
    gathered under the mask (its rows ``[b, h, n, C]``)."""
    if causal:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.ops.tte.paged_attention(query, key_pages, value_pages, table, start, scale)
        return out.transpose(1, 2)
    return grouped_attention(module, query, gather_pages(key_pages, table), gather_pages(value_pages, table), mask,
                             dropout, scaling, softcap, **kwargs)[0]


# (id(mask), rep, length) -> (mask, the mask for stacked query heads): made once per traced step and shared by
# every layer given the same mask, not once per layer (on a 1B Llama's int8 prefill in LiteRT-LM, a mask
# per layer took half the time).
_GROUP_MASKS: dict = {}


def _group_mask(attention_mask, rep: int, length: int):
    """``attention_mask [B, 1, n, C]`` for the stacked queries of a group (``[B, 1, rep * n, length]``: the
    same rows for every query head of the group); a mask per query head ``[B, heads, n, C]`` for each group's
    own (``[B, groups, rep * n, length]``)."""
    key = (id(attention_mask), rep, length)  # unique while the entry holds the mask
    if key in _GROUP_MASKS:
        return _GROUP_MASKS[key][1]
    m = attention_mask[..., :length]
    b, heads, n = m.shape[0], m.shape[1], m.shape[2]
    if heads > 1:  # a mask per query head (Doge's dynamic mask): head g * rep + r is row block r of group g
        mask = m.reshape(b, heads // rep, rep * n, length)
    else:
        mask = m.unsqueeze(2).expand(b, 1, rep, n, length).reshape(b, 1, rep * n, length)
    if not torch.compiler.is_dynamo_compiling():  # strict export traces the Python: no memo by identity there
        _GROUP_MASKS[key] = (attention_mask, mask)
    return mask


# while a paged step is traced: its page table, first positions, causal mask, and the pools its cache gave the
# layers (by id), with the count of cache updates and of attentions that read them
_PAGED: dict = {}

_ATTENTION = "tte_grouped"


class grouped_attention_in:
    """Within it, ``model`` (and its sub-configs) attends with :func:`grouped_attention`."""

    def __init__(self, model):
        self.configs = [c for c in _configs(model.config) if hasattr(c, "_attn_implementation")]

    def __enter__(self):
        from transformers import AttentionInterface
        AttentionInterface.register(_ATTENTION, grouped_attention)
        self.saved = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = _ATTENTION
        return self

    def __exit__(self, *exc):
        for c, impl in zip(self.configs, self.saved):
            c._attn_implementation = impl


def _configs(config):
    yield config
    for key in ("text_config", "decoder"):
        sub = getattr(config, key, None)
        if sub is not None and sub is not config:
            yield sub
