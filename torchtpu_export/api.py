"""The public API: ``export``, ``convert``, ``load``, ``signature``, ``export_llm``.

This is the one layer that joins capture and the targets: ``captures`` captures for a target's
converter, ``build`` converts and wraps the artifact in the target's runnable object (see
``targets``); ``export``, ``convert`` and ``signature`` are those two calls.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from . import targets
from .capture import CapturedProgram, capture, is_abstract
from .errors import InputError


def captures(entries: Sequence[tuple], target: str, strict_export=False,
             dynamic_shapes=None) -> dict[str, CapturedProgram]:
    """Captures each ``(name, module, args, kwargs, dynamic_shapes)`` entry for ``target``'s converter."""
    from . import converters
    converter = converters.converter(targets.get(target).converter)
    out = {}
    for name, module, args, kwargs, dyn in entries:
        out[name] = capture(module, args, kwargs, dynamic_shapes=dyn if dyn is not None else dynamic_shapes,
                            strict_export=strict_export, keep=converter.KEEP_WHOLE, lowerable=converter.lowerable,
                            state=targets.get(target).stateful)
        abstract = [w for w, t in out[name].weights.items() if is_abstract(t)]
        if abstract and not targets.get(targets.get(target).llm.program_target or target).abstract_weights:
            raise InputError(f"weight {abstract[0]!r} has no values (built under abstract_weights() or on the meta "
                             f"device); the {target} target writes weights into its file",
                             hint="load the weights (e.g. from safetensors) before converting, or export to the tpu "
                                  "target, whose programs take abstract weights and bind values at load")
    return out


def build(target: str, captured: dict[str, CapturedProgram], **options):
    """Converts already-captured programs for ``target`` and wraps the artifact in its runnable object
    (a TpuProgram, an EdgeModel or an OnnxProgram: each has ``run_flat``, ``save`` and ``__call__``).
    What ``export`` and ``convert`` do after capturing."""
    return targets.get(target).build(captured, options)


def export(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *, target: str = "tpu",
           dynamic_shapes=None, strict_export: bool | str = False, **options):
    """Captures ``module`` once and converts it for ``target`` (``"tpu"``, ``"litert"`` or ``"onnx"``).

    tpu options: ``platforms=("tpu", "cpu")``, ``kernels="auto"`` (Pallas kernels for hot ops),
    ``narrow_64bit``, ``quant_config``, ``mesh=(("data", 1), ("model", 8))`` with
    ``sharding="tensor_parallel"`` for a program sharded over several chips, and
    ``precompile=("v5e:2x2",)`` to store TPU executables compiled by libtpu. litert options: those of
    :func:`convert`. An option the target does not take is a TypeError.
    """
    t = targets.get(target)
    if not isinstance(sample_args, (tuple, list)):
        sample_args = (sample_args,)
    if t.prepare is not None:
        module, sample_args, sample_kwargs, options = t.prepare(module, sample_args, sample_kwargs, options)
    caps = captures([(t.signature, module, sample_args, sample_kwargs, None)], target, strict_export,
                    dynamic_shapes)
    return t.build(caps, options)


def convert(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *, dynamic_shapes=None,
            quant_config=None, strict_export: bool | str = False, channels_last_io: bool = False, **options):
    """Converts ``module`` to a LiteRT flatbuffer (a drop-in for ``litert_torch.convert``).

    ``channels_last_io=True``: 4-D float inputs and outputs are NHWC in the file (the NCHW sample
    inputs are transposed for you), so a vision model takes camera frames as they come, with no
    TRANSPOSE at its boundary. ``io_dtypes="web"``: every input and output is float32, int32 or
    uint8, the tensor types LiteRT.js accepts (int64 token ids become int32, checked to fit).
    ``quant_config``: ``"fp16"``, ``"dynamic_int8"`` or ``{"recipe": "int8", "calibration": [sample_args,
    ...]}``; the result's ``quant_report`` gives sizes and the error against float on the sample inputs.
    """
    return export(module, sample_args, sample_kwargs, target="litert", dynamic_shapes=dynamic_shapes,
                  strict_export=strict_export, quant_config=quant_config, channels_last_io=channels_last_io,
                  **options)


