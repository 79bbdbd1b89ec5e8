"""The conversation is part of an LLM artifact's contract: every runtime that renders a chat (LiteRT-LM's
conversation API for a ``.litertlm``, the server's text workers for a ``.tpu``) must give the token ids
transformers' ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` gives.

The export renders probe conversations (:data:`PROBES`: a user message; system and user; a history with an
assistant turn; a request with tools, where the template takes them) through the engine that will render them at
run time and compares the ids with transformers' (:func:`references`, :func:`compare`). What still differs is
refused (:class:`ChatTemplateError`), naming the probe, the first token that differs and the template's
constructs the engine is known to render otherwise; ``chat_template=`` / ``--chat-template FILE`` supplies
another template."""
from __future__ import annotations

import dataclasses

from ..errors import InputError

# a function as OpenAI's and transformers' tools take it
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                   "required": ["city"]}}}

# (name, messages, tools)
PROBES = (
    ("a user message", [{"role": "user", "content": "Hello! What can you do?"}], None),
    ("system and user", [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                         {"role": "user", "content": "What is the capital of France?"}], None),
    ("a history with an assistant turn", [{"role": "user", "content": "Hi there."},
                                          {"role": "assistant", "content": "Hello! How can I help you today?"},
                                          {"role": "user", "content": "Tell me a joke about cats."}], None),
    ("a request with tools", [{"role": "user", "content": "What is the weather in Paris?"}], [WEATHER_TOOL]),
)


class ChatTemplateError(InputError):
    """A runtime renders a probe conversation into other token ids than transformers does."""


@dataclasses.dataclass
class Reference:
    """transformers' ids for one probe (``ids`` None where the template refuses the probe: ``why``)."""

    name: str
    messages: list
    tools: list | None
    ids: list | None
    why: str | None = None


def references(hf_tokenizer, template: str | None = None) -> list[Reference]:
    """transformers' ``apply_chat_template`` ids of each probe that the template takes: a probe with tools only
    where the template reads ``tools``; a probe the template refuses (a system role it does not have,
    ``raise_exception``) is kept with ``ids`` None and the reason."""
    template = template if template is not None else getattr(hf_tokenizer, "chat_template", None)
    out = []
    for name, messages, tools in PROBES:
        if tools and "tools" not in (template or ""):
            continue
        try:
            ids = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                   chat_template=template)
        except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja2's TemplateError and others)
            out.append(Reference(name, messages, tools, None, f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        if hasattr(ids, "keys"):  # a BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        out.append(Reference(name, messages, tools, [int(i) for i in ids]))
    return out


def compare(runtime: str, refs: list[Reference], render, decode, template: str, known=None) -> dict:
    """Each probe of ``refs`` rendered by ``render(messages, tools) -> ids`` (``runtime``'s engine) against
    transformers' ids; a probe the template refuses must be refused there too (``render`` raising). Returns the
    report (``{"runtime", "probes": [names checked], "refused": [names]}``); ChatTemplateError names the first
    probe that differs, where, and the constructs ``known(template)`` lists as rendered otherwise by
    ``runtime``."""
    checked, refused = [], []
    for ref in refs:
        try:
            ids = render(ref.messages, ref.tools)
        except Exception as e:  # noqa: BLE001 - the engine's refusal, whatever its class
            if ref.ids is None:
                refused.append(ref.name)
                continue
            raise ChatTemplateError(f"{runtime} cannot render the chat template for {ref.name} "
                                    f"({str(e)[:200]}), which transformers renders"
                                    + _constructs(known, template), hint=HINT) from None
        if ref.ids is None:
            raise ChatTemplateError(f"{runtime} renders {ref.name}, which transformers' template refuses "
                                    f"({ref.why})", hint=HINT)
        if list(ids) != ref.ids:
            at = next((i for i, (a, b) in enumerate(zip(ids, ref.ids)) if a != b), min(len(ids), len(ref.ids)))
            raise ChatTemplateError(
                f"{runtime} renders {ref.name} into other token ids than transformers' apply_chat_template: "
                f"{len(ids)} tokens against {len(ref.ids)}, first differing at token {at} "
                f"({_piece(decode, ids, at)} where transformers has {_piece(decode, ref.ids, at)})"
                + _constructs(known, template), hint=HINT)
        checked.append(ref.name)
    return {"runtime": runtime, "probes": checked, "refused": refused}


HINT = ("export with another template (--chat-template FILE, chat_template=) that both render alike, or report "
        "the construct")


def _piece(decode, ids: list, at: int) -> str:
    if at >= len(ids):
        return "the end"
    return repr(decode(list(ids[max(0, at - 3):at + 4])))[:80] + f" around id {ids[at]}"


def _constructs(known, template: str) -> str:
    found = known(template) if known is not None and template else []
    return ("; the template uses what it renders otherwise: " + ", ".join(found[:6])) if found else ""


def specials_of(hf_tokenizer) -> dict:
    """The special tokens transformers passes a chat template (``special_tokens_map``'s strings: ``bos_token``,
    ``eos_token``, ``unk_token``, ``pad_token``)."""
    found = getattr(hf_tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in found.items() if isinstance(v, str) and k.endswith("_token")}


def check_text_workers(tokenizer, refs: list, vision: dict | None, cache_length: int) -> dict:
    """The probes through the code a ``.tpu``'s text workers run (:class:`textproc.Codec`, here in this process:
    the export's own template), against transformers' ids; the report, or ChatTemplateError."""
    from .textproc import Codec, TextWorkers, image_text
    codec = Codec(tokenizer.json, tokenizer.bos_id, tokenizer.stop_ids[0] if tokenizer.stop_ids else None,
                  TextWorkers.chars_for(cache_length), image_text(vision), tokenizer.specials)
    codec.compile(tokenizer.chat_template)
    return compare("the server's text workers", refs, codec.chat,
                   lambda ids: codec.tok.decode(ids, skip_special_tokens=False), tokenizer.chat_template)
