"""Tool use: a chat request's ``tools`` and ``tool_choice``, the grammar of a required call, and the calls
read back from a reply, in Qwen's and Hermes' form (``<tool_call>{json}</tool_call>``)."""
from __future__ import annotations

import json
import re
import uuid

from .protocol import OpenAIError

MAX_TOOLS = 64
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# a tool call as Qwen's and Hermes' templates ask the model to write it: <tool_call>{json}</tool_call>
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def requested_tools(body: dict):
    """The request's ``tools`` (functions, as chat templates take them) and ``tool_choice``: "none",
    "auto", "required" or a function's name."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        return None, "none"
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and _TOOL_NAME.fullmatch(t["function"]["name"])
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise OpenAIError(f"tools must be a list of 1 to {MAX_TOOLS} {{type: function, function: {{name, "
                          "description, parameters}}}} (names of letters, digits, _ . -)", param="tools")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        return tools, "auto"
    if choice in ("none", "auto", "required"):
        return tools, choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in names:
        return tools, choice["function"]["name"]
    raise OpenAIError("tool_choice must be none, auto, required or {type: function, function: {name}} naming one "
                      "of the tools", param="tool_choice")


def tool_grammar(tools: list, choice: str) -> str:
    """A Lark grammar for one tool call in Qwen's and Hermes' form, ``<tool_call>`` then a JSON object of
    a function's name and arguments (its parameters' schema), then ``</tool_call>``."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                               "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools if choice == "required" or t["function"]["name"] == choice]
    schema = dict(calls[0] if len(calls) == 1 else {"anyOf": calls}, **{"x-guidance": {"whitespace_flexible": False}})
    return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'


def tool_calls(text: str, names) -> tuple[list, str | None]:
    """The calls of declared tools (``names``) in a reply (Qwen's and Hermes' ``<tool_call>{json}</tool_call>``),
    and the text around them (None when there is none). Linear in the reply: each block is found with two
    ``find`` (a run of blanks with no closing tag is read once, where a regular expression backtracks over
    it); a block that is not a call of a declared tool (not JSON, nested past the JSON bounds, another
    name) stays in the text."""
    from ...untrusted import load_json
    calls, kept, at = [], [], 0
    while True:
        start = text.find(TOOL_CALL_OPEN, at)
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN)) if start >= 0 else -1
        if end < 0:
            break
        try:
            obj = load_json(text[start + len(TOOL_CALL_OPEN):end].strip(), "a tool call", error=ValueError)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and obj.get("name") in names:
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": obj["name"], "arguments": json.dumps(args)}})
            kept.append(text[at:start])
        else:
            kept.append(text[at:end + len(TOOL_CALL_CLOSE)])
        at = end + len(TOOL_CALL_CLOSE)
    if not calls:
        return [], text
    return calls, ("".join(kept) + text[at:]).strip() or None


async def tool_calls_of(text: str, tools: list) -> tuple[list, str | None]:
    """:func:`tool_calls` off the event loop (a reply may be long)."""
    import asyncio
    names = {t["function"]["name"] for t in tools}
    return await asyncio.get_running_loop().run_in_executor(None, tool_calls, text, names)