class SignatureSet:
    """Several entry points (e.g. ``prefill`` and ``decode``) exported into one artifact, weights shared."""

    def __init__(self):
        self.entries: list[tuple] = []
        self.compilation_configs: list = []  # NPU targets (ai_edge_litert.aot CompilationConfigs)

    def experimental_add_compilation_backend(self, target=None, **kwargs) -> "SignatureSet":
        """litert-torch's NPU hook: ``convert`` then compiles the ``.tflite`` for ``target`` (an
        ``ai_edge_litert.aot`` target such as ``qualcomm.target.Target(SocModel.SM8650)``, a SoC
        string ``"qualcomm:SM8650"``/``"qualcomm:all"``, or None for every registered vendor)
        through ``ai_edge_litert.aot.aot_compile`` and returns its ``CompilationResult``. Adding a
        target twice is a no-op; ``kwargs`` go to the vendor's compiler."""
        from ai_edge_litert.aot.core import aot_types

        from .targets.litert import npu
        if target is None:
            from ai_edge_litert.aot.vendors import import_vendor
            found = [import_vendor.AllRegisteredTarget()]
        elif isinstance(target, str):
            found = npu.parse_targets(target)
        elif isinstance(target, aot_types.Target):
            found = [target]
        else:
            raise InputError(f"experimental_add_compilation_backend takes an ai_edge_litert.aot Target or a "
                             f"SoC string such as 'qualcomm:SM8650', not {type(target).__name__}")
        for t in found:
            if not any(type(c.target) is type(t) and c.target.flatten() == t.flatten()
                       for c in self.compilation_configs):
                self.compilation_configs.append(aot_types.CompilationConfig(target=t, **kwargs))
        return self

    def signature(self, name: str, module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
                  dynamic_shapes=None) -> "SignatureSet":
        """Adds a named entry point (``add_signature`` is litert-torch's name for it)."""
        if any(e[0] == name for e in self.entries):
            raise InputError(f"signature {name!r} is given twice")
        self.entries.append((name, module, _tuple(sample_args), sample_kwargs, dynamic_shapes))
        return self

    add_signature = signature

    def convert(self, module=None, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
                quant_config=None, strict_export: bool | str = False, dynamic_shapes=None, **options):
        """One ``.tflite`` with every signature, weights stored once. ``module`` (with its sample
        inputs) adds the default signature, ``serving_default``: what a call without
        ``signature_name`` runs, as in litert-torch."""
        entries = list(self.entries)
        if module is not None:
            default = targets.get("litert").signature
            if any(e[0] == default for e in entries):
                raise InputError(f"signature {default!r} is given twice")
            entries.append((default, module, _tuple(sample_args), sample_kwargs, dynamic_shapes))
        edge = self._export(entries, "litert", strict_export, dict(options, quant_config=quant_config))
        if self.compilation_configs:  # litert-torch's result type: ai_edge_litert.aot's CompilationResult
            from .targets.litert import npu
            return npu.compile_model(edge.model_content(), self.compilation_configs)
        return edge

    def export(self, *, target: str = "tpu", strict_export: bool | str = False, **options):
        """One artifact of ``target`` with every signature (tpu and litert take several)."""
        return self._export(self.entries, target, strict_export, options)

    @staticmethod
    def _export(entries, target: str, strict_export, options: dict):
        t = targets.get(target)
        if not t.multi_signature:
            raise InputError(f"an artifact of the {target} target holds one program, not signatures",
                             hint=f"export each signature to its own {t.suffix} file")
        return t.build(captures(entries, target, strict_export), options)


def _tuple(sample_args) -> tuple:
    return tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,)


