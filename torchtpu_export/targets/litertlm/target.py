"""The litertlm target: LLM bundles for LiteRT-LM, Google's on-device LLM runtime.

- converter: ``converters/litert`` (the prefill and decode steps of ``llm.CacheStep`` as signatures of one
  ``.tflite``), packed with the tokenizer and ``LlmMetadata`` by ``litert-lm-builder``;
- artifact: ``.litertlm`` (LiteRT-LM's container: a flatbuffer header, then sections), written and read by
  ``artifact`` (``pack``, ``read_sections``), checked by ``checks.check`` before LiteRT-LM reads any of it;
- runtime: ``runtimes/litertlm`` (``litert_lm.Engine``, CPU backend);
- runnable: :class:`LitertLmBundle` (``generate`` on LiteRT-LM; ``__call__`` runs a signature on the
  LiteRT interpreter); describer: :func:`describe`.

Bundles come from ``tte.export_llm`` / ``torchtpu-export HF_DIR --target litertlm``, not from ``export``.
"""
from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import tempfile

import numpy as np

from ...errors import ArtifactError, InputError
from ...llm.plan import DECODE
from ..base import LlmSupport, Runnable, Target, no_topologies
from .artifact import EXECUTOR_METADATA, VISION_ENCODER, pack, section_bytes
from .checks import Checked, check


class LitertLmBundle(Runnable):
    """A ``.litertlm``: ``generate(prompt, max_new_tokens)`` runs it on LiteRT-LM's engine;
    ``bundle(tokens=..., input_pos=..., mask=..., kv_cache_k_0=..., signature_name="decode")`` runs one
    step on the LiteRT interpreter (what the engine calls); ``save`` writes it atomically."""

    default_signature = DECODE

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
        return {s.name: tuple(s.shape) for s in self.edge.inputs(DECODE) if s.name.startswith("lora_atten_")}

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


_ROLES = {VISION_ENCODER: "the image encoder (an image's pixels)", "tf_lite_vision_adapter":
          "the image adapter (the encoder's features to rows of the prompt)",
          "tf_lite_embedder": "the token embedder (the model takes embeddings)"}


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
    if s["code"] == EXECUTOR_METADATA:
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
    converter="litert", runtime="litertlm", suffix=".litertlm", runnable=LitertLmBundle, signature=DECODE,
    build=build, load=load, describe=describe, cli_options=cli_options, debuggable=False,
    recipes=LITERT.recipes, magic=lambda head, names: head == b"LITERTLM",
    # LiteRT-LM's executor (0.18.1) carries the tensors named kv_cache_k_*, kv_cache_v_* and kv_cache_c_* from
    # step to step (one buffer, in place, on CPU), so recurrent states too (kv_cache_c_<i>, kv_cache_c_ssm_<i>);
    # it finds a model's caches by kv_cache_k_0 or kv_cache_c_0. It pads a prompt's last chunk with token 0 at
    # position 0 (PrefillInternal, GetOptimizedPrefillWorkGroups): the steps count the real tokens and keep the
    # states after the last
    llm=LlmSupport(program_target="litert", from_llm=from_llm, check_layout=check_llm_layout, only=True,
                   recurrent_state=True, pads_prompts=True, vision=True, lora=True),
)
