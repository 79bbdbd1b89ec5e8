"""The ``.litertlm`` file: LiteRT-LM's container, a flatbuffer header, then sections (TFLite models, the
tokenizer, the ``LlmMetadata`` proto, a VLM's ``ExecutorMetadata``).

- writer: :func:`pack`, through ``litert-lm-builder`` (0.18.1, which writes format 1.7.0);
- reader: :func:`read_sections` (the header and its sections, every offset and reference checked the way
  LiteRT-LM's C++ follows them), :func:`reads` (which of them LiteRT-LM reads), :func:`section_bytes`. It reads
  format ``MAJOR_VERSION`` (1, any minor version), the only one LiteRT-LM reads, and refuses any other.

What the sections hold is checked in ``checks``.
"""
from __future__ import annotations

import functools
import os
import struct

from ...errors import ArtifactError, InputError

MAGIC = b"LITERTLM"
_HEADER_END_AT = 24  # litertlm_core: the u64 offset where the header's flatbuffer ends
_HEADER_BEGIN = 32


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
# the codes of the SECTION_TYPES the reader and the checks tell apart
TFLITE_MODEL, SP_TOKENIZER, LLM_METADATA, HF_TOKENIZER, TFLITE_WEIGHTS, EXECUTOR_METADATA = 3, 4, 5, 6, 7, 9
# sections LiteRT-LM keys by their model_type item
_KEYED = (TFLITE_MODEL, SP_TOKENIZER, HF_TOKENIZER, TFLITE_WEIGHTS)
_TEXT_ITEMS = ("model_type", "backend_constraint", "prefer_activation_type")  # items it reads as text
_STRING_VALUE = 9  # VData.StringValue
PREFILL_DECODE = "tf_lite_prefill_decode"
VISION_ENCODER = "tf_lite_vision_encoder"


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
        return PREFILL_DECODE if code in (TFLITE_MODEL, TFLITE_WEIGHTS) else None
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
    tokenizer = next((last[k] for k in ((SP_TOKENIZER, PREFILL_DECODE), (SP_TOKENIZER, None),
                                        (HF_TOKENIZER, PREFILL_DECODE), (HF_TOKENIZER, None)) if k in last), None)
    return {"model": last.get((TFLITE_MODEL, PREFILL_DECODE)), "tokenizer": tokenizer,
            "metadata": last.get((LLM_METADATA, None)), "replaced": replaced,
            "tflite": [s for (code, _), s in last.items() if code == TFLITE_MODEL]}