def signature(name: str, module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
              dynamic_shapes=None) -> SignatureSet:
    """Starts a multi-signature export: ``tte.signature("prefill", m, a).signature("decode", m, b).convert()``."""
    return SignatureSet().signature(name, module, sample_args, sample_kwargs, dynamic_shapes=dynamic_shapes)


def experimental_add_compilation_backend(target=None, **kwargs) -> SignatureSet:
    """``tte.experimental_add_compilation_backend(target).convert(model, args)``: the ``.tflite``
    compiled for an NPU through ``ai_edge_litert.aot`` (see :meth:`SignatureSet.experimental_add_compilation_backend`)."""
    return SignatureSet().experimental_add_compilation_backend(target, **kwargs)


def load(path: str | os.PathLike, *, trust_stored_executables: bool = False):
    """Loads an artifact (``.tpu``, ``.tflite``, ``.onnx``) into its target's runnable object.

    ``trust_stored_executables=True`` marks the file trusted: a ``.tpu``'s stored executables
    (``torchtpu-export compile``: its programs' for TPU chips, its serving engine's calls) are native code,
    loaded only then; otherwise they are never read and everything compiles as if the file stored none.
    Files of other kinds store none."""
    from .models import sniff_model
    kind = sniff_model(os.fspath(path))
    if kind not in targets.NAMES:
        raise InputError(f"{path} is a {kind} file, not a converted artifact; convert it first "
                         f"(torchtpu-export {os.fspath(path)} --target tpu)")
    target = targets.get(kind)
    if target.stored_executables:
        return target.load(path, trust_stored_executables=trust_stored_executables)
    return target.load(path)


# ---- LLMs ------------------------------------------------------------------------------------

def _check_llm_options(source, prefill_lengths: Sequence[int], cache_length: int) -> list[int]:
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
        raise InputError(f"cache length {cache_length} is above the model's max_position_embeddings {limit}",
                         hint=f"give cache_length (--cache-length) of at most {limit}, or leave it out: the default "
                              f"is the smaller of {DEFAULT_CACHE_LENGTH} and the model's limit")
    rows = source.vision.image_tokens if source.vision is not None else 0
    if lengths[0] < rows:
        # LiteRT-LM prefills an image's rows in steps of its own, where they attend to one another: a step
        # shorter than an image would split its rows (seen on 0.18.1 with prefill lengths 4 and 32 for 5 rows);
        # the tpu engine prefills an image's rows in one step too (Gemma 3's attend to one another)
        step = -(-rows // 8) * 8
        if step > cache_length:
            raise InputError(f"{source.name} puts {rows} rows into the prompt per image, more than the cache length "
                             f"{cache_length}", hint="raise --cache-length")
        lengths = sorted({max(n, step) for n in lengths})
    return lengths


DEFAULT_CACHE_LENGTH = 1024
DEFAULT_SLOTS = 8  # the tpu target's decode_batch rows unless batch_size says otherwise


def default_cache_length(config) -> int:
    """The smaller of 1024 positions and the model's own limit (``max_position_embeddings``)."""
    text = getattr(config, "text_config", None) or config
    limit = getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)
    return min(DEFAULT_CACHE_LENGTH, limit) if isinstance(limit, int) and limit > 1 else DEFAULT_CACHE_LENGTH


