"""Loading an LLM: a local Hugging Face folder (checked before transformers builds anything: sizes,
layout, checkpoint), ``file.py:factory``, or a model object, with its tokenizer. Local files only."""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from ..errors import InputError
from .text import LlmTokenizer, token_ids


@dataclasses.dataclass
class LlmSource:
    model: object  # a transformers causal LM (or a module with the same call), in eval mode
    tokenizer: LlmTokenizer | None
    name: str
    vision: object = None  # llm.vision.VisionParts: a VLM's encoder, adapter and embedder (``model`` its text)
    # transformers' ids of the chat probes (llm.chat.references), which the target's build checks its runtime's
    # rendering against; None: no check (check=False, no template, no transformers tokenizer)
    chat: list | None = None
    chat_report: dict | None = None  # what that check found (set by the target's build)


def load_source(model_or_path, tokenizer=None, abstract: bool = False, vision: str | None = None) -> LlmSource:
    """The model and tokenizer from a local Hugging Face folder, ``file.py:factory`` (returning a model
    or ``(model, tokenizer)``), or a model object. Local files only: nothing is downloaded.

    ``vision``: the target's name where it takes vision-language models (:mod:`.vision`): a VLM of a family
    it exports comes with its parts (``LlmSource.vision``), its ``model`` the language model; elsewhere, and
    for other families, a model with parts beside its text decoder is refused."""
    from ..models import call_factory, is_factory

    stop_ids: list[int] = []
    processor = None
    if isinstance(model_or_path, torch.nn.Module):
        model, name = model_or_path, type(model_or_path).__name__
    elif isinstance(model_or_path, (str, os.PathLike)) and os.path.isdir(model_or_path):
        path = os.fspath(model_or_path)
        model, name = _load_hf_folder(path, abstract, vision), os.path.basename(os.path.abspath(path))
        tokenizer = path if tokenizer is None else tokenizer
        if vision:
            processor = _image_processor(path)
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
    raw = {k: getattr(config, k, None) for k in PARTS}
    multimodal = vision and _vision_family({**raw, "model_type": getattr(config, "model_type", None)})
    refuse_partial(name, {k: v for k, v in raw.items() if not (multimodal and k == "vision_config")},
                   type(model).__name__, vision)
    why = NOT_YET.get(getattr(config, "model_type", None))
    if why:
        raise InputError(f"{name} is a {config.model_type} model: {why}",
                         hint="this family is refused rather than exported to give other tokens")
    stop_ids += token_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                     f"{name}'s generation config")
    stop_ids += token_ids(getattr(config, "eos_token_id", None), f"{name}'s config")
    tok = LlmTokenizer.from_object(tokenizer, stop_ids) if tokenizer is not None else None
    model.eval()
    if multimodal:
        from .vision import vision_parts
        parts = vision_parts(model, processor, name, tok)
        return LlmSource(parts.text, tok, name, parts)
    return LlmSource(model, tok, name)


def _image_processor(path: str) -> dict | None:
    """The image processor's config of a model folder: ``preprocessor_config.json``, or the ``image_processor`` of
    ``processor_config.json`` (where transformers 5 saves it)."""
    from . import hf_folder
    found = hf_folder.read_json(path, "preprocessor_config.json")
    if found is None:
        found = (hf_folder.read_json(path, "processor_config.json") or {}).get("image_processor")
    if found is not None and not isinstance(found, dict):
        raise InputError(f"{path}: its image processor's config is not a JSON object")
    return found


def _vision_family(config: dict) -> bool:
    from .vision import is_vision_family
    return is_vision_family(config)


# what a model may hold beside its text decoder, which export_llm would drop (config key -> what it is)
PARTS = {"vision_config": "a vision tower", "audio_config": "an audio encoder", "speech_config": "a speech encoder",
         "vision_tower": "a vision tower", "encoder_config": "an encoder"}


# families whose exported steps do not give transformers' tokens yet, and why (refused at export)
NOT_YET: dict[str, str] = {}


# layers that carry a recurrent state beside (or instead of) a KV cache, by their transformers class names:
# Mamba and Mamba-2 mixers (mamba, falcon_mamba, jamba, bamba, granitemoehybrid, falcon_h1, nemotron_h),
# gated delta nets (qwen3_next), lightning attention (minimax), RG-LRU blocks (recurrent_gemma), RWKV,
# short convolutions (lfm2)
RECURRENT = re.compile(r"Mamba\w*(Mixer|Layer)$|Mixer$|GatedDeltaNet|LinearAttention|LightningAttention|Rglru|RecurrentBlock|"
                       r"^Rwkv(SelfAttention|Block)$|ShortConv$")


