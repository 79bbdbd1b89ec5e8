"""The litertlm target: LLM bundles for LiteRT-LM, Google's on-device LLM runtime.

- converter: ``converters/litert`` (the prefill and decode steps of ``llm.CacheStep`` as signatures of one
  ``.tflite``), packed with the tokenizer and ``LlmMetadata`` by ``litert-lm-builder``;
- artifact: ``.litertlm`` (LiteRT-LM's container: a flatbuffer header, then sections), checked by
  :func:`check` before LiteRT-LM reads any of it;
- runtime: ``runtimes/litertlm`` (``litert_lm.Engine``, CPU backend);
- runnable: :class:`LitertLmBundle` (``generate`` on LiteRT-LM; ``__call__`` runs a signature on the
  LiteRT interpreter); describer: :func:`describe`.

Bundles come from ``tte.export_llm`` / ``torchtpu-export HF_DIR --target litertlm``, not from ``export``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import mmap
import os
import struct
import sys
import tempfile
import types
import zlib

import numpy as np

from ...errors import ArtifactError, InputError
from ..base import Runnable, Target, no_topologies

MAGIC = b"LITERTLM"
_HEADER_END_AT = 24  # litertlm_core: the u64 offset where the header's flatbuffer ends
_HEADER_BEGIN = 32


class LitertLmBundle(Runnable):
    """A ``.litertlm``: ``generate(prompt, max_new_tokens)`` runs it on LiteRT-LM's engine;
    ``bundle(tokens=..., input_pos=..., mask=..., kv_cache_k_0=..., signature_name="decode")`` runs one
    step on the LiteRT interpreter (what the engine calls); ``save`` writes it atomically."""

    default_signature = "decode"

    def __init__(self, edge, tokenizer=None, metadata: dict | None = None, path: str | None = None,
                 checked: "Checked | None" = None, parts: dict | None = None, vision=None, adapter=None):
        self._edge, self.tokenizer, self.metadata, self.path = edge, tokenizer, metadata or {}, path
        # a VLM's: the image encoder, adapter and embedder programs, and the llm.vision.VisionParts they came from
        self.parts, self.vision = parts or {}, vision
        self.adapter = adapter  # llm.lora.LoraAdapter: the PEFT adapter export_llm(lora=) converted
        self._checked = checked  # what check() found in the file LiteRT-LM reads
        self._engine = None
        self._tmp = None

    @classmethod
    def from_file(cls, path) -> "LitertLmBundle":
        path = os.fspath(path)
        checked = check(path)
        return cls(None, None, checked.summary, path, checked)

    @property
    def edge(self):
        """The prefill/decode ``.tflite`` LiteRT-LM runs, as an EdgeModel (read from the file on first use)."""
        if self._edge is None:
            from ..litert.target import EdgeModel
            self._edge = EdgeModel(section_bytes(self.path, self._checked.model))
        return self._edge

    @property
    def signatures(self) -> list[str]:
        return self.edge.signatures

    def _call_metadata(self, sig: str):
        return self.edge.call_metadata(sig)

    def _io(self, sig: str):  # asked only where the file carries no call metadata: the flatbuffer's own
        return self.edge.inputs(sig), self.edge.outputs(sig)

    def _run(self, sig: str, inputs: list) -> list[np.ndarray]:
        return self.edge.run_flat(inputs, sig)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the bundle atomically (packed by litert-lm-builder)."""
        from ...fileio import atomic_open, check_writable
        path = check_writable(os.fspath(path))
        packed = self._file() if self._tmp is not None else self.path  # loaded, or packed already for a check
        if packed is not None:  # the same bytes
            with open(packed, "rb") as src, atomic_open(path) as f:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
            return
        with tempfile.TemporaryDirectory(prefix="tte-litertlm-") as tmp, \
                atomic_open(path, verify=functools.partial(self._verify, path)) as f:
            pack(self._edge, self.tokenizer, self.metadata, tmp, f, self.parts, self.vision)

    def _verify(self, path: str, written: str) -> None:
        """The checks ``run`` and ``tte.load`` make (:func:`check`) of the bundle packed for ``path``, before it
        takes ``path``'s place: an export never writes a bundle they would refuse."""
        try:
            checked = check(written)
        except ArtifactError as e:
            raise ArtifactError(f"the bundle packed for {path} would be refused when loaded: "
                                f"{str(e).replace(written, path)}", hint=e.hint) from None
        self._checked = dataclasses.replace(checked, path=path)

    def save_adapter(self, path) -> None:
        """Writes the LoRA adapter ``export_llm(lora=PEFT_DIR)`` converted, as LiteRT-LM loads it
        (``LoraConfig(lora_path=path)``; ``generate(lora=path)``)."""
        if self.adapter is None:
            raise InputError("this bundle was exported without a LoRA adapter", hint="export_llm(..., lora=PEFT_DIR)")
        self.adapter.save(path)

    def _zero_adapter(self) -> str:
        """A file of this bundle's zero adapter (``llm.lora.zero_adapter``), written once."""
        if getattr(self, "_zeros", None) is None:
            from ...llm.lora import zero_adapter
            self._zeros = tempfile.TemporaryDirectory(prefix="tte-lora-")
            zero_adapter(self.lora_inputs).save(os.path.join(self._zeros.name, "zeros.lora.tflite"))
        return os.path.join(self._zeros.name, "zeros.lora.tflite")

    @property
    def lora_inputs(self) -> dict:
        """``{name: shape}`` of the steps' LoRA inputs (empty: the bundle takes no adapter)."""
        return {s.name: tuple(s.shape) for s in self.edge.inputs("decode") if s.name.startswith("lora_atten_")}

    def _file(self) -> str:
        if self.path is None:  # made in this process: the engine reads a file, packed once
            if self._tmp is None:
                tmp = tempfile.TemporaryDirectory(prefix="tte-litertlm-")
                self.save(os.path.join(tmp.name, "model.litertlm"))
                self._tmp = tmp
            return os.path.join(self._tmp.name, "model.litertlm")
        return self.path

    def check_chat(self, refs: list) -> dict:
        """The chat probes (``llm.chat.references``) through LiteRT-LM's conversation API on this bundle, against
        transformers' ids: the report, or ChatTemplateError naming the probe and the construct."""
        from ...llm.chat import compare
        from .chat import unsupported
        engine = self.engine()
        return compare("LiteRT-LM's conversation API", refs, engine.conversation_ids, engine.detokenize,
                       self.tokenizer.chat_template, unsupported)

    def engine(self, threads: int | None = None):
        if self._engine is None:
            from ...runtimes.litertlm import LitertLmEngine
            path = self._file()
            if self._checked is None:
                self._checked = check(path)
            self._engine = LitertLmEngine(path, threads, vision=self._checked.vision, raw_bos=self._checked.raw_bos)
        return self._engine

    def generate(self, prompt, max_new_tokens: int = 64, *, chat: bool = False, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, stop=None, seed: int | None = None,
                 response_format: dict | None = None, images=(), lora=None):
        """LiteRT-LM's reply to ``prompt`` (text, or token ids the bundle's tokenizer turns into text), as a
        ``Generation`` (text, and the reply's ids as the bundle's tokenizer reads that text): greedy at
        ``temperature=0``, else top-k / top-p sampling seeded by ``seed``. ``chat=True`` sends the prompt as
        a user message through the bundle's chat template. LiteRT-LM ends at the bundle's stop tokens;
        ``stop`` cuts the reply at other token ids too.

        ``response_format`` constrains the reply with LiteRT-LM's constrained decoding (llguidance):
        ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (JSON that follows the schema, written
        compact), ``{"type": "json_object"}`` (any JSON object) or ``{"type": "regex", "pattern": "..."}``
        (the whole reply matches). LiteRT-LM gives llguidance its tokens' spellings, not their bytes
        (google-ai-edge/LiteRT-LM#3510): a format that requires a space or a newline cannot be met, and a
        free JSON string may take a control character; ``pattern``, ``enum`` or ``maxLength`` on strings
        keep them to what the format allows.

        ``images`` (image files: PNG, JPEG, BMP, GIF): a VLM's bundle sees them in the user message, before the
        prompt's text, through the chat template (as ``chat=True``). ``lora``: a LoRA adapter file for this
        bundle (``save_adapter``, ``torchtpu-export adapter``), checked against its LoRA inputs first."""
        from ...llm.contract import Generation, prompt_ids
        from ...llm.grammar import format_of
        from ...runtimes.litertlm import check_image, response_constraint
        if isinstance(images, (str, os.PathLike)):
            images = [images]
        images = [check_image(p) for p in images or ()]
        fmt = format_of(response_format)
        constraint = None if fmt is None else response_constraint(*fmt)  # refused before the engine loads
        if lora is not None:
            from ...llm.lora import check_adapter
            lora = os.fspath(lora)
            check_adapter(lora, self.lora_inputs)
        elif self.lora_inputs:  # the base model: LiteRT-LM would run on whatever its LoRA inputs last held
            lora = self._zero_adapter()
        engine = self.engine()
        if images and not self._checked.vision:
            raise InputError("images go to a vision-language model's bundle; this one has no image encoder",
                             hint="export the VLM's folder with --target litertlm")
        ids = prompt_ids(prompt)
        if ids is not None:
            if chat:
                raise InputError("chat=True takes the prompt as text (the chat template renders messages)")
            prompt = engine.detokenize(ids)
        self._checked.check_prompt(prompt)  # what LiteRT-LM's tokenizer would choke on, refused here
        sampling = dict(top_k=top_k or 1) if not temperature else \
            dict(top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)
        if constraint is not None:
            sampling["constraint"] = constraint
        text = engine.generate(prompt, max_new_tokens, chat=chat, images=tuple(images), lora=lora, **sampling)
        out = engine.tokenize(text) if text else []
        cut = next((i for i, t in enumerate(out) if t in set(stop or ())), None)
        if cut is not None:
            out = out[:cut]
            text = engine.detokenize(out)
        return Generation(text, out, "length" if len(out) >= max_new_tokens else "stop")

    def __repr__(self) -> str:
        where = self.path or "in memory"
        return f"LitertLmBundle({where}, signatures={self.signatures})"


