"""Structured outputs: a response format (a JSON schema, any JSON object, a regular expression, a choice
of strings, a Lark or GBNF grammar) compiled by llguidance into a matcher that says, before each step,
which tokens of the model's vocabulary may come next.

llguidance (Microsoft's, the engine behind vLLM's and SGLang's ``guidance`` backend and LiteRT-LM's own
constrained decoding) is the one used: a Rust library with no Python dependencies (xgrammar needs torch
and transformers at import), whose mask for a 32k vocabulary takes tens of microseconds, with
resource limits on every grammar and step (:data:`LIMITS`), so that a request's schema cannot stall the
engine for the others. The masks are bitmasks (one bit per token, int32 words), applied on the device in
the decode step (:func:`torchtpu_export.engine.step.process`).

llguidance's limits bound each step, but not the first building of a grammar's lexer: a 50-byte schema
(``{"type": "integer", "multipleOf": 999983}``) or a regular expression (``(a{1000}){1000}``) takes
seconds and hundreds of megabytes before they apply. So a format is first compiled, and its first mask
computed, in a grammar worker (:mod:`torchtpu_export.workers`: a process, :data:`COMPILE_SECONDS` and
:data:`COMPILE_MEMORY`, killed and replaced on overrun), and only one that passes there is compiled in
the caller's process, at a cost now known to be bounded. ``multipleOf`` values whose automaton would be
that large are refused before anything is compiled.

llguidance gets the model's vocabulary as a table of each token's bytes built here from the tokenizer
(:class:`_TokenTable`), never from its own ``tokenizer.json`` reader, so that every tokenizer the export
takes has structured outputs: SentencePiece's byte fallback and ``Metaspace``, a bare ``Fuse`` decoder, ids
with no token. A Rust panic in llguidance is one InputError, never a BaseException reaching the server.

This module is also the grammar workers' role (:func:`worker_ops`).
"""
from __future__ import annotations

import collections
import contextlib
import json
import threading

from ..errors import InputError
from ..workers import WorkerError, WorkerPool

# what one request's grammar may cost: its size, and the work of each step's mask (llguidance's fuel)
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=50_000, max_grammar_size=200_000)
# JSON without free whitespace: a model cannot fill its reply with blanks, and the reply is compact
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SPEC = 64 << 10  # characters of schema, pattern or grammar one request may send
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
COMPILE_SECONDS = 5.0  # a format's compile and first mask, in the grammar worker
COMPILE_MEMORY = 128 << 20  # bytes of address space that may take, past the worker's loaded tokenizer
# a JSON schema's multipleOf a/b (in lowest terms) with a above this builds a lexer of about a states
# (llguidance gives up past ~10,000 anyway, after seconds for large primes)
MAX_MULTIPLE_OF = 10_000