def export_llm(model_or_path, tokenizer=None, *, target: str = "litertlm", prefill_lengths: Sequence[int] = (128,),
               cache_length: int | None = None, quant_config=None, batch_size: int | None = None,
               abstract_weights: bool = False, kv_pages: int | str | None = None, page_size: int = 16,
               check: bool = True, lora=None, batch_buckets: Sequence[int] | None = None,
               chat_template: str | None = None, **options):
    """Exports a causal LM's prefill (one signature per length, ``prefill_<N>``) and ``decode`` steps.

    ``model_or_path``: a local Hugging Face folder (config.json, safetensors weights, tokenizer.json),
    ``file.py:factory`` returning a model or ``(model, tokenizer)``, or a transformers model.
    ``target="litertlm"`` returns a bundle for LiteRT-LM (``.save("model.litertlm")``; ``generate``);
    ``target="tpu"`` (or ``"litert"``) the target's runnable with the same signatures.
    ``batch_size`` > 1 (tpu): ``decode_batch`` and ``prefill_batch_<N>`` programs too, stepping that many
    sequences at once, each at its own position: the slots of the serving engine (:mod:`torchtpu_export.engine`).
    By default 8 for the tpu target (served concurrent requests batch without a flag; one request alone steps
    through the one-slot ``decode``) and 1 for the others.
    ``batch_buckets`` (tpu, with ``batch_size`` > 1): smaller batches of the same decode step
    (``decode_batch_<b>``, ``decode_paged_<b>``; a paged export's prefill too, ``prefill_paged_<N>_rows_<b>``,
    and for one row), through which the engine steps a light load: the busy rows in
    the smallest that holds them, not every slot. By default 4, 16, 64, ... below ``batch_size``; ``()`` for none.
    ``kv_pages`` (tpu): the batched steps over a paged KV cache instead (``decode_paged``,
    ``prefill_paged_<N>``): every cache one pool of ``kv_pages`` pages of ``page_size`` positions shared by
    the ``batch_size`` rows, so that memory holds live tokens, not rows x ``cache_length``, and a prompt's
    cached prefix pages are shared, not copied (the engine's paged mode). ``"auto"``: as many positions as
    the rows' slot caches would hold (and the pool's page 0, which no sequence owns).
    ``abstract_weights=True`` with a model folder: built from config.json alone, weights never read (tpu:
    the programs take abstract weights, bound at load with ``TpuProgram.bind_weights``).
    ``cache_length``: the KV cache's positions (prompt and reply); by default the smaller of 1024 and the
    model's ``max_position_embeddings``. A vision-language model of a family ``llm.vision`` exports (Gemma 3,
    Idefics3) is exported whole for litertlm (image encoder, adapter and embedder sections; the steps take
    embeddings) and for tpu (a ``vision`` program, and ``prefill_image_<N>`` steps taking an image's rows
    beside the tokens, which the serving engine runs for requests with images; the check runs them against
    transformers' whole VLM on a seeded image); any other model with parts beside its text decoder (a
    vision tower, an audio encoder) is refused, never exported without them.
    ``check=True``: before anything is returned, the exported prefill and decode steps run a probe prompt
    (here: the tpu target's cpu program, the litert interpreter) and their next-token logits are compared
    with transformers' on the same weights; a float export that differs is a NumericsError (never an
    artifact that generates other text); a quantized one is reported (top-1 agreement, KL). The result is
    the artifact's ``llm_check``.
    ``lora`` (litertlm): a PEFT LoRA folder, or a rank (16 or 32): the steps take a LoRA adapter's inputs
    (``llm.lora``; LiteRT-LM's ``LoraConfig(lora_path=...)`` fills them, zeros without an adapter); with a
    folder, its adapter is converted too (``bundle.adapter``, written by ``bundle.save_adapter(path)``) and
    the check runs the steps with it against transformers' model with the adapter merged.
    ``chat_template``: a chat template (text) to carry instead of the tokenizer's. With ``check=True`` and a
    template, probe conversations (``llm.chat``) are rendered through the engine that renders them at run time
    (LiteRT-LM's conversation API for litertlm, the server's text workers for tpu) and must give transformers'
    ``apply_chat_template`` ids; otherwise ChatTemplateError (an InputError) names the probe and the construct.
    """
    import torch

    from .llm.contract import cache_shardings
    from .llm.source import load_source, recurrent_layers, refuse_recurrent
    from .llm.step import grouped_attention_in, probe_layout
    from .quant import parse
    t = targets.get(target)
    source = load_source(model_or_path, tokenizer, abstract_weights, vision=target if t.llm.vision else None)
    _chat(source, chat_template, check)
    if cache_length is None:
        cache_length = default_cache_length(source.model.config)
    lengths = _check_llm_options(source, prefill_lengths, cache_length)
    if not t.llm.recurrent_state:
        refuse_recurrent(source.name, source.model, target, t.llm.recurrent_state_why or
                         "their states are not carried between this target's steps")
    program_target = t.llm.program_target or target
    recipe = parse(quant_config, program_target, targets.get(program_target).recipes)
    maker = targets.get(program_target).llm  # what the programs' target does with them
    # a VLM: on litertlm its steps take embeddings (LiteRT-LM merges an image's rows); served (tpu), they take
    # tokens, and prefill_image_<N> steps take an image's rows beside them (the vision program's)
    hidden = source.vision.hidden if source.vision is not None and not maker.image_rows else None
    image = (source.vision.image_token_id, source.vision.bidirectional) \
        if source.vision is not None and maker.image_rows else None
    # serving in bf16 keeps the KV cache in bf16 too (half the HBM); LiteRT-LM's caches are float32
    bf16 = maker.cache_follows_recipe and recipe is not None and recipe.recipe == "bf16"
    layout = probe_layout(source.model, cache_length, "bfloat16" if bf16 else "float32")
    if not layout.states and recurrent_layers(source.model):
        refuse_recurrent(source.name, source.model, target, "their states are kept outside transformers' cache "
                         "protocol (get/update_conv_state, get/update_recurrent_state), which the steps carry")
    if t.llm.check_layout is not None:
        t.llm.check_layout(source, layout)
    adapter, lora_layout = _lora(lora, source, t)
    padded = t.llm.pads_prompts  # the runtime pads a prompt's last chunk: the steps find the real tokens
    if layout.states and not padded and 1 not in lengths:  # recurrent states: prompts are never padded
        lengths = [1, *lengths]  # (llm.contract)
    if batch_size is None:
        batch_size = DEFAULT_SLOTS if maker.batched else 1
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or not 1 <= batch_size <= 4096:
        raise InputError(f"batch_size must be an integer from 1 to 4096, got {batch_size!r}")
    if batch_size > 1 and not maker.batched:
        raise InputError(f"batch_size applies to target='tpu' (the serving engine's slots); {target} programs "
                         "step one sequence", hint="leave batch_size out, or export with target='tpu'")
    pages = _check_pages(kv_pages, page_size, batch_size, cache_length, maker.batched, layout)
    buckets = _check_buckets(batch_buckets, batch_size)
    if image is not None and (pages or options.get("mesh")):
        raise InputError(f"{source.name}: a vision-language model is served from the engine's slots on one chip: "
                         f"not with {'kv_pages' if pages else 'mesh'}", hint="leave kv_pages and mesh out")
    from .llm.plan import StepPlan
    plan = StepPlan(tuple(lengths), batch_size, tuple(buckets), paged=bool(pages), batched_prefill=not layout.states,
                    images=image is not None)
    steps = _StepMaker(source, layout, padded, hidden, image, lora_layout, pages, page_size)
    sigs = SignatureSet()
    for p in plan.programs():
        sigs.signature(p.name, *steps.make(p))
    if options.get("mesh") and options.get("sharding", "tensor_parallel") in (None, "tensor_parallel"):
        # tensor parallel splits attention by head: each chip keeps its own heads' KV cache, never the whole
        paged = [e[0] for e in sigs.entries if "page_table" in e[3]]  # their caches are pools
        options.setdefault("input_shardings", cache_shardings(layout, options["mesh"], paged))
    if maker.options is not None:
        options.update(maker.options(source, layout, lengths))
    if quant_config is not None:
        # quality is the agreement of next tokens (benchmarks/llm.py), not the error on zero-filled samples,
        # and measuring that would run both models on every signature's full cache
        options.update(quant_config=quant_config, quant_report=False)
    import contextlib
    narrow = contextlib.nullcontext()
    if image is not None:
        from .llm.vision import int32_buffers
        narrow = int32_buffers(source.vision.encoder)
    with torch.no_grad(), grouped_attention_in(source.model), narrow:
        program = sigs.export(target=program_target, **options)
    parts = _export_vision(source.vision, program_target) if hidden is not None else {}
    embed = None
    if parts:
        from .llm.vision import program_embed
        embed = program_embed(parts["embedder"])
    reference, extra = source.model, None
    if lora_layout is not None and check:  # the adapter's inputs fed; transformers' model with it merged
        import copy

        import numpy as np
        extra = {n: np.asarray(adapter.weights[n]) if adapter is not None and n in adapter.weights else
                 np.zeros(lora_layout.shape(n), np.float32) for n in lora_layout.names()}
        if adapter is not None:
            reference = copy.deepcopy(source.model)
            adapter.merged_into(reference)
    report = _check_llm(program, reference, lengths, layout.length, quant_config is not None, options,
                        bool(layout.states), padded, embed, extra) \
        if check else {"checked": False, "why": "check=False"}
    if parts and check:
        from .llm.vision import check_programs
        report["vision"] = check_programs(source.vision, parts)
    if image is not None and report.get("checked"):
        from .llm.vision import check_image_steps
        report["vision"] = check_image_steps(source.vision, program, LLM_CHECK_TOLERANCE) \
            if quant_config is None else {"checked": False, "why": "quantized (the text steps' report says how far)"}
    more = {**({"parts": parts} if parts else {}), **({"adapter": adapter} if adapter is not None else {})}
    artifact = program if t.llm.from_llm is None else t.llm.from_llm(program, source, layout, lengths, **more)
    if source.chat_report is not None:
        report["chat"] = source.chat_report
    artifact.llm_check = report
    return artifact