# What a bundle carries for LiteRT-LM's structured outputs and tool calls:
# - constrained decoding (response_format, llguidance) needs nothing of the model type or template: LiteRT-LM's
#   LL_GUIDANCE provider takes the engine's tokenizer and the first stop token of a single id as llguidance's
#   end of text (constraint_provider_factory.cc), which every stop token written here is;
# - a tool call comes back as the reply's ``tool_calls`` only through the model type's data processor: the
#   generic one returns the text as it is; Qwen 2.5's and Qwen 3's (``<tool_call>{json}</tool_call>``) parse
#   it. The other model types LiteRT-LM knows (Gemma 3/4, FunctionGemma, LFM2) bring image/audio handling and
#   their own call syntax, so only the Qwen families are typed here. (HF model_type -> LlmModelType field)
TOOL_CALL_MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen2": "qwen2p5", "qwen2_moe": "qwen2p5"}


# a VLM's programs (llm.vision) -> the sections LiteRT-LM loads them from
PART_SECTIONS = {"vision_encoder": "VISION_ENCODER", "vision_adapter": "VISION_ADAPTER", "embedder": "EMBEDDER"}


def pack(edge, tokenizer, metadata: dict, tmp: str, out, parts: dict | None = None, vision=None) -> None:
    """Writes the bundle to the binary stream ``out`` with litert-lm-builder (files staged in ``tmp``); a VLM's
    ``parts`` (its image encoder, adapter and embedder) as sections of their own, and the image's size and
    tokens (``vision``: llm.vision.VisionParts) in the LlmMetadata."""
    try:
        from litert_lm_builder import litertlm_builder as lb
        from litert_lm_builder.runtime.proto import llm_metadata_pb2
    except ImportError as e:
        raise InputError("writing a .litertlm needs LiteRT-LM's packer: pip install 'torchtpu-export[litertlm]'") from e
    model_path, tok_path, meta_path = (os.path.join(tmp, n) for n in ("model.tflite", "tokenizer.json", "llm.pb"))
    edge.export(model_path)
    with open(tok_path, "w", encoding="utf-8") as f:
        f.write(tokenizer.json)
    msg = llm_metadata_pb2.LlmMetadata()
    # LiteRT-LM prefills a start token before every prompt, whatever the template writes: with a template the BOS
    # is the template's to write, as in transformers (llm.chat), and the raw prompts' is the runtime's
    if tokenizer.bos_id is not None and not tokenizer.chat_template:
        msg.start_token.token_ids.ids.append(tokenizer.bos_id)
    for stop in tokenizer.stop_ids:
        msg.stop_tokens.add().token_ids.ids.append(stop)
    if tokenizer.pad_id is not None:
        msg.pad_token.token_ids.ids.append(tokenizer.pad_id)
    msg.max_num_tokens = metadata["max_num_tokens"]
    kind = TOOL_CALL_MODEL_TYPES.get(str(metadata.get("model_type")))
    if vision is not None:  # the model type whose data processor puts images into the prompt
        typed = getattr(msg.llm_model_type, vision.model_type)
        for field, value in vision.fields.items():
            if field.endswith("_token"):
                getattr(typed, field).token_str = value
            else:
                setattr(typed, field, value)
    else:
        getattr(msg.llm_model_type, kind or "generic_model").SetInParent()
    if tokenizer.chat_template:
        from .chat import litert_template
        # (a VLM's template takes content parts itself, images among them, as transformers gives it them)
        msg.jinja_prompt_template = litert_template(tokenizer.chat_template, tokenizer.specials, parts=vision is None)
        # an app asks LiteRT-LM (ModelInfo) whether a bundle takes tools: it does where the template renders
        # them and LiteRT-LM reads the tool calls back
        msg.supports_function_calling = bool(kind) and "tools" in tokenizer.chat_template
    with open(meta_path, "wb") as f:
        f.write(msg.SerializeToString())
    info = [lb.Metadata(key=f"tte_{k}", value=str(v), dtype=lb.DType.STRING) for k, v in sorted(metadata.items())]
    builder = lb.LitertLmFileBuilder()
    builder.add_system_metadata(lb.Metadata(key="Authors", value="torchtpu-export", dtype=lb.DType.STRING))
    builder.add_tflite_model(model_path, lb.TfLiteModelType.PREFILL_DECODE, additional_metadata=info)
    for name, program in (parts or {}).items():
        part_path = os.path.join(tmp, f"{name}.tflite")
        program.export(part_path)
        builder.add_tflite_model(part_path, getattr(lb.TfLiteModelType, PART_SECTIONS[name]))
    builder.add_hf_tokenizer(tok_path)
    builder.add_llm_metadata(meta_path)
    if vision is not None and vision.image_end is not None:
        builder.add_executor_metadata(_vision_executor_metadata(edge, tmp))
    builder.build(out)


