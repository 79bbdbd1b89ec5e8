"""LiteRT-LM, Google's on-device LLM runtime (``litert-lm-api``): the engine that runs ``.litertlm``
bundles on the CPU backend here (the same engine runs them on Android, iOS, desktop and the web).

LiteRT-LM aborts the process on some damaged bundles (its tokenizer is a Rust library that panics
across a C API); the target's ``check`` refuses those before a bundle gets here. What LiteRT-LM
still reports as an error (a chat template that fails to render, a step that fails) is the bundle's:
one ArtifactError, exit 5.

Structured outputs (``response_format``) run on LiteRT-LM's own constrained decoding: llguidance (the
LL_GUIDANCE constraint provider) masks each step's tokens to a JSON schema or a regular expression. LiteRT-LM
offers it in its conversation API only (a session takes no constraint), so a constrained raw prompt goes
through a conversation whose template renders the prompt unchanged (:data:`RAW_TEMPLATE`): the same tokens
the raw session prefills. LiteRT-LM fills llguidance's token table with the tokenizer's token *spellings*,
not their bytes (google-ai-edge/LiteRT-LM#3510): with a byte-level BPE tokenizer a space is spelled ``Ġ``
and a newline ``Ċ``, with SentencePiece a space is ``▁``; so a constrained reply never holds a space or a
newline where the format requires one (the format then reaches a dead end and LiteRT-LM fails), and a
free JSON string may take a token whose spelling passes as text but whose bytes are a control character.
JSON replies are asked for compact (:data:`COMPACT_JSON`), which never needs a space."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.images import MAX_IMAGES, open_image

_LOCK = threading.Lock()

MAX_FORMAT = 64 << 10  # characters of JSON schema or pattern one reply may be constrained by
# llguidance's JSON options: no free whitespace and no space after separators (LiteRT-LM's token table
# cannot give one, see above); a schema's own "x-guidance" options win
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# a conversation template that renders the (one) message's text as it is: a raw prompt through the
# conversation API, which constrained decoding needs
# the prompt as it is: each message's text (LiteRT-LM passes a content as a string or a list of text parts)
RAW_TEMPLATE = ("{%- for message in messages -%}{%- if message['content'] is string -%}{{ message['content'] }}"
                "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
                "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}")
_LL_GUIDANCE_HINT = ("rerun with -vv for LiteRT-LM's log; LiteRT-LM gives llguidance the tokens' spellings (a "
                     "space is Ġ or ▁, a newline Ċ), so keep spaces, newlines and non-ASCII text out of what the "
                     "format requires (patterns, enums, property names)")


@dataclasses.dataclass(frozen=True)
class ResponseConstraint:
    """A reply's format as LiteRT-LM takes it: ``kind`` ``"json_schema"`` (``text`` a JSON schema) or
    ``"regex"`` (``text`` a pattern the whole reply matches)."""

    kind: str
    text: str

    def litert(self, lm):
        fmt = lm.ResponseFormat.Type.JSON_OBJECT if self.kind == "json_schema" else lm.ResponseFormat.Type.REGEX
        return lm.ResponseFormat(fmt, self.text)


def response_constraint(kind: str, value) -> ResponseConstraint:
    """The constraint LiteRT-LM takes for a reply format (``llm.grammar.format_of``'s ``(kind, value)``:
    ``"json_schema"`` and a schema, written compact, or ``"regex"`` and a pattern), checked (with
    llguidance, where it is installed, as LiteRT-LM will compile it): one InputError for a bad one."""
    if kind == "regex":
        if len(value) > MAX_FORMAT:
            raise InputError(f"the response_format's pattern is {len(value):,} characters; at most "
                             f"{MAX_FORMAT:,} are taken")
        return _checked(ResponseConstraint("regex", value))
    options = value.get("x-guidance")
    schema = dict(value, **{"x-guidance": dict(COMPACT_JSON, **options) if isinstance(options, dict) else
                            COMPACT_JSON if options is None else options})
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InputError(f"the response_format's JSON schema is not JSON ({type(e).__name__}: {str(e)[:120]})") \
            from None
    if len(text) > MAX_FORMAT:
        raise InputError(f"the response_format's JSON schema is {len(text):,} characters; at most {MAX_FORMAT:,} "
                         "are taken")
    return _checked(ResponseConstraint("json_schema", text))


def _checked(constraint: ResponseConstraint) -> ResponseConstraint:
    """The constraint, once llguidance's Python package compiles it as LiteRT-LM's copy will (without the
    package LiteRT-LM's compile is the check: its failure comes from ``generate``)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        return constraint
    what = "JSON schema" if constraint.kind == "json_schema" else \
        f"pattern {constraint.text!r}" if len(constraint.text) <= 60 else "pattern"
    try:
        grammar = LLMatcher.grammar_from_json_schema(constraint.text) if constraint.kind == "json_schema" else \
            LLMatcher.grammar_from_regex(constraint.text)
        error = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        error = str(e)
    if error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        why = next((line[len("error:"):].strip() for line in lines if line.startswith("error:")),
                   lines[0] if lines else "")
        from torchtpu_export.untrusted import printable
        raise InputError(f"the response_format's {printable(what)} is not valid: {printable(why[:300])}")
    return constraint


def _litert_lm():
    try:
        import litert_lm
    except ImportError as e:
        raise InputError("running a .litertlm needs LiteRT-LM's engine: pip install 'torchtpu-export[litertlm]'") from e
    # its C++ log lines would come on top of the one message an error gets; -vv shows them
    loud = logging.getLogger().isEnabledFor(logging.DEBUG)
    litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR if loud else litert_lm.LogSeverity.SILENT)
    return litert_lm