@dataclasses.dataclass
class _StepMaker:
    """The module and sample inputs of each program of an LLM's plan (``llm.plan.Program``)."""

    source: object
    layout: object
    padded: bool  # the runtime pads a prompt's last chunk
    hidden: int | None  # steps take embeddings of this width (a VLM on litertlm)
    image: tuple | None  # steps of a served VLM: (image token, whether an image's rows attend to one another)
    lora: object  # an llm.lora.LoraLayout: the steps take an adapter's inputs
    pages: int
    page_size: int

    def make(self, p) -> tuple:
        """``(module, args, kwargs)`` of program ``p``."""
        from .llm.contract import image_inputs, mixed_inputs, paged_inputs, slot_inputs, step_inputs
        from .llm.step import CacheStep
        model, layout, vision = self.source.model, self.layout, self.source.vision
        if p.kind == "prefill":
            image_end = vision.image_end if self.hidden is not None else None
            return (CacheStep(model, layout, logits=False, padded=self.padded, image_end=image_end, lora=self.lora),
                    (), step_inputs(layout, p.tokens, self.hidden, self.lora))
        if p.kind == "decode":  # (a padded runtime's decode at position 0 starts a sequence too: a one-token prompt)
            return (CacheStep(model, layout, logits=True, padded=self.padded, lora=self.lora), (),
                    step_inputs(layout, 1, self.hidden, self.lora))
        if p.kind == "image_prefill":
            return (CacheStep(model, layout, logits=False, image=self.image), (),
                    image_inputs(layout, p.tokens, vision.hidden))
        if p.kind == "vision":
            from .llm.vision import ImageRows, sample_image
            return ImageRows(vision), (), {"images": sample_image(vision)}
        logits = p.kind in ("paged_decode", "mixed", "batch_decode")
        lanes = {"lanes": p.rows} if p.kind == "mixed" else {}
        step = CacheStep(model, layout, logits=logits, slots=True, **lanes)
        if p.kind == "mixed":
            return step, (), mixed_inputs(layout, p.rows, p.tokens, self.pages, self.page_size, p.blocks)
        if p.kind in ("paged_decode", "paged_prefill"):
            return step, (), paged_inputs(layout, p.rows, p.tokens, self.pages, self.page_size)
        return step, (), slot_inputs(layout, p.rows, *((p.tokens,) if p.kind == "batch_prefill" else ()))


