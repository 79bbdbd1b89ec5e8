"""An LLM server's text work (tokenizing, the chat template, detokenizing) in worker processes
(:class:`torchtpu_export.workers.WorkerPool`), each operation under a time and a memory budget.

A served file's tokenizer and chat template are the file's: a template that loops for ever or builds a
gigabyte string, or a tokenizer whose regular expression backtracks, must not stall the event loop
that answers every other request and health check, nor grow the server, nor keep SIGTERM from
ending it. So they run in text workers, which load the tokenizer and compile the template once, at
start (a file whose tokenizer or template does not load is refused then: :class:`TextWorkers` raises
ArtifactError), within the workers' limits (128 MB of address space past the loaded tokenizer; the
template's ``*``, ``+`` and ``**`` refuse values longer than it may write; ``time_budget`` seconds an
operation). The server bounds what it sends (prompt characters, message counts) and how much text a
template may write.

This module is also the workers' role (:func:`worker_ops`), so it imports nothing of the package at
its top but :mod:`torchtpu_export.workers`.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

from ..workers import WorkerError, WorkerPool

CHARS_PER_POSITION = 32  # prompt characters per cache position: far more than any real text needs

# One text operation failed (the template refused the messages, a budget ran out, the worker crashed); the
# request that asked for it gets this message, nobody else.
TextError = WorkerError


# ---- the worker (this file run as a script) ---------------------------------------------------

class Codec:
    """The tokenizer and chat template of one served file, as a text worker runs them (and the export's chat
    probes check them). The template gets what transformers' ``apply_chat_template`` passes: the messages,
    ``tools`` (None without), ``documents`` (None), ``add_generation_prompt`` and the tokenizer's special tokens
    by name (``specials``; a file written before they were carried: the BOS and the first stop token)."""

    def __init__(self, tokenizer_json: str, bos_id, eos_id, max_chars: int, images=None, specials=None):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_str(tokenizer_json)
        self.images = images  # a VLM's [marker, sequence]: the processor's text for each image the template marks
        self.max_chars = max_chars
        if specials is None:
            specials = {k: self.tok.id_to_token(i) for k, i in (("bos_token", bos_id), ("eos_token", eos_id))
                        if i is not None}
            specials = {"bos_token": "", "eos_token": "", **{k: v for k, v in specials.items() if v is not None}}
        self.specials = dict(specials)
        self.template = None

    def compile(self, source: str) -> None:
        import jinja2.ext
        self.template = _sandbox(self.max_chars, [jinja2.ext.loopcontrols]).from_string(source)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int], split: int) -> list[str]:
        """The text of ``ids[:split]`` and of ``ids`` (an incremental detokenizer's window)."""
        return [self.tok.decode(ids[:split], skip_special_tokens=True),
                self.tok.decode(ids, skip_special_tokens=True)]

    def decode_many(self, windows: list) -> list:
        """:meth:`decode` of several requests' windows at once (one message per engine step, not one per token)."""
        return [self.decode(ids, split) for ids, split in windows]

    def pieces(self, ids: list[int]) -> list[list]:
        """Each token's own text, its vocabulary entry and its bytes (logprobs name their tokens)."""
        out = []
        for i in ids:
            text = self.tok.decode([i], skip_special_tokens=False)
            entry = self.tok.id_to_token(i)
            out.append([text, entry if entry is not None else f"<{i}>", token_bytes(text, entry)])
        return out

    def chat(self, messages: list, tools: list | None = None) -> list[int]:
        if self.template is None:
            raise TextError("this model has no chat template: use /v1/completions")
        import jinja2
        out, size = [], 0
        try:
            for piece in self.template.generate(messages=messages, tools=tools or None, documents=None,
                                                add_generation_prompt=True, **self.specials):
                size += len(piece)
                if size > self.max_chars:
                    raise TextError(f"the chat template writes more than {self.max_chars:,} characters for "
                                    "these messages (more than the model's cache holds)")
                out.append(piece)
        except jinja2.TemplateError as e:
            raise TextError(f"the chat template fails on these messages: {e}") from None
        text = "".join(out)
        if self.images and self.images[0]:
            marker, sequence = self.images
            if text.count(marker) * len(sequence) > self.max_chars:
                raise TextError(f"the images of these messages take more than {self.max_chars:,} characters")
            text = text.replace(marker, sequence)
        return self.encode(text, special=False)


def _byte_level() -> dict:
    """GPT-2's byte-level alphabet (the character each byte is written as in a ByteLevel vocabulary) inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + k for k in range(256 - len(printable))]
    order = printable + [b for b in range(256) if b not in printable]
    return {chr(c): b for c, b in zip(chars, order)}


_BYTE_LEVEL = _byte_level()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(text: str, entry: str | None) -> list[int]:
    """A token's bytes: its text's, unless that is a partial character (\ufffd), then its vocabulary entry's
    (SentencePiece's byte fallback ``<0xE2>``, a byte-level BPE's ``âĢ``)."""
    if "\ufffd" in text and entry:
        byte = _BYTE_TOKEN.fullmatch(entry)
        if byte:
            return [int(byte.group(1), 16)]
        if all(c in _BYTE_LEVEL for c in entry):
            return [_BYTE_LEVEL[c] for c in entry]
    return list(text.encode("utf-8", "surrogatepass"))


def _sandbox(max_items: int, extensions):
    """jinja's immutable sandbox, as transformers renders chat templates, whose ``*``, ``+`` and ``**``
    refuse to build a value larger than a template may write (and, being intercepted, are never folded
    into constants while the template is compiled)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "**"])

        def call_binop(self, context, operator, left, right):
            sized = (str, list, tuple)
            if operator == "*" and isinstance(left, sized + (int,)) and isinstance(right, sized + (int,)):
                seq, count = (left, right) if isinstance(left, sized) else (right, left)
                if isinstance(seq, sized) and isinstance(count, int) and len(seq) * count > max_items:
                    raise TextError(f"the chat template builds a value of {len(seq) * count:,} items")
            elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                if len(left) + len(right) > max_items:
                    raise TextError(f"the chat template builds a value of {len(left) + len(right):,} items")
            elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 4096 \
                    and isinstance(left, (int, float)) and abs(left) > 1:
                raise TextError("the chat template raises a number to a power too large to compute")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TextError(f"the chat template refuses these messages: {message}")
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)  # transformers' own
    return env