def _vision_executor_metadata(edge, tmp: str) -> str:
    """The ExecutorMetadata of a VLM's bundle, written in ``tmp``: an image's rows attend to one another
    (``ATTENTION_MASK_TYPE_VISION_BIDIRECTIONAL``), as the family's model was trained to read them (the steps
    keep the adapter's closing row causal: ``llm.step.image_end_causal``). LiteRT-LM then takes the caches from
    the metadata's state buffers: each ``kv_cache_*`` in and out of every step, positions on axis 2, kept
    whole (a sliding-window layer's too: the steps mask by position)."""
    from litert_lm_builder.runtime.proto import executor_metadata_pb2 as em
    meta = em.ExecutorMetadata()
    llm = meta.llm_executor_metadata
    llm.attention_mask_settings.attention_mask_type = em.ATTENTION_MASK_TYPE_VISION_BIDIRECTIONAL
    for spec in edge.inputs("decode"):
        if spec.name.startswith("kv_cache_"):
            buf = llm.state_buffers.add()
            buf.prefill_input_name = buf.prefill_output_name = spec.name
            buf.decode_input_name = buf.decode_output_name = spec.name
            buf.type = em.StateBuffer.TYPE_GLOBAL_KEY_CACHE if spec.name.startswith("kv_cache_k_") else \
                em.StateBuffer.TYPE_GLOBAL_VALUE_CACHE
            buf.sequence_axis = 2
    path = os.path.join(tmp, "executor.pb")
    with open(path, "wb") as f:
        f.write(meta.SerializeToString())
    return path


# ---- the header, read as LiteRT-LM's C++ reads it -------------------------------------------------
# LiteRT-LM (runtime/util/litert_lm_loader.cc, schema/core/litertlm_read.cc) reads the header from the
# file's first 16 KiB with no flatbuffer verifier: a reference outside it, or a model_type item that is
# not text, is a read through a wild or null pointer there. Here every read is checked first.

HEADER_MAX = 16 << 10  # kLitertLmHeaderMaxSize
MAJOR_VERSION = 1  # LITERTLM_MAJOR_VERSION: the only one LiteRT-LM reads
SECTION_TYPES = ("NONE", "GenericBinaryData", "Deprecated", "TFLiteModel", "SP_Tokenizer", "LlmMetadataProto",
                 "HF_Tokenizer_Zlib", "TFLiteWeights", "EmbeddingMetadataProto", "ExecutorMetadataProto",
                 "TtsMetadataProto", "AsrMetadataProto")
_TFLITE, _SP, _LLM_METADATA, _HF, _WEIGHTS, _EXECUTOR_METADATA = 3, 4, 5, 6, 7, 9
_KEYED = (_TFLITE, _SP, _HF, _WEIGHTS)  # sections LiteRT-LM keys by their model_type item
_TEXT_ITEMS = ("model_type", "backend_constraint", "prefer_activation_type")  # items it reads as text
_STRING_VALUE = 9  # VData.StringValue
PREFILL_DECODE = "tf_lite_prefill_decode"
VISION_ENCODER = "tf_lite_vision_encoder"
_ROLES = {VISION_ENCODER: "the image encoder (an image's pixels)", "tf_lite_vision_adapter":
          "the image adapter (the encoder's features to rows of the prompt)",
          "tf_lite_embedder": "the token embedder (the model takes embeddings)"}


class _Flatbuffer:
    """Reads of a flatbuffer (tables, vectors, strings), each checked to lie inside it."""

    def __init__(self, buf: bytes):
        self.buf = buf

    def get(self, fmt: str, pos: int):
        if not 0 <= pos <= len(self.buf) - struct.calcsize(fmt):
            raise ValueError(f"a reference points outside the header (byte {pos} of {len(self.buf)})")
        return struct.unpack_from(fmt, self.buf, pos)[0]

    def table(self, pos: int) -> tuple:
        vtable = pos - self.get("<i", pos)
        return pos, vtable, self.get("<H", vtable)

    def field(self, table: tuple, slot: int) -> int | None:
        pos, vtable, size = table
        off = self.get("<H", vtable + slot) if slot < size else 0
        return pos + off if off else None

    def scalar(self, table: tuple, slot: int, fmt: str, default=0):
        p = self.field(table, slot)
        return default if p is None else self.get(fmt, p)

    def ref(self, pos: int) -> int:
        return pos + self.get("<I", pos)

    def child(self, table: tuple, slot: int) -> tuple | None:
        p = self.field(table, slot)
        return None if p is None else self.table(self.ref(p))

    def tables(self, table: tuple, slot: int) -> list | None:
        p = self.field(table, slot)
        if p is None:
            return None
        v = self.ref(p)
        n = self.get("<I", v)
        if n > (len(self.buf) - v - 4) // 4:
            raise ValueError("a vector runs past the end of the header")
        return [self.table(self.ref(v + 4 + 4 * i)) for i in range(n)]

    def string(self, table: tuple, slot: int) -> bytes | None:
        p = self.field(table, slot)
        if p is None:
            return None
        s = self.ref(p)
        n = self.get("<I", s)
        if n > len(self.buf) - s - 4:
            raise ValueError("a string runs past the end of the header")
        return self.buf[s + 4:s + 4 + n]