def _chat(source, chat_template, check: bool) -> None:
    """``chat_template`` in place of the tokenizer's; with ``check``, transformers' ids of the chat probes for
    the target's build to check its runtime against (``source.chat``)."""
    tok = source.tokenizer
    if chat_template is not None:
        if tok is None:
            raise InputError("chat_template= goes with a tokenizer: this model has none", hint="pass tokenizer=")
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise InputError("chat_template must be a template's text (a Jinja chat template)")
        tok.chat_template = chat_template
    if check and tok is not None and tok.chat_template:
        reference = tok.reference()
        if reference is not None:
            from .llm.chat import references
            source.chat = references(reference, tok.chat_template)


def _lora(lora, source, t) -> tuple:
    """``(adapter or None, LoraLayout or None)`` of export_llm's ``lora``: a PEFT folder or a rank."""
    if lora is None:
        return None, None
    if not t.llm.lora:
        raise InputError(f"lora= applies to target='litertlm' (LiteRT-LM's LoRA adapters), not {t.name}")
    if source.vision is not None:
        raise InputError(f"{source.name}: LoRA adapters on a vision-language bundle are not supported yet")
    from .llm.lora import features_of, layout_of, read_peft
    if isinstance(lora, int) and not isinstance(lora, bool):
        return None, layout_of(source.model, lora, source.name)
    if isinstance(lora, (str, os.PathLike)):
        adapter = read_peft(os.fspath(lora), features_of(source.model))
        return adapter, layout_of(source.model, adapter.rank, source.name)
    raise InputError(f"lora= takes a PEFT adapter folder or a rank (16 or 32), not {type(lora).__name__}")