def grammar_text(kind: str, value) -> str:
    """The llguidance grammar of a response format: ``kind`` one of :data:`KINDS`, ``value`` its schema
    (a dict), pattern, list of strings or grammar text (Lark, or GBNF with ``::=``)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark
    try:
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise InputError("a JSON schema must be an object")
            return LLMatcher.grammar_from_json_schema(json.dumps(value), defaults=JSON_OPTIONS)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_OPTIONS)
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise InputError("a regular expression must be a non-empty string")
            return LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InputError("a choice must be a non-empty list of non-empty strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        if kind == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise InputError("a grammar must be a non-empty string (Lark, or GBNF with ::=)")
            return LLMatcher.grammar_from_lark(gbnf_to_lark(value) if "::=" in value else value)
    except (ValueError, TypeError, RuntimeError) as e:  # llguidance's own word on what it cannot read
        raise InputError(f"the {kind.replace('_', ' ')} is not valid: {_reason(str(e))}") from None
    raise InputError(f"unknown response format {kind!r}; choose one of {', '.join(KINDS)}")


def check_bounds(kind: str, value) -> None:
    """What is refused before anything is compiled: a format longer than :data:`MAX_SPEC` characters, a
    JSON schema's ``multipleOf`` past :data:`MAX_MULTIPLE_OF` (its lexer's size)."""
    size = len(value) if isinstance(value, str) else len(json.dumps(value)) if value is not None else 0
    if size > MAX_SPEC:
        raise InputError(f"the {kind.replace('_', ' ')} is {size:,} characters; at most {MAX_SPEC:,} are taken")
    if kind != "json_schema":
        return
    from decimal import Decimal
    from fractions import Fraction
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            for key, item in node.items():
                if key == "multipleOf" and isinstance(item, (int, float)) and not isinstance(item, bool) \
                        and item == item and abs(item) != float("inf"):
                    top = Fraction(Decimal(repr(item))).numerator if item else 0
                    if abs(top) > MAX_MULTIPLE_OF:
                        raise InputError(f"multipleOf {item!r} is past what constrained decoding takes (a multiple "
                                         f"of n/m with n at most {MAX_MULTIPLE_OF:,}): its automaton would have "
                                         f"about {abs(top):,} states")
                else:
                    todo.append(item)


def _reason(error: str) -> str:
    """llguidance's error in one line: its first, and the line saying what is wrong in a parse error (the rest
    is the offending text with a caret, or the parser's state dump)."""
    lines = [line.strip() for line in str(error).split("<state>")[0].splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    if lines[0].startswith("NoExtensionBias"):
        return "no text satisfies it"
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return (lines[0] + (f" ({detail})" if detail else ""))[:300]


def _first_mask(matcher, kind: str) -> None:
    """The matcher's first mask computed (its lexer built); InputError when the format fails there or lets no
    token start the reply (``{"$ref": "#"}``, the regular expression ``[^\\s\\S]``)."""
    import numpy as np
    mask = np.frombuffer(matcher.compute_bitmask(), np.int32)
    if matcher.is_error():
        raise InputError(f"the {kind.replace('_', ' ')} cannot be used: {_reason(matcher.get_error())}")
    if not mask.any() and not matcher.is_stopped():
        raise InputError(f"the {kind.replace('_', ' ')} cannot be used: no token of this model can start the reply")


def _panicked(e: BaseException) -> bool:
    # llguidance and tokenizers (pyo3) raise a Rust panic as pyo3_runtime.PanicException, a BaseException
    return type(e).__name__ == "PanicException"


@contextlib.contextmanager
def _panic_refused(what: str):
    """A Rust panic inside (llguidance's, tokenizers') as one InputError naming ``what`` failed."""
    try:
        yield
    except BaseException as e:
        if not _panicked(e):
            raise
        raise InputError(f"{what} failed in llguidance ({_reason(str(e))})") from None


def _tokenizer(tokenizer_json: str, vocab: int, eos_ids):
    from llguidance import LLTokenizer
    try:
        table = _TokenTable(tokenizer_json, vocab, eos_ids)
        return LLTokenizer(table, n_vocab=vocab, eos_token=table.eos_ids or None)
    except BaseException as e:  # noqa: BLE001 - what tokenizers or llguidance raise on a tokenizer they cannot use
        if not (isinstance(e, Exception) or _panicked(e)):
            raise
        raise InputError(f"structured outputs cannot use this model's tokenizer ({_reason(str(e))[:200]})") from None


# characters one of which a vocabulary has as a token of its own (the context each token is decoded in)
_ANCHORS = "aeoistnx0"


class _TokenTable:
    """A model's tokenizer as llguidance takes it from Python (``llguidance.TokenizerWrapper``'s protocol):
    ``tokens``, each id's bytes as the server's detokenizer writes them in the middle of a reply; the ids of
    special tokens (the reply never holds their text; llguidance matches them only as tokens); and a call
    that tokenizes text into ids whose bytes are that text (llguidance forces text through it).

    llguidance's own ``tokenizer.json`` reader is not used: it refuses decoders it does not classify (a
    bare ``Fuse``, ``Metaspace``), sizes the table by the count of tokens so that a vocabulary with holes
    loses its last ids (masks that allow the wrong tokens), and panics on a token spelled ``<0x...>``
    that is not one byte. Built from the tokenizer itself, each id is what ``decode`` gives for it after
    another token (a leading space stays, as mid-reply); a partial character is its spelling's byte
    (``<0xE2>``, byte-level ``âĢ``); an id with no token, or past the model's ``vocab``, is empty and
    never allowed."""

    is_tokenizer_wrapper = True
    bos_token_id = None

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids):
        from tokenizers import Tokenizer
        self._tok = Tokenizer.from_str(tokenizer_json)
        self.special_token_ids = sorted(i for i, t in self._tok.get_added_tokens_decoder().items()
                                        if t.special and 0 <= i < vocab)
        self.tokens = self._spellings(vocab)
        for i in self.special_token_ids:
            self.tokens[i] = self._tok.id_to_token(i).encode("utf-8", "surrogatepass")
        self.eos_ids = [int(i) for i in eos_ids if 0 <= int(i) < vocab]
        self.eos_token_id = self.eos_ids[0] if self.eos_ids else None
        self._encoder = _fragment_encoder(tokenizer_json) or self._tok
        self._greedy, self._longest = None, 1  # bytes -> id, built when a text first fails to tokenize to itself

    def _spellings(self, vocab: int) -> list[bytes]:
        from .textproc import token_bytes
        tok = self._tok
        size = min(vocab, max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        entries = [tok.id_to_token(i) for i in range(size)]
        anchor = next((c for c in _ANCHORS if tok.token_to_id(c) is not None
                       and tok.decode([tok.token_to_id(c)]) == c), None)
        texts = [None] * size
        if anchor is not None:
            pairs = tok.decode_batch([[tok.token_to_id(anchor), i] for i in range(size)], skip_special_tokens=False)
            texts = [t[1:] if t.startswith(anchor) else None for t in pairs]
        alone = [i for i in range(size) if texts[i] is None and entries[i] is not None]
        for i, text in zip(alone, tok.decode_batch([[i] for i in alone], skip_special_tokens=False)):
            texts[i] = text
        out = [bytes(token_bytes(t, e)) if e is not None else b"" for t, e in zip(texts, entries)]
        return out + [b""] * (vocab - size)

    def __call__(self, text) -> list[int]:
        # called from inside llguidance, which panics on an exception: whatever goes wrong, greedy it is
        data = text if isinstance(text, bytes) else str(text).encode("utf-8", "surrogatepass")
        try:
            ids = self._encoder.encode(data.decode("utf-8"), add_special_tokens=False).ids
            if all(0 <= i < len(self.tokens) for i in ids) and b"".join(self.tokens[i] for i in ids) == data:
                return ids
        except BaseException as e:  # noqa: BLE001 - tokenizers' panics included
            if not (isinstance(e, Exception) or _panicked(e)):
                raise
        return self._greedy_ids(data)

    def _greedy_ids(self, data: bytes) -> list[int]:
        """The longest token at each point (a tokenization whose bytes are ``data``, as far as tokens go)."""
        if self._greedy is None:  # built whole before it is seen: the server's threads may tokenize at once
            special, greedy = set(self.special_token_ids), {}
            for i, b in enumerate(self.tokens):
                if b and i not in special:
                    greedy.setdefault(b, i)
            self._longest = max(map(len, greedy), default=1)
            self._greedy = greedy
        ids, at = [], 0
        while at < len(data):
            for end in range(min(len(data), at + self._longest), at, -1):
                if data[at:end] in self._greedy:
                    ids.append(self._greedy[data[at:end]])
                    at = end
                    break
            else:
                at += 1  # a byte no token has: the text cannot be written, llguidance's lexer says so
        return ids


def _fragment_encoder(tokenizer_json: str):
    """The tokenizer without what it puts before a text's first word (SentencePiece's prepended ``▁``, a
    byte-level prefix space): llguidance tokenizes fragments from the middle of a reply. None when it has
    nothing of the kind, or cannot be rebuilt without it."""
    config = json.loads(tokenizer_json)
    changed = False

    def plain(node):
        nonlocal changed
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Sequence":
                parts = node.get("normalizers") if "normalizers" in node else node.get("pretokenizers")
                if isinstance(parts, list):
                    kept = [plain(n) for n in parts if not (isinstance(n, dict) and n.get("type") == "Prepend")]
                    changed |= len(kept) < len(parts)
                    parts[:] = kept
            elif kind == "Metaspace" and node.get("prepend_scheme", "always") != "never":
                node["prepend_scheme"], changed = "never", True
            elif kind in ("Metaspace", "ByteLevel") and node.get("add_prefix_space"):
                node["add_prefix_space"], changed = False, True
        return node
    if isinstance(config.get("normalizer"), dict) and config["normalizer"].get("type") == "Prepend":
        config["normalizer"], changed = None, True
    plain(config.get("normalizer"))
    plain(config.get("pre_tokenizer"))
    if not changed:
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_str(json.dumps(config))
    except Exception:  # noqa: BLE001 - the verified tokenization, or greedy, stands in
        return None


def worker_ops(config: dict) -> dict:
    """The grammar workers' operation (:mod:`torchtpu_export.workers`' role): ``check(kind, value)`` compiles
    the format and its first mask with the model's tokenizer, and returns llguidance's grammar text."""
    from llguidance import LLMatcher, LLParserLimits
    tokenizer = _tokenizer(config["tokenizer"], config["vocab"], config["eos_ids"])
    limits = LLParserLimits(**LIMITS)

    def check(kind: str, value) -> str:
        text = grammar_text(kind, value)
        with _panic_refused(f"compiling the {kind.replace('_', ' ')}"):
            failed, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer, limits=limits)
            if failed:
                raise InputError(f"the {kind.replace('_', ' ')} cannot be used: {_reason(messages[0])}")
            _first_mask(LLMatcher(tokenizer, text, log_level=0, limits=limits), kind)
        return text
    return {"check": check}