def recurrent_layers(model: torch.nn.Module) -> list[str]:
    """The class names of a model's state-space, linear-attention and short-convolution layers."""
    return list(dict.fromkeys(n for n in (type(m).__name__ for m in model.modules())
                              if RECURRENT.search(n) and not n.endswith(("ForCausalLM", "Model"))))


def refuse_recurrent(name: str, model: torch.nn.Module, target: str, why: str) -> None:
    """A model with state-space, linear-attention or short-convolution layers is refused for a target whose
    artifacts do not carry their states between steps, naming the layer and ``why``."""
    found = recurrent_layers(model)
    if found:
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise InputError(f"{name} is a {family} model with recurrent layers ({', '.join(found[:3])}): {why}",
                         hint=f"this family is refused for {target} rather than exported to give other tokens; "
                              "target='tpu' carries recurrent states (and target='litert', whose .tflite steps "
                              "take them as inputs, driven without padding)")


def refuse_partial(name: str, config: dict, family: str, vision: str | None = None) -> None:
    """A model with parts beside its text decoder (a vision tower, an audio encoder) is refused: the export
    would carry its decoder alone, and a runtime given an image would fail or ignore it."""
    found = [what for key, what in PARTS.items() if config.get(key) is not None]
    if found:
        from .vision import FAMILIES
        where = f"the {vision} target exports vision-language models of the families {', '.join(sorted(FAMILIES))}" \
            if vision else "vision-language models are exported with --target litertlm or tpu"
        raise InputError(f"{name} is a {family} with {' and '.join(dict.fromkeys(found))} beside its text decoder, "
                         "which this export would drop", hint=f"{where}; or export the language model on its own "
                                                              "(its text_config as a causal LM folder)")


def _load_hf_folder(path: str, abstract: bool = False, vision: str | None = None):
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
    archs = raw.get("architectures")
    multimodal = vision and _vision_family(raw)
    refuse_partial(path, {k: v for k, v in raw.items() if not (multimodal and k == "vision_config")},
                   archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str)
                   else str(raw.get("model_type", "model")), vision)
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
        token_ids(gen.get("eos_token_id"), os.path.join(path, "generation_config.json"))
        jsons["generation_config.json"] = gen
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # what it would warn of is checked here and said once, as an error
    try:
        return _build_from_folder(path, cfg_path, raw, jsons, ckpt, abstract, multimodal)
    finally:
        hf_logging.set_verbosity_warning()


def _auto_class(config, multimodal: bool):
    """transformers' auto class that builds ``config``'s model: a causal LM, or for a vision-language family
    exported whole, its image-text-to-text class where the causal LM mapping lacks it (Idefics3)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    if multimodal and type(config) not in AutoModelForCausalLM._model_mapping \
            and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _build_from_folder(path: str, cfg_path: str, raw: dict, jsons: dict, ckpt, abstract: bool,
                       multimodal: bool = False):
    from transformers import AutoConfig

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
        auto = _auto_class(config, multimodal)
        if type(config) not in auto._model_mapping:
            raise InputError(f"{cfg_path}: {config.model_type!r} is not a causal LM architecture transformers "
                             f"can build (architectures {getattr(config, 'architectures', None)})")
        _check_layout(cfg_path, config)
        _check_against_checkpoint(cfg_path, _meta_model(cfg_path, config, ckpt, auto), ckpt)
        if abstract:
            from ..capture import abstract_weights
            with abstract_weights():
                return _built(cfg_path, lambda: auto.from_config(config, dtype=torch.float32))
        try:  # its load report is checked below, not printed
            model, info = auto.from_pretrained(stage, local_files_only=True, dtype="float32",
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
    token_ids(getattr(config, "eos_token_id", None), cfg_path)


class _TooManyParameters(BaseException):  # not an Exception: transformers' own handlers must let it through
    pass


def _meta_model(cfg_path: str, config, ckpt, auto=None):
    """The model config.json describes, built on the meta device (no memory for its weights), its
    construction stopped once it registers more parameters than the checkpoint could fill."""
    import threading
    from transformers import AutoModelForCausalLM
    auto = auto or AutoModelForCausalLM
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
            return _built(cfg_path, lambda: auto.from_config(config, dtype=torch.float32))
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