def worker_ops(config: dict) -> dict:
    """The text workers' operations (:mod:`torchtpu_export.workers`' role): the tokenizer loaded, the template
    compiled at ``start`` (within the memory limit)."""
    import jinja2.ext  # noqa: F401 - imported before the memory limit is set
    import jinja2.sandbox  # noqa: F401
    codec = Codec(config["tokenizer"], config["bos_id"], config["eos_id"], config["max_chars"], config.get("images"),
                  config.get("specials"))
    ops = {"encode": codec.encode, "decode": codec.decode, "decode_many": codec.decode_many, "chat": codec.chat,
           "pieces": codec.pieces}
    if config["template"]:
        ops["start"] = lambda: codec.compile(config["template"])
    return ops


_WHAT = {"encode": "the model's tokenizer", "decode": "the model's tokenizer", "decode_many": "the model's tokenizer",
         "chat": "the model's chat template", "pieces": "the model's tokenizer"}


def image_text(vision: dict | None) -> tuple | None:
    """``(marker, sequence)`` of a VLM file's ``llm.vision`` (what the chat template puts for an image, and the
    processor's text for it), or None."""
    return (vision["marker"], vision["sequence"]) if vision else None


class TextWorkers:
    """The text workers of one served file. ``encode``, ``chat`` and ``decode`` are coroutines that run in
    a free worker (waiting for one) and raise :class:`TextError` for the caller alone; ``run`` does one
    operation from a plain thread."""

    def __init__(self, tokenizer_json: bytes, *, template: str | None, bos_id, eos_id, max_chars: int,
                 workers: int = 2, time_budget: float = 10.0, memory_budget: int = 128 << 20,
                 start_budget: float = 30.0, images: tuple | None = None, specials: dict | None = None):
        from ..errors import ArtifactError
        config = {"tokenizer": tokenizer_json.decode("utf-8", "replace"), "template": template, "bos_id": bos_id,
                  "eos_id": eos_id, "max_chars": max_chars, "images": list(images) if images else None,
                  "specials": specials}
        self.time_budget = time_budget
        self._decodes: list = []  # (ids, split, future) waiting for the next batch
        self._flusher = None
        try:
            self._pool = WorkerPool(__name__, config, what=_WHAT, workers=workers, time_budget=time_budget,
                                    memory_budget=memory_budget, start_budget=start_budget)
        except WorkerError as e:
            raise ArtifactError(f"the served file's tokenizer or chat template does not load: {e}",
                                hint="export the model again from a tokenizer that transformers loads") from None

    def run(self, op: str, *args):
        """One operation from a plain thread (``generate``): waits for a free worker, raises TextError."""
        return self._pool.run(op, *args)

    async def call(self, op: str, *args):
        return await self._pool.call(op, *args)

    @staticmethod
    def chars_for(cache_length: int) -> int:
        """The most characters of prompt or template output a model with ``cache_length`` positions takes:
        ``CHARS_PER_POSITION`` per position, plus room for a template's own text."""
        return CHARS_PER_POSITION * cache_length + 4096

    # -- the operations

    async def encode(self, text: str, special: bool = True) -> list[int]:
        return await self.call("encode", text, special)

    async def chat(self, messages: list, tools: list | None = None) -> list[int]:
        return await self.call("chat", messages, tools)

    async def pieces(self, ids: list[int]) -> list[str]:
        return await self.call("pieces", list(ids))

    async def decode(self, ids: list[int], split: int) -> tuple[str, str]:
        """The text of ``ids[:split]`` and of ``ids``. The windows of every request waiting go to a worker in
        one message; when that batch fails, each of them is decoded alone, so that only the request whose
        tokens the tokenizer fails on gets the error."""
        future = asyncio.get_running_loop().create_future()
        self._decodes.append((list(ids), split, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_decodes())
        before, after = await future
        return before, after

    async def _flush_decodes(self) -> None:
        while self._decodes:
            batch, self._decodes = [d for d in self._decodes if not d[2].done()], []
            if not batch:
                continue
            try:
                results = await self.call("decode_many", [[ids, split] for ids, split, _ in batch])
            except TextError:
                results = None
            for k, (ids, split, future) in enumerate(batch):
                if results is None:  # one at a time: the failure is the request's whose tokens cause it
                    try:
                        result = await self.call("decode", ids, split)
                    except TextError as e:
                        if not future.done():
                            future.set_exception(e)
                        continue
                else:
                    result = results[k]
                if not future.done():
                    future.set_result(tuple(result))

    def close(self) -> None:
        self._pool.close()


class Detokenizer:
    """Text deltas of a growing token list, each from a window of the last few tokens (the work per
    token stays constant however long the reply): the window's text before and after the new token
    differ by the delta; a delta ending inside a multi-byte character waits for the rest."""

    def __init__(self, text: TextWorkers):
        self.text, self.ids = text, []
        self.prefix = self.read = 0  # the window starts at ids[prefix]; ids[:read] are sent

    async def add(self, token: int) -> str:
        self.ids.append(token)
        before, after = await self.text.decode(self.ids[self.prefix:], self.read - self.prefix)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    async def flush(self) -> str:
        if self.read == len(self.ids):
            return ""
        before, after = await self.text.decode(self.ids[self.prefix:], self.read - self.prefix)
        self.prefix = self.read = len(self.ids)
        return after[len(before):]
