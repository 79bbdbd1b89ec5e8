"""The litertlm target: LLM bundles for LiteRT-LM, Google's on-device LLM runtime.

- converter: ``converters/litert`` (the prefill and decode steps of ``llm.CacheStep`` as signatures of one
  ``.tflite``), packed with the tokenizer and ``LlmMetadata`` by ``litert-lm-builder``;
- artifact: ``.litertlm`` (LiteRT-LM's container: a flatbuffer header, then sections);
- runtime: ``runtimes/litertlm`` (``litert_lm.Engine``, CPU backend);
- runnable: :class:`LitertLmBundle` (``generate`` on LiteRT-LM; ``__call__`` runs a signature on the
  LiteRT interpreter); describer: :func:`describe`.

Bundles come from ``tte.export_llm`` / ``torchtpu-export HF_DIR --target litertlm``, not from ``export``.
"""
from __future__ import annotations

import os
import struct
import tempfile

import numpy as np

from ..errors import ArtifactError, InputError
from .base import Runnable, Target, no_topologies

MAGIC = b"LITERTLM"
_HEADER_END_AT = 24  # litertlm_core: the u64 offset where the header's flatbuffer ends
_HEADER_BEGIN = 32


class LitertLmBundle(Runnable):
    """A ``.litertlm``: ``generate(prompt, max_new_tokens)`` runs it on LiteRT-LM's engine;
    ``bundle(tokens=..., input_pos=..., mask=..., kv_cache_k_0=..., signature_name="decode")`` runs one
    step on the LiteRT interpreter (what the engine calls); ``save`` writes it atomically."""

    default_signature = "decode"

    def __init__(self, edge, tokenizer=None, metadata: dict | None = None, path: str | None = None):
        self._edge, self.tokenizer, self.metadata, self.path = edge, tokenizer, metadata or {}, path
        self._engine = None
        self._tmp = None

    @classmethod
    def from_file(cls, path) -> "LitertLmBundle":
        path = os.fspath(path)
        sections = read_sections(path)
        if not any(s["type"] == "TFLiteModel" for s in sections):
            raise ArtifactError(f"{path} holds no TFLite model section")
        return cls(None, None, _llm_metadata(path, sections), path)

    @property
    def edge(self):
        """The prefill/decode ``.tflite`` inside, as an EdgeModel (read from the file on first use)."""
        if self._edge is None:
            from .litert import EdgeModel
            self._edge = EdgeModel(section_bytes(self.path, "TFLiteModel"))
        return self._edge

    @property
    def signatures(self) -> list[str]:
        return self.edge.signatures

    def _call_metadata(self, sig: str):
        return self.edge._call_metadata(sig)

    def _io(self, sig: str):
        return self.edge._io(sig)

    def _run(self, sig: str, inputs: list) -> list[np.ndarray]:
        return self.edge._run(sig, inputs)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the bundle atomically (packed by litert-lm-builder)."""
        from ..fileio import atomic_open, check_writable
        path = check_writable(os.fspath(path))
        if self.path is not None:  # loaded from a file: the same bytes
            with open(self.path, "rb") as src, atomic_open(path) as f:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
            return
        with tempfile.TemporaryDirectory(prefix="tte-litertlm-") as tmp, atomic_open(path) as f:
            pack(self._edge, self.tokenizer, self.metadata, tmp, f)

    def _file(self) -> str:
        if self.path is None:  # made in this process: the engine reads a file
            self._tmp = tempfile.TemporaryDirectory(prefix="tte-litertlm-")
            path = os.path.join(self._tmp.name, "model.litertlm")
            self.save(path)
            return path
        return self.path

    def engine(self, threads: int | None = None):
        if self._engine is None:
            from ..runtimes.litertlm import LitertLmEngine
            self._engine = LitertLmEngine(self._file(), threads)
        return self._engine

    def generate(self, prompt: str, max_new_tokens: int = 64, **sampling) -> str:
        """Text LiteRT-LM generates after ``prompt`` (greedy unless ``top_k``/``top_p``/``temperature``);
        ``chat=True`` sends the prompt as a user message through the bundle's chat template."""
        return self.engine().generate(prompt, max_new_tokens, **sampling)

    def __repr__(self) -> str:
        where = self.path or "in memory"
        return f"LitertLmBundle({where}, signatures={self.signatures})"


def pack(edge, tokenizer, metadata: dict, tmp: str, out) -> None:
    """Writes the bundle to the binary stream ``out`` with litert-lm-builder (files staged in ``tmp``)."""
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
    if tokenizer.bos_id is not None:
        msg.start_token.token_ids.ids.append(tokenizer.bos_id)
    for stop in tokenizer.stop_ids:
        msg.stop_tokens.add().token_ids.ids.append(stop)
    if tokenizer.pad_id is not None:
        msg.pad_token.token_ids.ids.append(tokenizer.pad_id)
    msg.max_num_tokens = metadata["max_num_tokens"]
    msg.llm_model_type.generic_model.SetInParent()
    if tokenizer.chat_template:
        from ..llm import parts_template
        msg.jinja_prompt_template = parts_template(tokenizer.chat_template)
    with open(meta_path, "wb") as f:
        f.write(msg.SerializeToString())
    info = [lb.Metadata(key=f"tte_{k}", value=str(v), dtype=lb.DType.STRING) for k, v in sorted(metadata.items())]
    builder = lb.LitertLmFileBuilder()
    builder.add_system_metadata(lb.Metadata(key="Authors", value="torchtpu-export", dtype=lb.DType.STRING))
    builder.add_tflite_model(model_path, lb.TfLiteModelType.PREFILL_DECODE, additional_metadata=info)
    builder.add_hf_tokenizer(tok_path)
    builder.add_llm_metadata(meta_path)
    builder.build(out)