def _export_vision(parts, program_target: str) -> dict:
    """A VLM's image encoder, adapter and token embedder (:mod:`.llm.vision`), each a program of its own:
    ``{"vision_encoder", "vision_adapter", "embedder"}``, float32 (a quantization recipe is the language
    model's)."""
    import torch

    from .llm.vision import sample_image
    image = sample_image(parts)
    with torch.no_grad():
        features = parts.encoder(image)["features"]
    out = {}
    for name, module, sample in (("vision_encoder", parts.encoder, {"images": image}),
                                 ("vision_adapter", parts.adapter, {"soft_tokens": features}),
                                 ("embedder", parts.embedder, {"token_ids": torch.zeros(1, 1, dtype=torch.int32)})):
        sigs = SignatureSet()
        sigs.signature(name, module, (), sample)
        with torch.no_grad():
            out[name] = sigs.export(target=program_target)
    return out


def _check_buckets(buckets, batch_size: int) -> list[int]:
    """``export_llm``'s ``batch_buckets``: distinct integers from 2 to below ``batch_size``, ascending."""
    from .llm.plan import default_buckets
    if buckets is None:
        return default_buckets(batch_size)
    try:
        out = sorted({int(b) for b in buckets})
        ok = all(isinstance(b, int) and not isinstance(b, bool) for b in buckets)
    except (TypeError, ValueError):
        ok = False
    if not ok or any(not 2 <= b < batch_size for b in out):
        raise InputError(f"batch_buckets must be integers from 2 to below batch_size ({batch_size}), got "
                         f"{buckets!r}", hint="e.g. batch_buckets=(4, 16) with batch_size=64; () for none")
    return out