def read_sections(path: str) -> list[dict]:
    """The bundle's sections: ``{"index", "type", "code", "begin", "end", "items", "model_type"}``, every
    offset and reference checked against the file and the header the way LiteRT-LM will follow them."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER_BEGIN)
            if len(head) < _HEADER_BEGIN or head[:8] != MAGIC:
                raise ArtifactError(f"{path} is not a LiteRT-LM bundle (no LITERTLM header)")
            major, minor, patch = struct.unpack_from("<3I", head, 8)
            (header_end,) = struct.unpack_from("<Q", head, _HEADER_END_AT)
            if not _HEADER_BEGIN < header_end <= size:
                raise ArtifactError(f"{path}: header end {header_end} is outside the file ({size} bytes)")
            if header_end > HEADER_MAX:
                raise ArtifactError(f"{path}: its header ends at byte {header_end:,}, past the {HEADER_MAX:,} "
                                    "bytes LiteRT-LM reads")
            if major != MAJOR_VERSION:
                raise ArtifactError(f"{path} is LiteRT-LM format {major}.{minor}.{patch}; LiteRT-LM reads "
                                    f"format {MAJOR_VERSION} only")
            header = f.read(header_end - _HEADER_BEGIN)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    fb = _Flatbuffer(header)
    try:
        root = fb.table(fb.ref(0))
        meta = fb.child(root, 6)
        objects = fb.tables(meta, 4) if meta is not None else None
        if objects is None:  # LiteRT-LM follows both without a null check
            raise ArtifactError(f"{path}: its header has no section table")
        out = []
        for i, obj in enumerate(objects):
            code = fb.scalar(obj, 10, "<B")
            begin, end = fb.scalar(obj, 6, "<Q"), fb.scalar(obj, 8, "<Q")
            kind = SECTION_TYPES[code] if code < len(SECTION_TYPES) else f"type {code}"
            if not header_end <= begin <= end <= size:
                raise ArtifactError(f"{path}: section {i} spans bytes {begin}..{end}, outside the file ({size} bytes)")
            items = _items(fb, obj, code, i, path)
            out.append({"index": i, "type": kind, "code": code, "begin": begin, "end": end, "items": items,
                        "model_type": _model_type(items, code, i, path)})
        return out
    except ArtifactError:
        raise
    except (ValueError, struct.error) as e:
        raise ArtifactError(f"{path}: the LiteRT-LM header is damaged ({e})") from None


def _items(fb: _Flatbuffer, obj: tuple, code: int, i: int, path: str) -> dict | None:
    """A section's items, ``{key: text or None}`` (None: the item's value is not text); None without items."""
    entries = fb.tables(obj, 4)
    if entries is None:
        return None
    items = {}
    for kv in entries:
        key = fb.string(kv, 4)
        if key is None:
            continue
        key = key.decode("utf-8", "replace")
        vtype, value = fb.scalar(kv, 6, "<B"), fb.field(kv, 8)
        text = None
        if value is not None and vtype == _STRING_VALUE:
            text = fb.string(fb.table(fb.ref(value)), 4)
        if code in _KEYED and key.lower() in _TEXT_ITEMS and value is not None:
            if text is None:  # LiteRT-LM reads it as a string through a null pointer
                raise ArtifactError(f"{path}: section {i}'s item {key} is not text")
            if key.lower() in items:
                raise ArtifactError(f"{path}: section {i} names its {key.lower()} twice")
            items[key.lower()] = text.decode("utf-8", "replace")
        else:
            items.setdefault(key, None if text is None else text.decode("utf-8", "replace"))
    return items


@functools.lru_cache(maxsize=None)
def _model_types() -> frozenset:
    """The model_type values LiteRT-LM accepts (its TfLiteModelType enums, lower case)."""
    try:
        from litert_lm_builder import litertlm_builder as lb
        from litert_lm_builder.runtime.proto import embedding_metadata_pb2, llm_metadata_pb2
    except ImportError as e:
        raise InputError("reading a .litertlm needs LiteRT-LM's packer: pip install 'torchtpu-export[litertlm]'") from e
    names = set(llm_metadata_pb2.LlmMetadata.TfLiteModelType.keys()) | \
        set(embedding_metadata_pb2.EmbeddingMetadata.TfLiteModelType.keys())
    names = {n.lower() for n in names if not n.endswith("_UNSPECIFIED")}
    return frozenset(names | {t.value for t in lb.TfLiteModelType})


def _model_type(items: dict | None, code: int, i: int, path: str) -> str | None:
    """The second half of the key LiteRT-LM files the section under (ExtractBufferKeyAndTfLiteSectionHint)."""
    if code not in _KEYED or items is None:
        return None
    model_type = items.get("model_type")
    if model_type is None:
        return PREFILL_DECODE if code in (_TFLITE, _WEIGHTS) else None
    if model_type.lower() not in _model_types():
        raise ArtifactError(f"{path}: section {i} has model_type {model_type[:80]!r}, which LiteRT-LM does not know")
    return model_type.lower()


def section_bytes(path: str, section: dict, limit: int | None = None) -> bytes:
    """The bytes of one section of :func:`read_sections`' answer."""
    n = section["end"] - section["begin"]
    if limit is not None and n > limit:
        raise ArtifactError(f"{path}: its {section['type']} section is {n:,} bytes, more than {limit:,}")
    with open(path, "rb") as f:
        f.seek(section["begin"])
        return f.read(n)


# ---- which sections LiteRT-LM reads ------------------------------------------------------------
# LiteRT-LM files each section under (type, model_type) and a later section replaces an earlier one
# with the same key (litert_lm_loader.cc: section_locations_[key] = ...). Its text engine takes the
# tokenizer from SP_Tokenizer before HF_Tokenizer_Zlib, each keyed tf_lite_prefill_decode first and then
# without a model_type (model_resources_litert_lm.cc, GetTokenizer), the LlmMetadataProto, and the
# TFLite model keyed tf_lite_prefill_decode; other TFLite models (embedders, vision and audio encoders,
# drafters) it loads for the models that use them.

def reads(sections: list[dict]) -> dict:
    """``{"model", "tokenizer", "metadata", "tflite": [...], "replaced": {index: by index}}``: the sections
    LiteRT-LM's text engine reads (None where the bundle has none), every TFLite model it may load, and
    those a later section of the same key replaces (never read)."""
    last, replaced = {}, {}
    for s in sections:
        key = (s["code"], s["model_type"])
        if key in last:
            replaced[last[key]["index"]] = s["index"]
        last[key] = s
    tokenizer = next((last[k] for k in ((_SP, PREFILL_DECODE), (_SP, None), (_HF, PREFILL_DECODE), (_HF, None))
                      if k in last), None)
    return {"model": last.get((_TFLITE, PREFILL_DECODE)), "tokenizer": tokenizer,
            "metadata": last.get((_LLM_METADATA, None)), "replaced": replaced,
            "tflite": [s for (code, _), s in last.items() if code == _TFLITE]}


# ---- what LiteRT-LM reads, checked before it does ----------------------------------------------