# ---- reading (never trusting the file's offsets) ---------------------------------------------

def read_sections(path: str) -> list[dict]:
    """The bundle's sections: ``{"type", "begin", "end"}``, every offset checked against the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER_BEGIN)
            if len(head) < _HEADER_BEGIN or head[:8] != MAGIC:
                raise ArtifactError(f"{path} is not a LiteRT-LM bundle (no LITERTLM header)")
            (header_end,) = struct.unpack_from("<Q", head, _HEADER_END_AT)
            if not _HEADER_BEGIN < header_end <= min(size, 1 << 24):
                raise ArtifactError(f"{path}: header end {header_end} is outside the file ({size} bytes)")
            header = f.read(header_end - _HEADER_BEGIN)
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    try:
        from litert_lm_builder import litertlm_core
        from litert_lm_builder import litertlm_header_schema_py_generated as schema
    except ImportError as e:
        raise InputError("reading a .litertlm needs LiteRT-LM's packer: pip install 'torchtpu-export[litertlm]'") from e
    try:
        meta = schema.LiteRTLMMetaData.GetRootAs(header, 0)
        objects = meta.SectionMetadata()
        out = []
        for i in range(objects.ObjectsLength() if objects is not None else 0):
            obj = objects.Objects(i)
            begin, end = obj.BeginOffset(), obj.EndOffset()
            if not header_end <= begin <= end <= size:
                raise ArtifactError(f"{path}: section {i} spans bytes {begin}..{end}, outside the file ({size} bytes)")
            out.append({"type": litertlm_core.any_section_data_type_to_string(obj.DataType()),
                        "begin": begin, "end": end})
        return out
    except ArtifactError:
        raise
    except Exception as e:  # a damaged flatbuffer: any of struct, index or value errors
        raise ArtifactError(f"{path}: the LiteRT-LM header is damaged ({type(e).__name__}: {e})") from e


def section_bytes(path: str, kind: str, limit: int | None = None, sections: list | None = None) -> bytes:
    """The bytes of the first ``kind`` section (``sections``: :func:`read_sections`' answer, if already read)."""
    for s in sections if sections is not None else read_sections(path):
        if s["type"] == kind:
            n = s["end"] - s["begin"]
            if limit is not None and n > limit:
                raise ArtifactError(f"{path}: the {kind} section is {n:,} bytes, more than {limit:,}")
            with open(path, "rb") as f:
                f.seek(s["begin"])
                return f.read(n)
    raise ArtifactError(f"{path} has no {kind} section")


def _llm_metadata(path: str, sections) -> dict:
    from google.protobuf.message import DecodeError
    from litert_lm_builder.runtime.proto import llm_metadata_pb2
    if not any(s["type"] == "LlmMetadataProto" for s in sections):
        return {}
    msg = llm_metadata_pb2.LlmMetadata()
    try:
        msg.ParseFromString(section_bytes(path, "LlmMetadataProto", limit=64 << 20, sections=sections))
    except DecodeError as e:
        raise ArtifactError(f"{path}: its LlmMetadata section is damaged ({e})") from e
    return {"start_token": list(msg.start_token.token_ids.ids) or None,
            "stop_tokens": [list(t.token_ids.ids) or t.token_str for t in msg.stop_tokens],
            "max_num_tokens": msg.max_num_tokens, "model_type": msg.llm_model_type.WhichOneof("model_type"),
            "chat_template": bool(msg.jinja_prompt_template)}


# ---- the target record ------------------------------------------------------------------------

def from_llm(edge, source, layout, prefill_lengths) -> LitertLmBundle:
    if source.tokenizer is None:
        raise InputError(f"{source.name}: a .litertlm bundle needs the tokenizer",
                         hint="pass tokenizer= (a folder with tokenizer.json, or a fast tokenizer)")
    meta = {"max_num_tokens": layout.length, "prefill_lengths": ",".join(map(str, prefill_lengths)),
            "model_type": getattr(source.model.config, "model_type", "?")}
    return LitertLmBundle(edge, source.tokenizer, meta)


def build(captures: dict, options: dict):
    raise InputError("a .litertlm bundle is an LLM's: make it with tte.export_llm(model_folder, target='litertlm') "
                     "or torchtpu-export MODEL_FOLDER --target litertlm")


def load(path) -> LitertLmBundle:
    return LitertLmBundle.from_file(path)


def describe(path: str, topologies=None) -> dict:
    """What ``inspect`` prints for a ``.litertlm``: its sections, LlmMetadata and the model's signatures."""
    no_topologies(topologies)
    from .litert import _describe
    sections = read_sections(path)
    desc = _describe(path, section_bytes(path, "TFLiteModel", sections=sections))
    meta = _llm_metadata(path, sections)
    desc.update(kind="litertlm", size=os.path.getsize(path), llm_metadata=meta,
                sections=[{"type": s["type"], "bytes": s["end"] - s["begin"]} for s in sections])
    desc["extra_lines"] = [f"section {s['type']}: {s['end'] - s['begin']:,} bytes" for s in sections] + \
        [f"llm metadata: {k} {v}" for k, v in meta.items()] + desc.get("extra_lines", [])
    return desc


def cli_options(args, sample_args, sample_kwargs) -> dict:
    return {}


TARGET = Target(
    name="litertlm", summary="LLM bundles (.litertlm) for LiteRT-LM on phones, desktops and the web",
    converter="litert", runtime="litertlm", suffix=".litertlm", runnable=LitertLmBundle, signature="decode",
    build=build, load=load, describe=describe, cli_options=cli_options, cli_flags=("quantize",), debuggable=False,
    program_target="litert", from_llm=from_llm, llm_only=True,
)