def _check_pages(kv_pages, page_size, batch_size: int, cache_length: int, batched: bool, layout) -> int:
    """The paged cache's pool size (0: no paged programs), or InputError."""
    if kv_pages is None:
        return 0
    if not batched:
        raise InputError("kv_pages (a paged KV cache) applies to target='tpu', the serving engine's programs")
    if layout.states:
        raise InputError("a model with recurrent states cannot have a paged cache: a state is not kept per page",
                         hint="leave kv_pages out (the engine's slots)")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1 or cache_length % page_size:
        raise InputError(f"page_size must be a positive integer dividing the cache length ({cache_length}), "
                         f"got {page_size!r}")
    per_sequence = cache_length // page_size
    if kv_pages == "auto":
        return batch_size * per_sequence + 1
    if not isinstance(kv_pages, int) or isinstance(kv_pages, bool) or kv_pages < per_sequence + 1:
        raise InputError(f"kv_pages must be 'auto' or an integer of at least {per_sequence + 1} (one sequence of "
                         f"the cache's {cache_length} positions, and page 0, which no sequence owns), got {kv_pages!r}")
    return kv_pages


LLM_CHECK_TOLERANCE = 2e-3  # float export against transformers: max logit error over the logits' scale


def _check_llm(program, model, lengths, cache_length: int, quantized: bool, options: dict,
               recurrent: bool = False, padded: bool = False, embed=None, extra: dict | None = None) -> dict:
    """The exported steps against transformers on a probe prompt: a prefill of about a chunk's tokens (a full
    chunk and a padded one; with recurrent states, two full chunks, the second continuing the first's state,
    and one of 1 token, padded as the runtime pads it where it does), then decode steps, their next-token
    logits against the model's."""
    import time

    import numpy as np
    import torch

    from .errors import NumericsError
    from .llm.host import next_token_logits
    if any(getattr(p, "is_meta", False) for p in model.parameters()):
        return {"checked": False, "why": "abstract weights: no values to run"}
    platforms = options.get("platforms")
    if platforms is not None and "cpu" not in platforms:
        return {"checked": False, "why": "no program for this machine (platforms without cpu)"}
    if options.get("mesh"):
        return {"checked": False, "why": "a sharded program (its mesh is not this machine's)"}
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
        model.config.vocab_size
    first = next((k for k in lengths if k > 1), lengths[0])  # a recurrent model's prefill_1 is not a chunk
    n = min(2 * first + 5 if recurrent else first + 3, cache_length - 2)
    start = max(1, n - 4)
    probe = [(7 * i + 3) % vocab for i in range(n + 4)]
    t0 = time.perf_counter()
    ours = np.asarray(next_token_logits(program, probe, start, padded=padded, embed=embed, extra=extra), np.float64)
    with torch.no_grad():
        ref = model(torch.tensor([probe])).logits[0, start:].double().numpy()
    scale = float(np.abs(ref).max()) or 1.0
    error = float(np.abs(ours - ref).max()) / scale
    top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    p_ref = np.exp(ref - ref.max(-1, keepdims=True))
    p_ref /= p_ref.sum(-1, keepdims=True)
    log_ours = ours - ours.max(-1, keepdims=True)
    log_ours -= np.log(np.exp(log_ours).sum(-1, keepdims=True))
    kl = float(np.mean((p_ref * (np.log(p_ref + 1e-30) - log_ours)).sum(-1)))
    report = {"checked": True, "positions": len(ref), "max_error": error, "top1": top1, "kl": kl,
              "seconds": round(time.perf_counter() - t0, 2)}
    if not quantized and error > LLM_CHECK_TOLERANCE:
        worst = int(np.abs(ours - ref).max(-1).argmax())
        raise NumericsError(f"the exported steps' next-token logits differ from transformers' on a probe prompt: "
                            f"max error {error:.2e} of the logits' scale (at decode position {start + worst}), top-1 "
                            f"agreement {top1:.0%}",
                            hint="report it with --debug; torchtpu-export debug finds the first op that differs")
    return report