# where a JSON schema holds subschemas: keywords whose value is one, a list of them, or a name -> one map
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def check_strict(spec: dict) -> None:
    """OpenAI's ``json_schema`` object (``{name, schema, strict}``) checked for ``strict``: a boolean, and when
    true a schema that OpenAI's structured outputs take as strict: every object has ``additionalProperties:
    false`` and lists each of its properties in ``required``. One InputError naming the first subschema that
    breaks them (a JSON pointer, ``#/properties/a``); a schema that is not strict is taken as it is."""
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InputError(f"response_format json_schema's strict is a boolean, not {json.dumps(strict)[:40]}")
    if not strict:
        return
    todo = [("#", spec.get("schema", {}))]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict):
            continue
        where = "the schema's root (#)" if path == "#" else path
        kind = node.get("type")
        if kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node:
            if node.get("additionalProperties") is not False:
                has = "none" if "additionalProperties" not in node else \
                    f"additionalProperties: {json.dumps(node['additionalProperties'])[:60]}"
                raise InputError(f"a strict JSON schema needs additionalProperties: false on every object; {where} "
                                 f"has {has} (or pass strict: false)")
            names, required = node.get("properties") or {}, node.get("required") or []
            missing = [n for n in names if n not in required] if isinstance(names, dict) else []
            if missing:
                raise InputError(f"a strict JSON schema needs every property in required; {where} does not require "
                                 f"{', '.join(repr(n) for n in missing[:5])[:200]} (an optional one is written "
                                 "nullable, type [..., 'null']; or pass strict: false)")
        found = [(f"{path}/{key}", node.get(key)) for key in _ONE]
        for key in _LIST:
            if isinstance(node.get(key), list):
                found.extend((f"{path}/{key}/{i}", item) for i, item in enumerate(node[key]))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                found.extend((f"{path}/{key}/{_pointer(name)}", item) for name, item in node[key].items())
        todo.extend(reversed(found))