# A bundle's tokenizer, whatever the bundle's size: at most this many bytes (inflated; Gemma 3's tokenizer.json,
# the largest in use, is 33 MB, its tokenizer.model 4.7 MB), loaded first by its library in a child process with
# at most this much address space past its start (a real tokenizer takes ~10x its JSON: 318 MB for a 32 MB,
# 262k-token one) and this long, then here, where the same bytes take what they took there
MAX_TOKENIZER = 64 << 20
TOKENIZER_MEMORY = 1 << 30
TOKENIZER_SECONDS = 120
MAX_METADATA = 64 << 20
MAX_NUM_TOKENS = 1 << 24  # when the model's cache length cannot be read
# Text that exercises a tokenizer's unknown-token path, byte fallback and pre-tokenizers; LiteRT-LM's
# tokenizer (a Rust library behind a C API) aborts the process on any error these would raise.
PROBE = "Hello, world! 0123 héllo wörld ﬁ 中文 日本語 한국어 😀 \t\n  \U000f0000 \x00 <|x|>"


@dataclasses.dataclass
class Checked:
    """What :func:`check` found: the sections LiteRT-LM reads, the tokenizer it will load (as the
    ``tokenizers`` package loads the same JSON), the model's context and the LlmMetadata in brief."""

    path: str
    sections: list
    reads: dict
    tokenizer: object  # tokenizers.Tokenizer
    tokenizer_bytes: int
    vocab: int
    context: int | None  # tokens the model's KV cache holds
    start_tokens: int
    summary: dict
    # a raw prompt's BOS, where the bundle has no start token for LiteRT-LM to put first (its template writes the
    # chat's) and the tokenizer's post-processor adds one: the text a raw prompt is prefilled after
    raw_bos: str = ""

    @property
    def model(self) -> dict:
        return self.reads["model"]

    @property
    def vision(self) -> bool:
        """Whether the bundle has an image encoder (LiteRT-LM's engine then takes a vision backend)."""
        return any(s["model_type"] == VISION_ENCODER for s in self.reads["tflite"])

    def check_prompt(self, prompt: str) -> None:
        """InputError for a prompt LiteRT-LM cannot take (not text, longer than the context);
        ArtifactError where the bundle's tokenizer fails on it (LiteRT-LM would abort)."""
        if not isinstance(prompt, str):
            raise InputError(f"the prompt must be text, not {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"the prompt is not valid text (character {e.start} cannot be written as UTF-8)") from None
        ids = _encode(self.tokenizer, prompt, f"{self.path}'s tokenizer")
        if prompt and not ids:  # LiteRT-LM fails on a prefill of no tokens
            raise InputError(f"{self.path}'s tokenizer makes no tokens of the prompt (its characters are not in "
                             "the vocabulary)")
        if self.context is not None and len(ids) + self.start_tokens + bool(self.raw_bos) >= self.context:
            raise InputError(f"the prompt is {len(ids):,} tokens; {self.path} holds {self.context:,} tokens of "
                             f"context, so a prompt may take at most {self.context - self.start_tokens - 1:,}",
                             hint="shorten the prompt, or export the model with a longer --cache-length")


def check(path: str) -> Checked:
    """Every section LiteRT-LM will read, checked before it reads it: the header (as its C++ follows it),
    the tokenizer (inflated within a bound, loaded and run on a probe by its library in a child process
    first), the LlmMetadata (present, token ids inside the vocabulary, fields in range) and each TFLite
    model (litert_format's validator). ArtifactError (exit 5) names the first problem."""
    path = os.fspath(path)
    sections = read_sections(path)
    found = reads(sections)
    for role, what in (("model", "no TFLite model of type tf_lite_prefill_decode"),
                       ("tokenizer", "no tokenizer section (HF_Tokenizer_Zlib)"), ("metadata", "no LlmMetadata")):
        if found[role] is None:
            raise ArtifactError(f"{path} has {what}, which LiteRT-LM needs to run it")
    for s in [found["tokenizer"], found["metadata"], *found["tflite"]]:
        if s["end"] == s["begin"]:
            raise ArtifactError(f"{path}: its {s['type']} section (section {s['index']}) is empty")
    tok = found["tokenizer"]
    msg = _parse_metadata(path, found["metadata"])
    for s in sections:
        if s["code"] == _EXECUTOR_METADATA:
            _parse_executor_metadata(path, s)
    if tok["code"] == _SP:
        tokenizer, text_bytes = _sp_tokenizer(path, tok, msg.jinja_prompt_template)
    else:
        tokenizer, text_bytes = _hf_tokenizer(path, tok, msg.jinja_prompt_template)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    context, model_info = _tflite_models(path, found)
    problem = _metadata_problem(msg, tokenizer, vocab, context)
    if problem:
        raise ArtifactError(f"{path}: its LlmMetadata is out of range: {problem}")
    template = msg.jinja_prompt_template
    _encode(tokenizer, PROBE + template[:1 << 20], f"{path}'s tokenizer")  # the template's own text too
    start = msg.start_token  # LiteRT-LM puts it before every prompt
    n_start = len(start.token_ids.ids) or (len(_encode(tokenizer, start.token_str, f"{path}'s tokenizer"))
                                           if start.token_str else 0)
    summary = _summary(msg)
    summary.update(model_info)
    raw_bos = _post_processor_bos(tokenizer) if not n_start and tok["code"] != _SP else ""
    return Checked(path, sections, found, tokenizer, text_bytes, vocab, context, n_start, summary, raw_bos)


def _post_processor_bos(tokenizer) -> str:
    """The text of the token a ``tokenizers`` tokenizer's post-processor puts first (its BOS), or ""."""
    with_special, plain = tokenizer.encode("a").ids, tokenizer.encode("a", add_special_tokens=False).ids
    if len(with_special) == len(plain) + 1 and with_special[1:] == plain:
        return tokenizer.id_to_token(with_special[0]) or ""
    return ""


def _said(e: BaseException) -> str:
    # an error a library raised, on one line: it may quote the file's text (a token, a key)
    from ...untrusted import printable
    return printable(f"{type(e).__name__}: {str(e)[:200]}")


def _panic(e: BaseException) -> bool:
    # tokenizers (pyo3) raises a Rust panic as pyo3_runtime.PanicException, a BaseException
    return type(e).__name__ == "PanicException"


@contextlib.contextmanager
def _rust_quiet():
    """Rust's panic hook writes the panic (and, with RUST_BACKTRACE, a backtrace) to file descriptor 2
    before tokenizers raises it; the error is reported once, by the caller."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _encode(tokenizer, text: str, what: str) -> list[int]:
    try:
        with _rust_quiet():
            return tokenizer.encode(text, add_special_tokens=False).ids
    except BaseException as e:
        if not (isinstance(e, Exception) or _panic(e)):
            raise
        raise ArtifactError(f"{what} fails on text ({_said(e)}); LiteRT-LM would abort on it") from None


def _hf_tokenizer(path: str, section: dict, template: str):
    """The HF_Tokenizer_Zlib section (a u64 size, then zlib) inflated no further than it may go, within
    load_json's caps, loaded by ``tokenizers`` and run both ways and on the probe and the chat template's text
    in a child process (:func:`_in_child`), then loaded here."""
    what = f"{path}'s tokenizer (section {section['index']})"
    data = section_bytes(path, section, limit=MAX_TOKENIZER + (1 << 20))  # zlib never grows text by that much
    if len(data) <= 8:
        raise ArtifactError(f"{what} is {len(data)} bytes, too short for its size and zlib data")
    declared = int.from_bytes(data[:8], "little")
    if declared > MAX_TOKENIZER:
        raise ArtifactError(f"{what} says it inflates to {declared:,} bytes; a bundle's tokenizer may take at most "
                            f"{MAX_TOKENIZER:,}", hint="Gemma 3's tokenizer.json, the largest in use, is 33 MB: "
                                                       "one that large is a zip bomb")
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(memoryview(data)[8:], declared + 1)  # never past what it declares
    except zlib.error as e:
        raise ArtifactError(f"{what} is not zlib data ({e})") from None
    if len(text) > declared:
        raise ArtifactError(f"{what} inflates to more than the {declared:,} bytes it declares")
    if not inflater.eof:
        raise ArtifactError(f"{what} is cut short: its zlib stream ends after {len(text):,} of the "
                            f"{declared:,} bytes it declares")
    if len(text) != declared or inflater.unused_data:  # LiteRT-LM would hand its tokenizer zeros or junk
        raise ArtifactError(f"{what} inflates to {len(text):,} bytes, not the {declared:,} it declares"
                            if len(text) != declared else f"{what} has bytes after its zlib stream")
    del data
    from ...untrusted import check_json
    check_json(text, what, max_bytes=MAX_TOKENIZER)
    try:
        import tokenizers
    except ImportError as e:
        raise InputError("checking a .litertlm's tokenizer needs the tokenizers package: "
                         "pip install 'torchtpu-export[litertlm]'") from e
    kind, said = _in_child(_HF_CHECK, text, template, what, "the tokenizers library")
    if kind == "json":
        raise ArtifactError(f"{what} is not valid JSON ({said})")
    if kind == "object":
        raise ArtifactError(f"{what} is JSON but not a tokenizer (not an object)")
    if kind == "encode":
        raise ArtifactError(f"{what} fails on text ({said}); LiteRT-LM would abort on it")
    if kind != "ok":
        raise ArtifactError(f"{what} does not load as a Hugging Face tokenizer ({said}); LiteRT-LM would "
                            "abort on it")
    try:
        with _rust_quiet():
            tokenizer = tokenizers.Tokenizer.from_buffer(text)
    except BaseException as e:  # it loaded in the child
        if not (isinstance(e, Exception) or _panic(e)):
            raise
        raise ArtifactError(f"{what} does not load as a Hugging Face tokenizer ({_said(e)}); LiteRT-LM would "
                            "abort on it") from None
    return tokenizer, declared


# LiteRT-LM's tokenizers (the tokenizers library's Rust behind a C API, SentencePiece's C++, which trusts the
# model's protobuf) abort the process on what they cannot load; they may also take gigabytes or minutes on a
# crafted one. So a bundle's tokenizer is loaded and run first by the same library in a child process
# (``python -I``: the library alone) under TOKENIZER_MEMORY of address space and TOKENIZER_SECONDS, whose crash
# costs nothing. It reads a u64 size, the tokenizer and the text to encode from its stdin, its address-space
# limit from argv, and prints "ok", or what failed and why, on its last line.
_LIMITED = """
import resource, struct, sys
try:
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[1]),) * 2)
except (OSError, ValueError):  # no /proc: only the time limit
    pass
