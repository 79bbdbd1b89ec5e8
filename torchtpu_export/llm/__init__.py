"""LLMs: a causal LM from transformers (a local folder or a factory), wrapped once with a KV cache of the
project's own, exported as prefill and decode programs for any target.

The wrapper (:class:`CacheStep`) runs the transformers model itself (its embeddings, RoPE variant, norms,
attention, tied head and logit transforms) and only replaces its cache: the caches are inputs and
outputs named ``kv_cache_k_<i>`` / ``kv_cache_v_<i>``, shaped ``[1, kv_heads, C, head_dim]``, and a step
of ``N`` tokens writes them contiguously from ``input_pos[0]`` (LiteRT-LM pads a prefill chunk with
zeros: a write per token at its own position would send the padding to slot 0). The attention mask is
an input (``[1, 1, N, C]``, 0 visible, a large negative masked); sliding-window layers mask further by
position. So no architecture is re-authored: one that transformers builds from these blocks works.

``export_llm`` is the one entry: ``target="litertlm"`` gives a :class:`~.targets.litertlm.LitertLmBundle`
(LiteRT-LM's on-device format), ``target="tpu"`` a TpuProgram with the same signatures.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
from typing import Sequence

import torch

from ..errors import InputError

# what LiteRT-LM and litert-torch call the signatures and tensors (the bundle contract)
PREFILL = "prefill_{}"
DECODE = "decode"
DECODE_BATCH = "decode_batch"  # tpu serving: one token for each of B sequences (slots), each at its own position
PREFILL_BATCH = "prefill_batch_{}"  # tpu serving: N prompt tokens for each of B slots, each row from its own start

# The runtime passes a message's content as a list of {"type": "text", "text": ...} parts; HF templates
# expect a string. This prelude joins the parts, so the model's own template works unchanged on both.
_PARTS_PRELUDE = (
    "{%- set _tte = namespace(msgs=[], text='') -%}"
    "{%- for _m in messages -%}"
    "{%- if _m['content'] is string -%}{%- set _tte.msgs = _tte.msgs + [_m] -%}"
    "{%- else -%}{%- set _tte.text = '' -%}"
    "{%- for _p in _m['content'] -%}{%- if _p['type'] == 'text' -%}{%- set _tte.text = _tte.text + _p['text'] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set _tte.msgs = _tte.msgs + [{'role': _m['role'], 'content': _tte.text}] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = _tte.msgs -%}"
)


def parts_template(template: str) -> str:
    """``template`` (an HF chat template) taking message contents as strings or lists of text parts."""
    return _PARTS_PRELUDE + template


@dataclasses.dataclass
class LlmTokenizer:
    """What a bundle needs of a tokenizer: the HF ``tokenizer.json``, the special tokens and the chat template."""

    json: str
    bos_id: int | None  # the token the tokenizer puts first (None: it puts none)
    stop_ids: list[int]
    pad_id: int | None
    chat_template: str | None

    @classmethod
    def from_dir(cls, path: str, stop_ids: Sequence[int] = ()) -> "LlmTokenizer":
        """From a Hugging Face folder: ``tokenizer.json`` (required), ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` (optional), each read only if it is a regular
        file inside the folder (:mod:`.hf_folder`)."""
        from . import hf_folder
        text = hf_folder.read_text(path, "tokenizer.json", hf_folder.MAX_TOKENIZER_BYTES)
        if text is None:
            raise InputError(f"{path} has no tokenizer.json",
                             hint="save the tokenizer there (tokenizer.save_pretrained(folder)) or pass tokenizer=; "
                                  "only fast (tokenizers-library) tokenizers can be bundled")
        config = hf_folder.read_json(path, "tokenizer_config.json") or {}
        template = hf_folder.read_text(path, "chat_template.jinja")
        if template is None:
            template = _chat_template(config.get("chat_template"), os.path.join(path, "tokenizer_config.json"))
        gen = hf_folder.read_json(path, "generation_config.json") or {}
        stops = _ids(gen.get("eos_token_id"), os.path.join(path, "generation_config.json"))
        return cls.build(text, config, template, [*stop_ids, *stops])

    @classmethod
    def build(cls, text: str, config: dict, template: str | None, stop_ids: Sequence[int]) -> "LlmTokenizer":
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:
            raise InputError(f"tokenizer.json is not a tokenizer the tokenizers library reads: {e}") from e

        def token_id(key):
            tok_str = config.get(key)
            if isinstance(tok_str, dict):
                tok_str = tok_str.get("content")
            return tok.token_to_id(tok_str) if isinstance(tok_str, str) else None

        with_special, plain = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
        bos = with_special[0] if len(with_special) > len(plain) and with_special[-len(plain):] == plain else None
        stops = list(dict.fromkeys([*stop_ids, *([token_id("eos_token")] if token_id("eos_token") is not None
                                                   else [])]))
        return cls(text, bos, stops, token_id("pad_token"), template)

    @classmethod
    def from_object(cls, tokenizer, stop_ids: Sequence[int] = ()) -> "LlmTokenizer":
        """From a transformers fast tokenizer, a ``tokenizers.Tokenizer`` or a folder path."""
        if isinstance(tokenizer, (str, os.PathLike)):
            return cls.from_dir(os.fspath(tokenizer), stop_ids)
        from tokenizers import Tokenizer
        if isinstance(tokenizer, Tokenizer):
            return cls.build(tokenizer.to_str(), {}, None, stop_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise InputError(f"tokenizer {type(tokenizer).__name__} has no tokenizer.json form",
                             hint="use a fast tokenizer (transformers' PreTrainedTokenizerFast)")
        config = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
        return cls.build(backend.to_str(), config, getattr(tokenizer, "chat_template", None), stop_ids)


def _ids(value, where: str) -> list[int]:
    """Token ids given as one id or a list (``eos_token_id``); InputError naming ``where`` otherwise."""
    if value is None:
        return []
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2 ** 31 for i in ids):
        raise InputError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r:.80}")
    return ids


def _chat_template(value, where: str) -> str | None:
    """tokenizer_config.json's ``chat_template``: a template, or named ones (the ``default`` is taken)."""
    if isinstance(value, list):
        if not all(isinstance(t, dict) for t in value):
            raise InputError(f"{where}: chat_template must be a template or a list of {{name, template}}")
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise InputError(f"{where}: chat_template must be text, got {type(value).__name__}")
    return value


# ---- loading ----------------------------------------------------------------------------------

@dataclasses.dataclass
class LlmSource:
    model: object  # a transformers causal LM (or a module with the same call), in eval mode
    tokenizer: LlmTokenizer | None
    name: str


def load_source(model_or_path, tokenizer=None, abstract: bool = False) -> LlmSource:
    """The model and tokenizer from a local Hugging Face folder, ``file.py:factory`` (returning a model
    or ``(model, tokenizer)``), or a model object. Local files only: nothing is downloaded."""
    from ..models import call_factory, is_factory

    stop_ids: list[int] = []
    if isinstance(model_or_path, torch.nn.Module):
        model, name = model_or_path, type(model_or_path).__name__
    elif isinstance(model_or_path, (str, os.PathLike)) and os.path.isdir(model_or_path):
        path = os.fspath(model_or_path)
        model, name = _load_hf_folder(path, abstract), os.path.basename(os.path.abspath(path))
        tokenizer = path if tokenizer is None else tokenizer
    elif isinstance(model_or_path, str) and is_factory(model_or_path):
        made = call_factory(model_or_path)
        model, name = (made[0], model_or_path.rpartition(":")[2]) if isinstance(made, tuple) else \
            (made, model_or_path.rpartition(":")[2])
        if isinstance(made, tuple) and tokenizer is None:
            tokenizer = made[1]
    elif isinstance(model_or_path, (str, os.PathLike)):
        raise InputError(f"{os.fspath(model_or_path)} is neither a Hugging Face model folder nor file.py:factory",
                         hint="give the folder that holds config.json, the safetensors weights and tokenizer.json")
    else:
        raise InputError(f"export_llm takes a model folder, file.py:factory or a module, "
                         f"not {type(model_or_path).__name__}")
    config = getattr(model, "config", None)
    if config is None:
        raise InputError(f"{name} has no transformers config: export_llm takes a transformers causal LM")
    stop_ids += _ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                     f"{name}'s generation config")
    stop_ids += _ids(getattr(config, "eos_token_id", None), f"{name}'s config")
    tok = LlmTokenizer.from_object(tokenizer, stop_ids) if tokenizer is not None else None
    model.eval()
    return LlmSource(model, tok, name)


def _load_hf_folder(path: str, abstract: bool = False):
    """A causal LM from config.json and its safetensors weights (local files only); with ``abstract``,
    from config.json alone, its parameters on the meta device (``capture.abstract_weights``).

    Every file is checked before transformers reads it (:mod:`.hf_folder`), and the model config.json
    describes is first built on the meta device and measured against the checkpoint's headers: a config
    that transformers cannot build, or a model the checkpoint cannot fill, is refused before anything of
    its size is allocated."""
    from . import hf_folder
    cfg_path = os.path.join(path, "config.json")
    raw = hf_folder.read_json(path, "config.json")
    if raw is None:
        raise InputError(f"{path} has no config.json: not a Hugging Face model folder",
                         hint="save the model there with model.save_pretrained(folder)")
    _check_raw_config(cfg_path, raw)
    ckpt = None if abstract else hf_folder.checkpoint(path, raw)
    if ckpt is None and not abstract:
        try:
            bins = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
        except OSError:
            bins = []
        raise InputError(f"{path} has no .safetensors weights" + (f" ({', '.join(bins)} are pickles, never loaded)"
                                                                    if bins else ""),
                         hint="save with model.save_pretrained(folder) (safetensors is its default)")
    jsons = {"config.json": raw}
    gen = hf_folder.read_json(path, "generation_config.json")
    if gen is not None:
        _ids(gen.get("eos_token_id"), os.path.join(path, "generation_config.json"))
        jsons["generation_config.json"] = gen
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # what it would warn of is checked here and said once, as an error
    try:
        return _build_from_folder(path, cfg_path, raw, jsons, ckpt, abstract)
    finally:
        hf_logging.set_verbosity_warning()


def _build_from_folder(path: str, cfg_path: str, raw: dict, jsons: dict, ckpt, abstract: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import hf_folder
    with hf_folder.staged(jsons, ckpt) as stage:
        try:
            config = AutoConfig.from_pretrained(stage, local_files_only=True)
        except Exception as e:  # anything transformers makes of an untrusted config is bad input
            from transformers import CONFIG_MAPPING
            known = isinstance(raw.get("model_type"), str) and raw["model_type"] in CONFIG_MAPPING
            what = "transformers cannot read it" if known else "transformers does not know this architecture"
            raise InputError(f"{cfg_path}: {what} ({type(e).__name__}: {_reason(e)})",
                             hint="a newer transformers may know the architecture; it must be a causal LM") from None
        if type(config) not in AutoModelForCausalLM._model_mapping:
            raise InputError(f"{cfg_path}: {config.model_type!r} is not a causal LM architecture transformers "
                             f"can build (architectures {getattr(config, 'architectures', None)})")
        _check_layout(cfg_path, config)
        _check_against_checkpoint(cfg_path, _meta_model(cfg_path, config, ckpt), ckpt)
        if abstract:
            from ..capture import abstract_weights
            with abstract_weights():
                return _built(cfg_path, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
        try:  # its load report is checked below, not printed
            model, info = AutoModelForCausalLM.from_pretrained(stage, local_files_only=True, dtype="float32",
                                                               use_safetensors=True, output_loading_info=True)
        except Exception as e:  # the headers were checked: what is left is the checkpoint's content
            raise InputError(f"cannot load the weights in {path}: {_reason(e)}") from None
    model.config.name_or_path = path
    # a weight the checkpoint lacks would be random: never a silently wrong model
    missing = sorted(info.get("missing_keys") or []) + [str(k) for k in info.get("mismatched_keys") or []]
    if missing:
        raise InputError(f"{path}: the safetensors weights do not match the {type(model).__name__} that "
                         f"config.json describes ({len(missing)} missing or mismatched, e.g. {missing[0]})")
    return model


MAX_LAYERS = 1024  # transformers' configs make per-layer lists as they are read; the deepest real LLM has ~130
MAX_ABSTRACT_PARAMS = 1 << 16  # a model built from config.json alone: ~4 KB of Python objects each
_BUFFER_ALLOWANCE = 256 << 20  # computed buffers (RoPE frequencies, masks) beyond the checkpoint's size


def _check_raw_config(cfg_path: str, raw: dict) -> None:
    """What must be refused before transformers reads config.json at all."""
    stack = [raw]
    while stack:  # load_json capped the nesting
        node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append(value)
            elif (key.endswith(("layers", "layer")) and isinstance(value, int) and not isinstance(value, bool)
                  and not 0 <= value <= MAX_LAYERS):
                raise InputError(f"{cfg_path}: {key} is {value}; a layer count from 0 to {MAX_LAYERS} was expected")
            if key == "quantization_config" and value is not None:
                raise InputError(f"{cfg_path} describes a quantized checkpoint (quantization_config), which is not "
                                 "read", hint="export the float (or bf16) checkpoint; quantize with --quantize")


def _check_layout(cfg_path: str, config) -> None:
    """The sizes the KV cache and the export read from the config, for what transformers left unchecked."""
    text = getattr(config, "text_config", None) or config

    def size(key, optional=False):
        value = getattr(text, key, None)
        if value is None and optional:
            return None
        if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2 ** 31):
            raise InputError(f"{cfg_path}: {key} must be a positive integer, got {value!r:.80}")
        return value

    heads, hidden = size("num_attention_heads"), size("hidden_size")
    size("num_hidden_layers"), size("max_position_embeddings", optional=True)
    kv, head_dim = size("num_key_value_heads", optional=True), size("head_dim", optional=True)
    if kv is not None and heads % kv:
        raise InputError(f"{cfg_path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if head_dim is None and hidden % heads:
        raise InputError(f"{cfg_path}: hidden_size {hidden} does not divide into {heads} attention heads",
                         hint="set head_dim, or a hidden_size that num_attention_heads divides")
    _ids(getattr(config, "eos_token_id", None), cfg_path)


class _TooManyParameters(BaseException):  # not an Exception: transformers' own handlers must let it through
    pass


def _meta_model(cfg_path: str, config, ckpt):
    """The model config.json describes, built on the meta device (no memory for its weights), its
    construction stopped once it registers more parameters than the checkpoint could fill."""
    import threading
    from transformers import AutoModelForCausalLM
    limit = MAX_ABSTRACT_PARAMS if ckpt is None else 2 * ckpt.tensors + 1024
    me, count = threading.get_ident(), 0

    def counted(module, name, param):
        nonlocal count
        if threading.get_ident() == me:
            count += 1
            if count > limit:
                raise _TooManyParameters

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(counted)
    try:
        with torch.device("meta"):
            return _built(cfg_path, lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    except _TooManyParameters:
        raise InputError(f"{cfg_path} describes a model of more than {limit:,} weight tensors, "
                         + ("more than any real one" if ckpt is None else
                            f"but its checkpoint holds {ckpt.tensors:,}")) from None
    finally:
        handle.remove()


def _built(cfg_path: str, build):
    try:
        return build()
    except Exception as e:  # a config transformers accepted but cannot build a model from
        raise InputError(f"{cfg_path}: transformers cannot build the model it describes "
                         f"({type(e).__name__}: {_reason(e)})") from None


def _check_against_checkpoint(cfg_path: str, model, ckpt) -> None:
    """The model (on the meta device) against the checkpoint's headers: no more weights than the checkpoint
    holds, and no more memory than twice its size (float32 from bf16) plus computed buffers."""
    elements = sum(p.numel() for p in model.parameters())  # each tied weight once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if buffers > _BUFFER_ALLOWANCE + (ckpt.nbytes if ckpt else 0):
        raise InputError(f"{cfg_path} describes a model whose computed buffers take {buffers / 2**20:,.0f} MiB",
                         hint="a size in config.json (max_position_embeddings, sliding_window) is far too large")
    if ckpt is None:
        return
    name = type(model).__name__
    if elements > ckpt.elements:
        raise InputError(f"{cfg_path} describes a {name} of {elements:,} weights; its safetensors hold "
                         f"{ckpt.elements:,}: config.json and the checkpoint do not match")
    if elements * 4 > 2 * ckpt.nbytes + _BUFFER_ALLOWANCE:
        raise InputError(f"{cfg_path} describes a {name} of {elements * 4 / 2**20:,.0f} MiB in float32, more "
                         f"than twice its {ckpt.nbytes / 2**20:,.0f} MiB checkpoint (stored in 1-byte types?)")


def _reason(e: Exception) -> str:
    """An exception's message on one line (transformers puts the cause on the second), at most 300 characters."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# ---- the wrapper ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CacheLayout:
    layers: int
    kv_heads: int
    head_dim: int
    length: int  # C: positions the cache holds
    dtype: str = "float32"  # bfloat16 for tpu programs of the bf16 recipe

    @classmethod
    def of(cls, config, length: int, dtype: str = "float32") -> "CacheLayout":
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv, head_dim, length, dtype)

    def names(self) -> list[str]:
        return [f"kv_cache_{kv}_{i}" for i in range(self.layers) for kv in "kv"]

    def empty(self, dtype=None, batch: int = 1) -> dict:
        shape = (batch, self.kv_heads, self.length, self.head_dim)
        return {n: torch.zeros(shape, dtype=dtype or getattr(torch, self.dtype)) for n in self.names()}


class _StepCache:
    """The transformers ``Cache`` protocol over the step's cache tensors: ``update`` writes a layer's new
    keys and values contiguously from ``start`` and gives the whole cache to attend over."""

    is_compileable = True

    def __init__(self, caches: dict, layers: int, input_pos, slots: bool):
        self.k = [caches[f"kv_cache_k_{i}"] for i in range(layers)]
        self.v = [caches[f"kv_cache_v_{i}"] for i in range(layers)]
        self.pos, self.slots = input_pos.to(torch.int64), slots

    def _write(self, cache, new):
        new = new.to(cache.dtype)
        if self.slots:  # each slot (batch row) from its own start: a scatter (positions past the cache are dropped)
            b, h, n, d = new.shape
            pos = self.pos.view(b, 1, 1, 1) + torch.arange(n, dtype=torch.int64).view(1, 1, n, 1)
            return cache.scatter(2, pos.expand(b, h, n, d), new)
        return cache.index_copy(2, self.pos[0] + torch.arange(new.shape[2], dtype=torch.int64), new)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.k[layer_idx] = self._write(self.k[layer_idx], key_states)
        self.v[layer_idx] = self._write(self.v[layer_idx], value_states)
        return self.k[layer_idx], self.v[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class CacheStep(torch.nn.Module):
    """One step of ``N`` tokens: ``(tokens [1,N] int32, input_pos [N] int32, mask [1,1,N,C] f32, caches)``
    → ``{"logits" [1,N,V] (decode only), caches}``, the caches updated under their own names.

    With ``slots`` (batched steps for serving), each batch row is a separate sequence:
    ``(tokens [B,N], input_pos [B] (each row's first position), mask [B,1,N,C], caches [B,...])``; writes
    past the cache's end are dropped (the engine parks rows that take no part at position C)."""

    def __init__(self, model, layout: CacheLayout, logits: bool, slots: bool = False):
        super().__init__()
        self.model, self.layout, self.logits, self.slots = model, layout, logits, slots
        config = model.config
        self.window = getattr(config, "sliding_window", None)
        self.layer_types = getattr(config, "layer_types", None)
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def _masks(self, mask, positions):
        """The full-attention mask as given, and, where the config has sliding-window layers, theirs
        (``positions`` [B, N]: each query's position)."""
        sliding = None
        if self.window:
            kv_pos = torch.arange(self.layout.length, dtype=torch.int64)
            far = (positions.to(torch.int64)[:, :, None] - kv_pos) >= self.window
            sliding = torch.where(far[:, None], torch.finfo(mask.dtype).min, mask)
        if self.layer_types:  # models that take one mask per layer type
            return {t: (sliding if t == "sliding_attention" and sliding is not None else mask)
                    for t in set(self.layer_types)}
        return mask if sliding is None else sliding  # sliding_window without layer types: every layer slides

    def forward(self, tokens, input_pos, mask, **caches):
        cache = _StepCache(caches, self.layout.layers, input_pos, self.slots)
        n = tokens.shape[1]
        positions = input_pos[:, None] + torch.arange(n, dtype=input_pos.dtype) if self.slots else input_pos[None]
        _GROUP_MASKS.clear()  # each trace of a step makes its own
        try:
            out = self.model(input_ids=tokens, attention_mask=self._masks(mask, positions),
                             position_ids=positions, use_cache=True, **{self.cache_kw: cache})
        finally:
            _GROUP_MASKS.clear()
        result = {"logits": out.logits} if self.logits else {}
        for i in range(self.layout.layers):
            result[f"kv_cache_k_{i}"], result[f"kv_cache_v_{i}"] = cache.k[i], cache.v[i]
        return result


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      **kwargs):
    """transformers' attention (the ``AttentionInterface`` signature) with grouped-query heads computed per
    group: the queries of a group are stacked against their shared key/value head, so the cache is read
    as it is, never repeated to every query head (``repeat_kv`` copies the whole cache per layer and step).
    Falls back to the model's own function for features it does not cover (attention sinks)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if key.dtype != query.dtype:  # a bf16 cache under a float32 trace (the bf16 recipe makes it all bf16)
        key, value = key.to(query.dtype), value.to(query.dtype)
    b, heads, n, d = query.shape
    groups, length = key.shape[1], key.shape[2]
    rep = heads // groups
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, groups, rep * n, d)  # head g * rep + r, as repeat_kv orders them
    mask = None if attention_mask is None else _group_mask(attention_mask, rep, length)
    if softcap is None:  # one fused attention node: the converters read the cache as it is (no transpose)
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    else:
        scores = torch.tanh(torch.matmul(q, key.transpose(2, 3)) * scale / softcap) * softcap
        if mask is not None:
            scores = scores + mask
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(query.dtype), value)
    return out.reshape(b, heads, n, d).transpose(1, 2).contiguous(), None


# (id(mask), rep, length) -> (mask, the mask for stacked query heads): made once per traced step and shared by
# every layer given the same mask, not once per layer (on a 1B Llama's int8 prefill in LiteRT-LM, a mask
# per layer took half the time).
_GROUP_MASKS: dict = {}


def _group_mask(attention_mask, rep: int, length: int):
    """``attention_mask [B, 1, n, C]`` for the stacked queries of a group (``[B, 1, rep * n, length]``: the
    same rows for every query head of the group)."""
    key = (id(attention_mask), rep, length)  # unique while the entry holds the mask
    if key in _GROUP_MASKS:
        return _GROUP_MASKS[key][1]
    m = attention_mask[..., :length]
    b, one, n = m.shape[0], m.shape[1], m.shape[2]
    mask = m.unsqueeze(2).expand(b, one, rep, n, length).reshape(b, one, rep * n, length)
    if not torch.compiler.is_dynamo_compiling():  # strict export traces the Python: no memo by identity there
        _GROUP_MASKS[key] = (attention_mask, mask)
    return mask


_ATTENTION = "tte_grouped"


class _grouped_attention_in:
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


def step_inputs(layout: CacheLayout, n: int) -> dict:
    """Sample inputs of an ``n``-token step (the runtime's names, shapes and dtypes)."""
    return dict(tokens=torch.zeros(1, n, dtype=torch.int32), input_pos=torch.arange(n, dtype=torch.int32),
                mask=torch.zeros(1, 1, n, layout.length), **layout.empty())


def slot_inputs(layout: CacheLayout, slots: int, n: int = 1) -> dict:
    """Sample inputs of a batched step over ``slots`` sequences (``n`` tokens each)."""
    return dict(tokens=torch.zeros(slots, n, dtype=torch.int32), input_pos=torch.zeros(slots, dtype=torch.int32),
                mask=torch.zeros(slots, 1, n, layout.length), **layout.empty(batch=slots))


def check_options(source: LlmSource, prefill_lengths: Sequence[int], cache_length: int) -> list[int]:
    config = source.model.config
    if getattr(config, "is_encoder_decoder", False):
        raise InputError(f"{source.name} is an encoder-decoder model; export_llm takes decoder-only causal LMs")
    lengths = sorted({int(n) for n in prefill_lengths})
    if not lengths or lengths[0] < 1:
        raise InputError(f"prefill lengths must be positive, got {list(prefill_lengths)}")
    if cache_length < 2:
        raise InputError(f"cache length must be at least 2, got {cache_length}")
    if lengths[-1] > cache_length:
        raise InputError(f"prefill length {lengths[-1]} is above the cache length {cache_length}",
                         hint="a prefill chunk must fit in the cache: lower --prefill-lengths or raise --cache-length")
    limit = getattr(config, "max_position_embeddings", None)
    if limit and cache_length > limit:
        raise InputError(f"cache length {cache_length} is above the model's max_position_embeddings {limit}")
    return lengths


def export_llm(model_or_path, tokenizer=None, *, target: str = "litertlm", prefill_lengths: Sequence[int] = (128,),
               cache_length: int = 1024, quant_config=None, batch_size: int = 1, abstract_weights: bool = False,
               **options):
    """Exports a causal LM's prefill (one signature per length, ``prefill_<N>``) and ``decode`` steps.

    ``model_or_path``: a local Hugging Face folder (config.json, safetensors weights, tokenizer.json),
    ``file.py:factory`` returning a model or ``(model, tokenizer)``, or a transformers model.
    ``target="litertlm"`` returns a bundle for LiteRT-LM (``.save("model.litertlm")``; ``generate``);
    ``target="tpu"`` (or ``"litert"``) the target's runnable with the same signatures.
    ``batch_size`` > 1 (tpu): ``decode_batch`` and ``prefill_batch_<N>`` programs too, stepping that many
    sequences at once, each at its own position: the slots of the serving engine (:mod:`torchtpu_export.engine`).
    ``abstract_weights=True`` with a model folder: built from config.json alone, weights never read (tpu:
    the programs take abstract weights, bound at load with ``TpuProgram.bind_weights``).
    """
    from .. import targets
    from ..api import SignatureSet
    source = load_source(model_or_path, tokenizer, abstract_weights)
    lengths = check_options(source, prefill_lengths, cache_length)
    t = targets.get(target)
    program_target = t.program_target or target
    from ..quant import parse
    recipe = parse(quant_config, program_target)
    # serving in bf16 keeps the KV cache in bf16 too (half the HBM); LiteRT-LM's caches are float32
    serving = targets.get(program_target).serving
    bf16 = serving and recipe is not None and recipe.recipe == "bf16"
    layout = CacheLayout.of(source.model.config, cache_length, "bfloat16" if bf16 else "float32")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or not 1 <= batch_size <= 4096:
        raise InputError(f"batch_size must be an integer from 1 to 4096, got {batch_size!r}")
    if batch_size > 1 and not serving:
        raise InputError(f"batch_size applies to target='tpu' (the serving engine's slots); {target} programs "
                         "step one sequence", hint="leave batch_size out, or export with target='tpu'")
    sigs = SignatureSet()
    for n in lengths:
        sigs.signature(PREFILL.format(n), CacheStep(source.model, layout, logits=False), (), step_inputs(layout, n))
    sigs.signature(DECODE, CacheStep(source.model, layout, logits=True), (), step_inputs(layout, 1))
    if batch_size > 1:
        sigs.signature(DECODE_BATCH, CacheStep(source.model, layout, logits=True, slots=True), (),
                       slot_inputs(layout, batch_size))
        for n in lengths:  # requests arriving together are prefilled together, straight into their slots
            sigs.signature(PREFILL_BATCH.format(n), CacheStep(source.model, layout, logits=False, slots=True), (),
                           slot_inputs(layout, batch_size, n))
    if options.get("mesh") and options.get("sharding", "tensor_parallel") in (None, "tensor_parallel"):
        # tensor parallel splits attention by head: each chip keeps its own heads' KV cache, never the whole
        options.setdefault("input_shardings", cache_shardings(layout, options["mesh"]))
    if quant_config is not None:
        # quality is the agreement of next tokens (benchmarks/llm.py), not the error on zero-filled samples,
        # and measuring that would run both models on every signature's full cache
        options.update(quant_config=quant_config, quant_report=False)
    with torch.no_grad(), _grouped_attention_in(source.model):
        program = sigs.export(target=program_target, **options)
    if t.from_llm is None:
        return program
    return t.from_llm(program, source, layout, lengths)


def cache_shardings(layout: CacheLayout, mesh) -> dict:
    """Each cache ``[slots, kv_heads, length, head_dim]`` split by KV head over the mesh's ``model``
    axis, when the heads divide over it (else replicated, as XLA would gather them anyway)."""
    try:
        axes = dict(mesh.items() if hasattr(mesh, "items") else mesh)
    except (TypeError, ValueError):
        return {}  # the converter says what is wrong with the mesh
    n = axes.get("model", 1)
    if not isinstance(n, int) or n <= 1:
        return {}
    if layout.kv_heads % n == 0:
        return {name: [None, "model", None, None] for name in layout.names()}
    if layout.head_dim % n == 0:  # more chips than KV heads (GQA): split each head's features instead
        return {name: [None, None, None, "model"] for name in layout.names()}
    return {}


def prefill_lengths(signatures) -> list[int]:
    """The lengths of the one-sequence ``prefill_<N>`` signatures, ascending."""
    return sorted(int(m.group(1)) for m in (re.fullmatch(r"prefill_(\d+)", s) for s in signatures) if m)


def prefill_chunks(count: int, lengths: Sequence[int]):
    """``(start, tokens, prefill length)`` for ``count`` prompt tokens: each chunk the shortest exported
    length that holds the rest, else the longest (a short chunk is padded by the step)."""
    done = 0
    while done < count:
        left = count - done
        n = next((k for k in lengths if k >= left), lengths[-1])
        yield done, min(n, left), n
        done += min(n, left)


class HostLoop:
    """Drives a program with ``prefill_<N>`` and ``decode`` signatures (any target's runnable, or a
    ``.tflite`` made elsewhere with the same contract) from the host the way LiteRT-LM drives a bundle:
    prompt chunks padded with zeros, cache writes from each chunk's first position, the last prompt
    token decoded. A reference loop for checks and measurements: the cache goes through the host."""

    def __init__(self, program):
        import numpy as np
        self.program = program
        self.lengths = prefill_lengths(program.signatures)
        specs = {s.name: s for s in program.inputs(DECODE)}
        self.length = specs["mask"].shape[-1]
        self.caches = {n: np.zeros(s.shape, np.dtype(s.dtype)) for n, s in specs.items() if n.startswith("kv_cache_")}
        self.pos = 0

    def _step(self, sig: str, tokens: Sequence[int]):
        import numpy as np
        n = len(tokens) if sig == DECODE else int(sig.split("_")[1])
        if self.pos + len(tokens) > self.length:
            raise InputError(f"{self.pos + len(tokens)} tokens do not fit the cache of {self.length}")
        pos = np.arange(self.pos, self.pos + n, dtype=np.int32)
        mask = np.where(np.arange(self.length)[None, :] <= pos[:, None], 0.0, np.finfo(np.float32).min)
        feed = dict(tokens=np.array([list(tokens) + [0] * (n - len(tokens))], np.int32), input_pos=pos,
                    mask=mask[None, None].astype(np.float32), **self.caches)
        outs = self.program(signature_name=sig, **feed)
        if not isinstance(outs, dict):  # a file made elsewhere: flat outputs, named by the file
            outs = dict(zip([o.name for o in self.program.outputs(sig)], outs if isinstance(outs, tuple) else [outs]))
        self.caches.update({k: v for k, v in outs.items() if k in self.caches})
        self.pos += len(tokens)
        return outs.get("logits")

    def prefill(self, ids: Sequence[int]) -> None:
        """Fills the cache with ``ids``, in the largest chunks that help."""
        for start, take, n in prefill_chunks(len(ids), self.lengths):
            self._step(PREFILL.format(n), ids[start:start + take])

    def decode(self, token: int):
        """The next-token logits ``[vocab]`` after ``token``, which goes into the cache."""
        return self._step(DECODE, [int(token)])[0, -1]


def host_generate(program, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Greedy tokens after ``prompt_ids`` from a program with prefill and decode signatures (:class:`HostLoop`)."""
    import numpy as np
    loop = HostLoop(program)
    ids = list(prompt_ids)
    loop.prefill(ids[:-1])
    out: list[int] = []
    token = ids[-1]
    for _ in range(max_new_tokens):
        token = int(np.argmax(loop.decode(token)))
        if token in stop_ids:
            break
        out.append(token)
    return out


def next_token_logits(program, ids: Sequence[int], start: int):
    """The program's next-token logits at every position from ``start`` on, the tokens given (teacher forcing):
    row ``i`` predicts ``ids[start + i + 1]``."""
    import numpy as np
    loop = HostLoop(program)
    loop.prefill(list(ids[:start]))
    return np.stack([loop.decode(t) for t in ids[start:]])