def _pointer(name: str) -> str:
    # a property name as a JSON pointer's step (RFC 6901), kept short for a message
    return str(name).replace("~", "~0").replace("/", "~1")[:60]


FORMS = ("{'type': 'json_schema', 'json_schema': {'schema': {...}}}, {'type': 'json_object'} or "
         "{'type': 'regex', 'pattern': '...'}")


def format_of(response_format) -> tuple | None:
    """``generate(response_format=...)`` as ``(kind, value)``, for every LLM artifact: OpenAI's ``{"type":
    "json_schema", "json_schema": {"schema": {...}}}`` (``("json_schema", schema)``; no schema: any JSON;
    ``"strict": true`` with a schema OpenAI would not take as strict is refused, see :func:`check_strict`),
    ``{"type": "json_object"}`` (a schema of any object), ``{"type": "text"}`` (None: no constraint), or
    ``{"type": "regex", "pattern": "..."}`` (``("regex", pattern)``). One InputError for anything else."""
    found = _format_of(response_format)
    if found is not None:
        check_bounds(*found)
    return found


def _format_of(response_format) -> tuple | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", {}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InputError("response_format json_schema takes {'type': 'json_schema', 'json_schema': {'schema': "
                             "{...}}}: the schema is a JSON object")
        check_strict(spec)
        return "json_schema", schema
    if kind == "regex":
        pattern = response_format.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise InputError("response_format regex takes {'type': 'regex', 'pattern': '...'}: the pattern is a "
                             "non-empty string")
        return "regex", pattern
    what = f"a {type(response_format).__name__}" if not isinstance(response_format, dict) else \
        "a dict without a type" if kind is None else f"type {kind!r}"[:80]
    raise InputError(f"response_format is {what}: response_format must be {FORMS}")


class Grammars:
    """The formats one model's tokenizer (``tokenizer.json`` text) has compiled, cached by their value: a
    schema sent again is not checked again. ``compile`` / ``compile_async`` check a format in the grammar
    worker (started here) and return its grammar text; ``matcher(kind, value)`` a fresh
    :class:`Matcher` for one reply."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids, cache: int = 256):
        from llguidance import LLParserLimits
        self.tokenizer = _tokenizer(tokenizer_json, vocab, eos_ids)
        self.vocab = vocab
        self.limits = LLParserLimits(**LIMITS)
        try:
            self._pool = WorkerPool(__name__, {"tokenizer": tokenizer_json, "vocab": vocab, "eos_ids": list(eos_ids)},
                                    what={"check": "compiling the response format"}, time_budget=COMPILE_SECONDS,
                                    memory_budget=COMPILE_MEMORY)
        except WorkerError as e:
            raise InputError(f"structured outputs cannot use this model's tokenizer ({e})") from None
        self._checked: collections.OrderedDict = collections.OrderedDict()  # (kind, value) -> grammar text
        self._size = cache
        self._lock = threading.Lock()

    def _known(self, kind: str, value):
        check_bounds(kind, value)
        key = (kind, json.dumps(value, sort_keys=True))
        with self._lock:
            text = self._checked.get(key)
            if text is not None:
                self._checked.move_to_end(key)
        return key, text

    def _remember(self, key, text: str) -> str:
        with self._lock:
            self._checked[key] = text
            while len(self._checked) > self._size:
                self._checked.popitem(last=False)
        return text

    def compile(self, kind: str, value) -> str:
        """``kind``'s ``value`` (see :func:`grammar_text`) checked in the grammar worker: its grammar text, or
        InputError for a format llguidance cannot compile, that no text satisfies, or past the limits."""
        key, text = self._known(kind, value)
        if text is not None:
            return text
        try:
            return self._remember(key, self._pool.run("check", kind, value))
        except WorkerError as e:
            raise InputError(str(e)) from None

    async def compile_async(self, kind: str, value) -> str:
        """:meth:`compile` from the event loop (waiting for the worker holds no thread)."""
        key, text = self._known(kind, value)
        if text is not None:
            return text
        try:
            return self._remember(key, await self._pool.call("check", kind, value))
        except WorkerError as e:
            raise InputError(str(e)) from None

    def matcher(self, kind: str, value) -> "Matcher":
        """A matcher for one reply in ``kind`` (see :meth:`compile`)."""
        return Matcher(self, self.compile(kind, value))

    def close(self) -> None:
        self._pool.close()


class Matcher:
    """One reply's position in its grammar, the engine's constraint protocol: ``fill(row)`` writes the
    allowed next tokens into an int32 bitmask row, ``consume(token)`` advances (False: refused),
    ``stopped`` (nothing more may come), ``error`` (why it cannot go on, or None)."""

    def __init__(self, grammars: Grammars | None, text: str | None, matcher=None):
        if matcher is None:  # a checked grammar: its lexer built here, before the engine steps with it
            from llguidance import LLMatcher
            with _panic_refused("compiling the response format"):
                matcher = LLMatcher(grammars.tokenizer, text, log_level=0, limits=grammars.limits)
                _first_mask(matcher, "response format")
        self._m = matcher
        self._panic = None  # a panic in a step: the reply cannot go on (the engine ends it with this)

    def copy(self) -> "Matcher":
        """Another reply's matcher of the same grammar, at the same point (cheaper than compiling again)."""
        return Matcher(None, None, self._m.deep_copy())

    def fill(self, row) -> None:
        import numpy as np
        row[:] = 0
        try:
            mask = np.frombuffer(self._m.compute_bitmask(), np.int32)
        except BaseException as e:
            if not _panicked(e):
                raise
            self._panic = f"llguidance failed ({_reason(str(e))})"
            return
        row[:min(len(row), len(mask))] = mask[:len(row)]

    def consume(self, token: int) -> bool:
        try:
            return bool(self._m.consume_token(int(token)))
        except BaseException as e:
            if not _panicked(e):
                raise
            self._panic = f"llguidance failed ({_reason(str(e))})"
            return False

    @property
    def stopped(self) -> bool:
        return self._panic is None and self._m.is_stopped()

    @property
    def error(self) -> str | None:
        if self._panic is not None:
            return self._panic
        return _reason(self._m.get_error()) if self._m.is_error() else None
