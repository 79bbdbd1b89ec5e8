"""What LiteRT-LM reads of a ``.litertlm``, checked before it reads it: :func:`check` (``run``, ``tte.load``,
``inspect`` and a bundle's ``save`` call it) and its answer :class:`Checked` (and ``check_prompt``). The header
and its sections are read by ``artifact.read_sections``; here: the tokenizer (Hugging Face's or SentencePiece's;
LiteRT-LM's abort the process on what they cannot load, so each is loaded and run by its library in a child
process of bounded memory and time first), the LlmMetadata and ExecutorMetadata protos, every TFLite model
(litert's validator) and the model's context.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import struct
import sys
import types
import zlib

import numpy as np

from ...errors import ArtifactError, InputError
from .artifact import EXECUTOR_METADATA, SP_TOKENIZER, VISION_ENCODER, read_sections, reads, section_bytes


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
        if s["code"] == EXECUTOR_METADATA:
            _parse_executor_metadata(path, s)
    if tok["code"] == SP_TOKENIZER:
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
    raw_bos = _post_processor_bos(tokenizer) if not n_start and tok["code"] != SP_TOKENIZER else ""
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