stdin = sys.stdin.buffer
(n,) = struct.unpack("<Q", stdin.read(8))
data = stdin.read(n)
probe = stdin.read().decode("utf-8", "replace")

def said(e):
    return " ".join(f"{type(e).__name__}: {str(e)[:200]}".split())
"""

_HF_CHECK = "import json\nimport tokenizers\n" + _LIMITED + """
try:
    tok = tokenizers.Tokenizer.from_buffer(data)
    tok.decode(list(range(tok.get_vocab_size(with_added_tokens=True))), skip_special_tokens=False)
except BaseException as e:  # a Rust panic is a BaseException
    try:  # the JSON's fault, or the tokenizer's?
        kind = "load" if isinstance(json.loads(data), dict) else "object"
    except (ValueError, RecursionError) as bad:
        kind, e = "json", bad
    except MemoryError:
        kind = "load"
    print(kind, said(e))
    sys.exit()
try:
    tok.encode(probe, add_special_tokens=False)
except BaseException as e:
    print("encode", said(e))
    sys.exit()
print("ok")
"""

_SP_CHECK = "import sentencepiece\n" + _LIMITED + """
try:
    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    sp.EncodeAsIds(probe)
    sp.DecodeIds(list(range(sp.GetPieceSize())))
except BaseException as e:
    print("load", said(e))
    sys.exit()
