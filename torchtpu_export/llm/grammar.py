"""Structured outputs: a response format (a JSON schema, any JSON object, a regular expression, a choice
of strings, a Lark or GBNF grammar) compiled by llguidance into a matcher that says, before each step,
which tokens of the model's vocabulary may come next.

llguidance (Microsoft's, the engine behind vLLM's and SGLang's ``guidance`` backend and LiteRT-LM's own
constrained decoding) is the one used: a Rust library with no Python dependencies (xgrammar needs torch
and transformers at import), whose mask for a 32k vocabulary takes tens of microseconds, with
resource limits on every grammar and step (:data:`LIMITS`), so that a request's schema cannot stall the
engine for the others. The masks are bitmasks (one bit per token, int32 words), applied on the device in
the decode step (:func:`torchtpu_export.engine.step.process`).
"""
from __future__ import annotations

import collections
import json
import threading

from ..errors import InputError

# what one request's grammar may cost: its size, and the work of each step's mask (llguidance's fuel)
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=50_000, max_grammar_size=200_000)
# JSON without free whitespace: a model cannot fill its reply with blanks, and the reply is compact
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SPEC = 64 << 10  # characters of schema, pattern or grammar one request may send
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def grammar_text(kind: str, value) -> str:
    """The llguidance grammar of a response format: ``kind`` one of :data:`KINDS`, ``value`` its schema
    (a dict), pattern, list of strings or grammar text (Lark, or GBNF with ``::=``)."""
    from llguidance import LLMatcher, gbnf_to_lark
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
        raise InputError(f"the {kind.replace('_', ' ')} is not valid: {str(e)[:300]}") from None
    raise InputError(f"unknown response format {kind!r}; choose one of {', '.join(KINDS)}")


FORMS = ("{'type': 'json_schema', 'json_schema': {'schema': {...}}}, {'type': 'json_object'} or "
         "{'type': 'regex', 'pattern': '...'}")


def format_of(response_format) -> tuple | None:
    """``generate(response_format=...)`` as ``(kind, value)``, for every LLM artifact: OpenAI's ``{"type":
    "json_schema", "json_schema": {"schema": {...}}}`` (``("json_schema", schema)``; no schema: any JSON),
    ``{"type": "json_object"}`` (a schema of any object), ``{"type": "text"}`` (None: no constraint), or
    ``{"type": "regex", "pattern": "..."}`` (``("regex", pattern)``). One InputError for anything else."""
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
    """The compiled grammars of one model's tokenizer (``tokenizer.json`` text), cached by their text: a
    schema sent again is not compiled again. ``matcher(kind, value)`` checks the grammar against the
    limits and returns a fresh :class:`Matcher` for one reply."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids, cache: int = 256):
        from llguidance import LLParserLimits, LLTokenizer
        try:
            self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(eos_ids) or None)
        except Exception as e:  # noqa: BLE001 - llguidance's reading of a tokenizer it cannot use
            raise InputError(f"structured outputs cannot use this model's tokenizer ({str(e)[:200]})") from None
        self.vocab = vocab
        self.limits = LLParserLimits(**LIMITS)
        self._checked: collections.OrderedDict = collections.OrderedDict()  # grammar text -> None (valid)
        self._size = cache
        self._lock = threading.Lock()

    def matcher(self, kind: str, value) -> "Matcher":
        """A matcher for one reply in ``kind`` (see :func:`grammar_text`); raises InputError for a format
        llguidance cannot compile or that is over the limits."""
        size = len(value) if isinstance(value, str) else len(json.dumps(value)) if value is not None else 0
        if size > MAX_SPEC:
            raise InputError(f"the {kind.replace('_', ' ')} is {size:,} characters; at most {MAX_SPEC:,} are taken")
        text = grammar_text(kind, value)
        with self._lock:
            known = text in self._checked
            if known:
                self._checked.move_to_end(text)
        if not known:
            from llguidance import LLMatcher
            failed, messages = LLMatcher.validate_grammar_with_warnings(text, self.tokenizer, limits=self.limits)
            if failed:
                raise InputError(f"the {kind.replace('_', ' ')} cannot be used: {messages[0][:300]}")
            with self._lock:
                self._checked[text] = None
                while len(self._checked) > self._size:
                    self._checked.popitem(last=False)
        return Matcher(self, text)


class Matcher:
    """One reply's position in its grammar, the engine's constraint protocol: ``fill(row)`` writes the
    allowed next tokens into an int32 bitmask row, ``consume(token)`` advances (False: refused),
    ``stopped`` (nothing more may come), ``error`` (why it cannot go on, or None)."""

    def __init__(self, grammars: Grammars | None, text: str | None, matcher=None):
        if matcher is None:
            from llguidance import LLMatcher
            matcher = LLMatcher(grammars.tokenizer, text, log_level=0, limits=grammars.limits)
        self._m = matcher

    def copy(self) -> "Matcher":
        """Another reply's matcher of the same grammar, at the same point (cheaper than compiling again)."""
        return Matcher(None, None, self._m.deep_copy())

    def fill(self, row) -> None:
        import numpy as np
        mask = np.frombuffer(self._m.compute_bitmask(), np.int32)
        row[:] = 0
        row[:min(len(row), len(mask))] = mask[:len(row)]

    def consume(self, token: int) -> bool:
        return bool(self._m.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None