class LitertLmEngine:
    """A LiteRT-LM engine over one bundle file (CPU backend)."""

    def __init__(self, path: str, threads: int | None = None, vision: bool = False, raw_bos: str = ""):
        lm = _litert_lm()
        self.path = os.fspath(path)
        # a raw prompt's BOS text, where the bundle has no start token (its chat template writes the chat's)
        self.raw_bos = raw_bos
        # a VLM's bundle: its image encoder runs on the CPU backend too
        extra = dict(vision_backend=lm.Backend.CPU(thread_count=threads), max_num_images=MAX_IMAGES) if vision else {}
        try:
            with _LOCK:
                self.engine = lm.Engine(self.path, backend=lm.Backend.CPU(thread_count=threads), **extra)
        except RuntimeError as e:
            raise ArtifactError(f"LiteRT-LM cannot load {self.path}: {e}",
                                hint="the bundle is damaged or was not made for this LiteRT-LM") from e

    def generate(self, prompt: str, max_new_tokens: int = 64, *, chat: bool = False, top_k: int | None = 1,
                 top_p: float | None = None, temperature: float | None = None, seed: int | None = None,
                 constraint: ResponseConstraint | None = None, images: tuple = (), lora: str | None = None) -> str:
        """The text LiteRT-LM generates after ``prompt`` (raw, or as a user message through the bundle's
        chat template with ``chat=True``); greedy by default (top-k 1). ``constraint`` (see
        :func:`response_constraint`) constrains the reply through LiteRT-LM's constrained decoding.
        ``images`` (image files, checked by :func:`check_image`): the user message shows them before the
        prompt's text (a VLM's bundle). ``lora``: a LoRA adapter file the session applies."""
        lm = _litert_lm()
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be positive, got {max_new_tokens}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"the prompt is not valid text (character {e.start} cannot be written as UTF-8)") from None
        sampler = lm.SamplerConfig(top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)
        adapter = {"lora_config": lm.LoraConfig(lora_path=os.path.abspath(lora))} if lora else {}
        try:
            if images:
                return self._converse(lm, prompt, sampler, max_new_tokens, True, constraint, images, adapter)
            if chat or constraint is not None:
                return self._converse(lm, prompt, sampler, max_new_tokens, chat, constraint, (), adapter)
            with self.engine.create_session(apply_prompt_template=False, sampler_config=sampler,
                                            max_output_tokens=max_new_tokens, **adapter) as session:
                session.run_prefill([self.raw_bos, prompt] if self.raw_bos else [prompt])
                # streamed: the text of a whole reply comes through a C string, cut at its first NUL character
                # (a byte-level token can be one); a chunk's is cut alone (that character is left out)
                return "".join(r.texts[0] for r in session.run_decode_async() if r.texts)
        except RuntimeError as e:
            if constraint is not None and self._works(lm, prompt, chat):  # the same call without the format works
                what = "JSON schema" if constraint.kind == "json_schema" else "pattern"
                raise InputError(f"LiteRT-LM could not generate to the response_format's {what} ({e}): its "
                                 "llguidance could not compile it, or the reply came to a point where the format "
                                 "requires a character that no token in LiteRT-LM's token table gives "
                                 "(google-ai-edge/LiteRT-LM#3510)", hint=_LL_GUIDANCE_HINT) from None
            # the prompt was checked against the context before; a failure that another prompt would not
            # meet is the prompt's (the chat template's text made it too long, or the template refuses it)
            if chat and self._chat_works(lm):
                raise InputError(f"LiteRT-LM cannot take this prompt through {self.path}'s chat template ({e}): "
                                 "with the template's text it is longer than the context, or the template "
                                 "refuses it", hint="shorten the prompt, or run without --chat") from None
            what = "answer through the chat template of" if chat else "generate from"
            raise ArtifactError(f"LiteRT-LM could not {what} {self.path} ({e})",
                                hint="the bundle is damaged; rerun with -vv for LiteRT-LM's own log") from None

    def _converse(self, lm, prompt: str, sampler, max_new_tokens: int, chat: bool,
                  constraint: ResponseConstraint | None = None, images: tuple = (),
                  adapter: dict | None = None) -> str:
        """The reply through LiteRT-LM's conversation API: the bundle's chat template with ``chat``, else
        :data:`RAW_TEMPLATE`; constrained to ``constraint`` by llguidance."""
        options = dict(sampler_config=sampler, max_output_tokens=max_new_tokens, **(adapter or {}))
        if not chat:
            options["chat_template"] = ("{{ %s }}" % json.dumps(self.raw_bos) if self.raw_bos else "") + RAW_TEMPLATE
        if constraint is not None:
            options["constrained_decoding_config"] = lm.ConstrainedDecodingConfig(
                enable=True, provider=lm.LiteRtLmConstraintProviderType.LL_GUIDANCE)
        message = prompt
        if images:
            parts = [lm.Content.ImageFile(os.path.abspath(p)) for p in images] + [lm.Content.Text(prompt)]
            message = lm.Message(lm.Role.USER, lm.Contents.of(*parts))
        with self.engine.create_conversation(**options) as conv:
            reply = conv.send_message(message, **({"response_format": constraint.litert(lm)} if constraint else {}))
        return "".join(part.get("text", "") for part in _parts(reply))

    def _works(self, lm, prompt: str, chat: bool) -> bool:
        """Whether one token of an unconstrained reply to ``prompt`` comes (through the conversation API)."""
        try:
            self._converse(lm, prompt, lm.SamplerConfig(top_k=1), 1, chat)
            return True
        except RuntimeError:
            return False

    def _chat_works(self, lm) -> bool:
        try:
            with self.engine.create_conversation(sampler_config=lm.SamplerConfig(top_k=1),
                                                 max_output_tokens=1) as conv:
                conv.send_message("")
            return True
        except RuntimeError:
            return False

    def conversation_ids(self, messages: list, tools: list | None = None) -> list[int]:
        """The token ids LiteRT-LM prefills when ``messages[-1]`` is sent in a conversation whose history is
        ``messages[:-1]`` (with ``tools``, OpenAI's function dicts): the bundle's chat template rendered by its
        engine, then tokenized as its session does (the metadata's start token first, and a rendered text
        starting with its spelling tokenized after it)."""
        lm = _litert_lm()
        options = {}
        if tools:
            options.update(tools=[_tool(lm, t) for t in tools], automatic_tool_calling=False)
        with self.engine.create_conversation(messages=list(messages[:-1]), **options) as conv:
            text = conv.render_message_to_string(messages[-1])
        if not text:  # LiteRT-LM says why only in its log
            raise RuntimeError("LiteRT-LM's engine failed to render the chat template (its log says why: -vv)")
        ids, bos = [], self.engine.bos_token_id
        if bos is not None:
            ids.append(bos)
            spelled = self.engine.detokenize([bos])
            if spelled and text.startswith(spelled):
                text = text[len(spelled):]
                ids.append(bos)
        return ids + list(self.engine.tokenize(text))

    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.tokenize(text))

    def detokenize(self, ids: list[int]) -> str:
        try:
            return self.engine.detokenize(list(ids))
        except (RuntimeError, TypeError, ValueError) as e:
            raise InputError(f"{self.path}'s tokenizer cannot read these token ids ({e})") from None

    def close(self) -> None:
        self.engine.close()


def check_image(path) -> str:
    """``path`` if it is an image file LiteRT-LM can decode (PNG, JPEG, BMP or GIF, read whole by Pillow
    first, within size bounds: ``torchtpu_export.images``), else InputError: LiteRT-LM's decoder is never the
    first to see a file."""
    path = os.fspath(path)
    open_image(path, path).close()
    return path


def _tool(lm, description: dict):
    """An OpenAI function dict as LiteRT-LM's conversation takes a tool (never run: its calls come back)."""
    class Tool(lm.interfaces.Tool):
        def get_tool_description(self):
            return description

        def execute(self, param):
            raise RuntimeError("tools are not run here")
    return Tool()


def _parts(message) -> list:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", message)
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p if isinstance(p, dict) else {"type": "text", "text": str(p)} for p in (content or [])]