print("ok")
"""


def _in_child(script: str, data: bytes, template: str, what: str, library: str) -> tuple[str, str]:
    """``(kind, why)``: what ``script`` said of the tokenizer ``data`` run on the probe and ``template`` in a
    child process ("ok"; else what failed, and why, printable); ArtifactError where it crashed or ran out of
    time."""
    import signal
    import subprocess
    from ...untrusted import printable
    probe = (PROBE + template[:1 << 20]).encode("utf-8", "replace")
    try:
        r = subprocess.run([sys.executable, "-I", "-c", script, str(TOKENIZER_MEMORY)],
                           input=struct.pack("<Q", len(data)) + data + probe, capture_output=True,
                           timeout=TOKENIZER_SECONDS)
    except subprocess.TimeoutExpired:
        raise ArtifactError(f"{what} takes longer than {TOKENIZER_SECONDS} s to load and run") from None
    lines = r.stdout.decode("utf-8", "replace").strip().splitlines()
    kind, _, why = lines[-1].partition(" ") if r.returncode == 0 and lines else ("crash", "", "")
    # past the limit: Python's MemoryError, Rust's and C++'s allocation failures (they abort)
    if kind != "ok" and (why.startswith("MemoryError") or b"memory allocation of" in r.stderr
                         or b"std::bad_alloc" in r.stderr):
        raise ArtifactError(f"{what} takes more than the {TOKENIZER_MEMORY >> 20} MB a tokenizer may take to load "
                            "and run", hint="a real one takes ~10x its JSON")
    if kind == "crash":
        try:
            how = signal.Signals(-r.returncode).name if r.returncode < 0 else f"exit {r.returncode}"
        except ValueError:
            how = f"signal {-r.returncode}"
        why = f"{library} crashes on it ({how})"
    return kind, printable(why)


class _SentencePiece:
    """A SentencePiece processor with the few ``tokenizers.Tokenizer`` calls the checks make."""

    def __init__(self, processor):
        self.sp = processor

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.sp.GetPieceSize()

    def id_to_token(self, i: int):
        return self.sp.IdToPiece(i) if 0 <= i < self.sp.GetPieceSize() else None

    def encode(self, text: str, add_special_tokens: bool = False):
        return types.SimpleNamespace(ids=self.sp.EncodeAsIds(text))


def _sp_tokenizer(path: str, section: dict, template: str):
    """The SP_Tokenizer section (a SentencePiece ModelProto), loaded and run on the probe and the chat
    template's text by SentencePiece in a child process (:func:`_in_child`), then here."""
    what = f"{path}'s tokenizer (section {section['index']}, SentencePiece)"
    data = section_bytes(path, section, limit=MAX_TOKENIZER)
    try:
        import sentencepiece
    except ImportError as e:
        raise InputError("checking a .litertlm's SentencePiece tokenizer needs the sentencepiece package: "
                         "pip install 'torchtpu-export[litertlm]'") from e
    kind, why = _in_child(_SP_CHECK, data, template, what, "SentencePiece")
    if kind != "ok":
        raise ArtifactError(f"{what} does not load as a SentencePiece model ({why}); LiteRT-LM would abort on it")
    processor = sentencepiece.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)
    return _SentencePiece(processor), len(data)


def _tflite_models(path: str, found: dict) -> tuple:
    """Validates every TFLite model LiteRT-LM may load (mapped, not read); the prefill/decode model's
    context length and its signatures."""
    from ..litert.artifact import signature_io, validate
    with open(path, "rb") as f:
        content = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for s in found["tflite"]:
            view = memoryview(content)[s["begin"]:s["end"]]
            try:
                model = validate(view)
                if s is found["model"]:
                    io = signature_io(model)
            except ArtifactError as e:
                raise ArtifactError(f"{path}: its TFLite model {s['model_type']} (section {s['index']}): {e}",
                                    hint=e.hint) from None
            finally:
                model = None
                view.release()
    finally:
        try:
            content.close()
        except BufferError:  # a view into it still lives (in an error's traceback): freed with it
            pass
    if "decode" not in io or not any(k.startswith("prefill") for k in io):
        raise ArtifactError(f"{path}: its model (section {found['model']['index']}) has signatures "
                            f"{', '.join(io) or 'none'}; LiteRT-LM runs prefill* and decode")
    mask = next((t for t in io["decode"]["inputs"] if t.name == "mask"), None)
    context = mask.shape[-1] if mask is not None and mask.shape and isinstance(mask.shape[-1], int) else None
    return (context if context and context > 0 else None), {"signatures": list(io)}


def _parse_metadata(path: str, section: dict):
    try:
        from google.protobuf.message import DecodeError
        from litert_lm_builder.runtime.proto import llm_metadata_pb2
    except ImportError as e:
        raise InputError("reading a .litertlm needs LiteRT-LM's packer: pip install 'torchtpu-export[litertlm]'") from e
    msg = llm_metadata_pb2.LlmMetadata()
    try:
        msg.ParseFromString(section_bytes(path, section, limit=MAX_METADATA))
    except (DecodeError, RecursionError, ValueError) as e:
        raise ArtifactError(f"{path}: its LlmMetadata section is damaged ({_said(e)})") from None
    return msg


def _parse_executor_metadata(path: str, section: dict):
    """An ExecutorMetadataProto section (a VLM's mask policy and cache buffers): where it parses (LiteRT-LM
    0.18.1 runs a bundle whose section does not, as if it had none: test_hostile_litertlm), its enums are ones
    LiteRT-LM defines and each state buffer's sequence axis one a cache has."""
    from google.protobuf.message import DecodeError
    from litert_lm_builder.runtime.proto import executor_metadata_pb2
    msg = executor_metadata_pb2.ExecutorMetadata()
    try:
        msg.ParseFromString(section_bytes(path, section, limit=MAX_METADATA))
    except (DecodeError, RecursionError, ValueError):
        return None
    llm = msg.llm_executor_metadata
    kinds = executor_metadata_pb2.AttentionMaskType.values()
    settings = llm.attention_mask_settings
    for field in ("attention_mask_type", "local_attention_mask_type"):
        if getattr(settings, field) not in kinds:
            raise ArtifactError(f"{path}: its ExecutorMetadata's {field} is {getattr(settings, field)}, which "
                                "LiteRT-LM does not define")
    for buf in llm.state_buffers:
        if buf.type not in executor_metadata_pb2.StateBuffer.Type.values() or not 0 <= buf.sequence_axis < 4:
            raise ArtifactError(f"{path}: its ExecutorMetadata's state buffer {buf.prefill_input_name[:80]!r} has "
                                f"type {buf.type} and sequence axis {buf.sequence_axis}, out of range")
    return msg


def _metadata_problem(msg, tokenizer, vocab: int, context: int | None) -> str | None:
    """Where the LlmMetadata first leaves what LiteRT-LM runs with: token ids outside the vocabulary, an
    empty token (LiteRT-LM indexes its first id), no stop token, enums it does not define, sampler
    values out of range, a context past the model's."""
    if not msg.stop_tokens:
        return "it has no stop token"
    cap = context or MAX_NUM_TOKENS
    if not 0 <= msg.max_num_tokens <= cap:
        return f"max_num_tokens is {msg.max_num_tokens}, outside 0..{cap}" + \
            (" (the model's KV cache)" if context else "")
    if msg.HasField("sampler_params"):
        p = msg.sampler_params
        if p.k < 0 or not 0 <= p.p <= 1 or not (math.isfinite(p.temperature) and p.temperature >= 0):
            return f"sampler_params k {p.k}, p {p.p}, temperature {p.temperature} are out of range"
    for c in msg.channels:
        if not (c.channel_name and c.start and c.end):
            return "a channel lacks its name, start or end"
    stack = [(msg, "")]
    while stack:
        m, where = stack.pop()
        for field, value in m.ListFields():
            values = list(value) if field.is_repeated else [value]
            name = f"{where}{field.name}"
            if field.enum_type is not None:
                bad = [v for v in values if v not in field.enum_type.values_by_number]
                if bad:
                    return f"{name} is {bad[0]}, which LiteRT-LM does not define"
            elif field.message_type is not None:
                kind = field.message_type.name
                for k, v in enumerate(values):
                    at = f"{name}[{k}]" if field.is_repeated else name
                    if kind == "TokenUnion" and not (v.token_str or len(v.token_ids.ids)):
                        return f"{at} is empty"
                    if kind == "TokenIds":
                        for t in np.unique(np.asarray(v.ids, np.int64)).tolist():
                            if not (0 <= t < 2 ** 32 and tokenizer.id_to_token(t) is not None):
                                return f"{at} holds token {t}, which the tokenizer does not have ({vocab:,} tokens)"
                    stack.append((v, f"{at}."))
    return None


def _summary(msg) -> dict:
    return {"start_token": list(msg.start_token.token_ids.ids) or msg.start_token.token_str or None,
            "stop_tokens": [list(t.token_ids.ids) or t.token_str for t in msg.stop_tokens],
            "max_num_tokens": msg.max_num_tokens, "model_type": msg.llm_model_type.WhichOneof("model_type"),
            "chat_template": bool(msg.jinja_prompt_template)}


# ---- the target record ------------------------------------------------------------------------

def check_llm_layout(source, layout) -> None:
    """What a bundle needs before anything is exported: the tokenizer, and a cache LiteRT-LM can find."""
    if source.tokenizer is None:
        raise InputError(f"{source.name}: a .litertlm bundle needs the tokenizer",
                         hint="pass tokenizer= (a folder with tokenizer.json, or a fast tokenizer)")
    if not {"kv_cache_k_0", "kv_cache_c_0"} & set(layout.names()):  # LiteRT-LM's GetKVCacheRootNames
        raise InputError(f"{source.name}: LiteRT-LM finds a model's caches by its first layer's (kv_cache_k_0 or "
                         "kv_cache_c_0), and this model's layer 0 keeps no cache (neither attention nor a "
                         "convolution's state)", hint="export it with --target tpu or --target litert")


def from_llm(edge, source, layout, prefill_lengths, parts: dict | None = None, adapter=None) -> LitertLmBundle:
    check_llm_layout(source, layout)
    meta = {"max_num_tokens": layout.length, "prefill_lengths": ",".join(map(str, prefill_lengths)),
            "model_type": getattr(source.model.config, "model_type", "?")}
    if source.vision is not None:
        meta.update(vision=source.vision.family, image_size=f"{source.vision.height}x{source.vision.width}",
                    image_tokens=source.vision.image_tokens)
    if source.chat is not None:  # what the check below holds the bundle to (it is not returned otherwise)
        meta["chat"] = "; ".join([f"{r.name}: transformers' ids" for r in source.chat if r.ids is not None]
                                 + [f"{r.name}: refused by the template" for r in source.chat if r.ids is None])
    bundle = LitertLmBundle(edge, source.tokenizer, meta, parts=parts, vision=source.vision, adapter=adapter)
    if source.chat is not None:
        source.chat_report = bundle.check_chat(source.chat)
    return bundle


def build(captures: dict, options: dict):
    raise InputError("a .litertlm bundle is an LLM's: make it with tte.export_llm(model_folder, target='litertlm') "
                     "or torchtpu-export MODEL_FOLDER --target litertlm")


def load(path) -> LitertLmBundle:
    return LitertLmBundle.from_file(path)


def _role(s: dict, checked: Checked) -> str:
    found = checked.reads
    if s["index"] in found["replaced"]:
        return f"never read: section {found['replaced'][s['index']]} of the same kind replaces it"
    if s is found["model"]:
        return "the model LiteRT-LM runs"
    if s is found["tokenizer"]:
        return f"the tokenizer ({checked.vocab:,} tokens, {checked.tokenizer_bytes:,} bytes)"
    if s is found["metadata"]:
        return "the LlmMetadata"
    if any(s is t for t in found["tflite"]):
        return _ROLES.get(s["model_type"], "checked; loaded by models that use one")
    if s["code"] == _EXECUTOR_METADATA:
        return "the executor's settings (the attention mask over an image's rows, the cache buffers)"
    return "not read when generating text"


def describe(path: str, topologies=None) -> dict:
    """What ``inspect`` prints for a ``.litertlm``: the checks ``run`` makes, then its sections (which one
    LiteRT-LM reads), LlmMetadata and the signatures of the model LiteRT-LM runs."""
    no_topologies(topologies)
    from ..litert.target import describe_content
    checked = check(path)
    model = checked.model
    with open(path, "rb") as f:
        content = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(content)[model["begin"]:model["end"]]
    try:
        desc = describe_content(path, view)
    finally:
        view.release()
        try:
            content.close()
        except BufferError:
            pass
    meta = {k: v for k, v in checked.summary.items() if k != "signatures"}
    sections = [{"type": s["type"], "bytes": s["end"] - s["begin"], "model_type": s["model_type"],
                 "role": _role(s, checked)} for s in checked.sections]
    desc.update(kind="litertlm", size=os.path.getsize(path), llm_metadata=meta, sections=sections)
    lines = []
    for s in sections:
        kind = f"{s['type']} ({s['model_type']})" if s["model_type"] else s["type"]
        lines.append(f"section {kind}: {s['bytes']:,} bytes, {s['role']}")
    chat = (model.get("items") or {}).get("tte_chat")
    if checked.summary.get("chat_template"):
        from ...untrusted import printable
        lines.append(f"chat: the export checked its probe conversations in LiteRT-LM's conversation API against "
                     f"transformers' apply_chat_template ids ({printable(chat)})" if chat else
                     "chat: not checked against transformers (another tool's bundle, an older export, or check=False)")
    desc["extra_lines"] = lines + [f"llm metadata: {k} {v}" for k, v in meta.items()] + desc.get("extra_lines", [])
    return desc


def cli_options(args, sample_args, sample_kwargs) -> dict:
    return {}


from ..litert.target import TARGET as LITERT  # noqa: E402  (its programs are litert's)

TARGET = Target(
    name="litertlm", summary="LLM bundles (.litertlm) for LiteRT-LM on phones, desktops and the web",
    converter="litert", runtime="litertlm", suffix=".litertlm", runnable=LitertLmBundle, signature="decode",
    build=build, load=load, describe=describe, cli_options=cli_options, debuggable=False,
    recipes=LITERT.recipes, magic=lambda head, names: head == b"LITERTLM",
    program_target="litert", from_llm=from_llm, check_llm_layout=check_llm_layout, llm_only=True,
    # LiteRT-LM's executor (0.18.1) carries the tensors named kv_cache_k_*, kv_cache_v_* and kv_cache_c_* from
    # step to step (one buffer, in place, on CPU), so recurrent states too (kv_cache_c_<i>, kv_cache_c_ssm_<i>);
    # it finds a model's caches by kv_cache_k_0 or kv_cache_c_0. It pads a prompt's last chunk with token 0 at
    # position 0 (PrefillInternal, GetOptimizedPrefillWorkGroups): the steps count the real tokens and keep the
    # states after the last
    recurrent_state=True, pads_prompts=True, vision=True, lora=True,
)
