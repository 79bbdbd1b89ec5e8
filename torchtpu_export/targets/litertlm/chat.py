"""A Hugging Face chat template as LiteRT-LM renders it like transformers does.

LiteRT-LM (0.18.1) renders a bundle's template with minijinja, not jinja2, after a pass of regular expressions
over the whole source (``EditTemplateForMinijinja``: ``.startswith(x)`` -> ``is startingwith x``, ``.split``,
``.join``, ``.strip``, ``.replace``, ``.items()``), and passes other variables than transformers:

- its ``none`` test is "undefined": ``{% set tools = none %}{{ tools is not none }}`` is true there (Llama 3's and
  Mistral-Nemo's templates then write their tool instructions into every prompt);
- mappings have no methods (``.get``, ``.keys``, ``.values``), strings no ``.upper`` / ``.lower``, and its
  ``.split`` gives an iterator and ``sep.join(xs)`` is rewritten wrongly;
- ``tojson`` takes no arguments (``tojson(indent=4)`` fails);
- ``tools`` is undefined without tools (transformers passes None), ``documents`` too, ``bos_token`` and
  ``eos_token`` are "", and a message's content is always a list of text parts;
- a template's last newline is kept (jinja2 drops it).

:func:`litert_template` rewrites inside the template's tags only (text and string literals are never
touched), so that LiteRT-LM's own pass finds nothing left to rewrite: ``is [not] none`` becomes ``== / != none``
(equal in both engines for None and undefined), method calls become filters and tests, ``tojson(indent=N)`` a
macro writing ``json.dumps(indent=N)``; a prelude sets what transformers passes (``tools`` and ``documents``
None when absent, the special tokens' text) and joins content parts into a string. The BOS is then the
template's to write, as in transformers: the bundle carries no start token (LiteRT-LM would put one before
every prompt, whether the template writes one or not). :func:`unsupported` lists what cannot be rewritten
(``{% break %}``, ``%`` formatting, other Python methods); the export's probe conversations decide."""
from __future__ import annotations

import json
import re

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<num>\d+(?:\.\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<close>-?%\}|-?\}\})
  | (?P<op>\*\*|//|==|!=|<=|>=|[-+*/%~|.,:;()\[\]{}<>=!?])
""", re.X | re.S)
_OPEN = re.compile(r"\{\{[-+]?|\{%[-+]?|\{#")
_SAFE_TOKEN = re.compile(r"[\x20-\x7e]*")  # a special token written as a string literal, as it is

# method -> filter (no argument / with arguments) and test
_FILTERS = {"upper": "upper", "lower": "lower", "title": "title", "capitalize": "capitalize", "items": "items",
            "strip": "trim", "lstrip": "lstrip", "rstrip": "rstrip", "keys": "list"}
_FILTERS_WITH_ARGS = {"strip": "trim", "lstrip": "lstrip", "rstrip": "rstrip", "replace": "replace"}
_TESTS = {"startswith": "startingwith", "endswith": "endingwith"}
# Python methods neither engine shares a form for
_OTHER_METHODS = ("format", "count", "find", "index", "isdigit", "isalpha", "isspace", "zfill", "ljust", "rjust",
                  "rsplit", "splitlines", "casefold", "swapcase", "partition", "update", "append", "pop", "extend")

# json.dumps(x, indent=N, ensure_ascii=False) as a macro (transformers' tojson with indent); scalars through
# LiteRT-LM's own tojson, which writes them as json.dumps does
_TOJSON_MACRO = (
    "{%- macro _tte_tojson(v, indent, pad='') -%}"
    "{%- if v is mapping -%}{%- if v | length == 0 -%}{{ '{}' }}{%- else -%}{{ '{' }}"
    "{%- for k, x in v | items -%}{{ '\\n' ~ pad ~ (' ' * indent) ~ (k | tojson) ~ ': ' }}"
    "{{- _tte_tojson(x, indent, pad ~ (' ' * indent)) -}}{%- if not loop.last -%},{%- endif -%}{%- endfor -%}"
    "{{ '\\n' ~ pad ~ '}' }}{%- endif -%}"
    "{%- elif v is sequence and v is not string -%}{%- if v | length == 0 -%}[]{%- else -%}["
    "{%- for x in v -%}{{ '\\n' ~ pad ~ (' ' * indent) }}{{- _tte_tojson(x, indent, pad ~ (' ' * indent)) -}}"
    "{%- if not loop.last -%},{%- endif -%}{%- endfor -%}{{ '\\n' ~ pad ~ ']' }}{%- endif -%}"
    "{%- else -%}{{ v | tojson }}{%- endif -%}"
    "{%- endmacro -%}")

# a message's content as transformers gives it: the text of LiteRT-LM's parts joined (a VLM's template reads the
# parts itself); the message's other keys (tool calls, names) kept
_PARTS_PRELUDE = (
    "{%- set _tte = namespace(msgs=[], text='') -%}"
    "{%- for _m in messages -%}"
    "{%- if _m['content'] is string or _m['content'] is not defined -%}{%- set _tte.msgs = _tte.msgs + [_m] -%}"
    "{%- else -%}{%- set _tte.text = '' -%}"
    "{%- for _p in _m['content'] -%}{%- if _p['type'] == 'text' -%}{%- set _tte.text = _tte.text + _p['text'] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set _tte.msgs = _tte.msgs + [dict(_m, content=_tte.text)] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = _tte.msgs -%}")


def litert_template(template: str, specials: dict, parts: bool = True) -> str:
    """``template`` (an HF chat template) rewritten for LiteRT-LM (see the module's docstring), with the
    prelude: ``tools`` and ``documents`` None when absent, ``specials`` (``bos_token``, ...) as transformers passes
    them, and with ``parts`` the contents' text parts joined into strings."""
    source = re.sub(r"(\r\n|\r|\n)\Z", "", template)  # jinja2 drops one trailing newline; minijinja keeps it
    pieces = [(kind, _rewrite(value) if kind == "tag" else value) for kind, value in _split(source)]
    prelude = ("{%- if tools is not defined %}{%- set tools = none %}{%- endif %}"
               "{%- if documents is not defined %}{%- set documents = none %}{%- endif %}")
    for name, value in sorted(specials.items()):
        if re.fullmatch(r"[a-z_]+_token", name) and isinstance(value, str) and _SAFE_TOKEN.fullmatch(value):
            prelude += "{%- set " + name + " = " + json.dumps(value) + " %}"
    prelude += _TOJSON_MACRO + (_PARTS_PRELUDE if parts else "")
    # the last tag keeps no '-': nothing of the template's own first characters is trimmed
    return prelude + "{{ '' }}" + _join(pieces)


def unsupported(template: str) -> list[str]:
    """What LiteRT-LM renders otherwise and :func:`litert_template` cannot rewrite, as ``"construct (line N)"``."""
    found = []
    for kind, tokens, line in _tags(template):
        if kind != "tag":
            continue
        values = [v for k, v in tokens if k != "ws"]
        kinds = [k for k, v in tokens if k != "ws"]
        if len(values) > 1 and values[1] in ("break", "continue"):
            found.append(f"{{% {values[1]} %}} (line {line}): LiteRT-LM's engine has no loop controls")
        for i, (a, b) in enumerate(zip(values, values[1:])):
            if b == "%" and kinds[i] == "str":
                found.append(f"'...' % ... formatting (line {line})")
            if a == "." and b in _OTHER_METHODS:
                found.append(f".{b}() (line {line})")
        if values and values[0] in ("{{", "{{-") and len(values) == 3 and values[1] in ("true", "false", "none",
                                                                                         "True", "False", "None"):
            found.append(f"printing {values[1]} (line {line}): LiteRT-LM writes true/false/none in lowercase")
    return list(dict.fromkeys(found))


def _tags(source: str):
    """``(kind, value, line)`` for each piece: ``("text", str)`` or ``("tag", [[kind, text], ...])``."""
    line = 1
    for kind, value in _split(source):
        yield kind, value, line
        line += (value if kind == "text" else "".join(v for _, v in value)).count("\n")


def _split(source: str) -> list:
    """The template as text pieces and tags (a tag's tokens with their delimiters; comments stay text)."""
    out, i = [], 0
    while i < len(source):
        m = _OPEN.search(source, i)
        if not m:
            out.append(("text", source[i:]))
            break
        if m.start() > i:
            out.append(("text", source[i:m.start()]))
        if m.group() == "{#":
            end = source.find("#}", m.end())
            end = len(source) if end < 0 else end + 2
            out.append(("text", source[m.start():end]))
            i = end
            continue
        tokens, j = [["open", m.group()]], m.end()
        while True:
            t = _TOKEN.match(source, j)
            if t is None:  # not a tag this lexer knows: left as it is, for the engines to judge
                out.append(("text", source[m.start():j + 1]))
                i = j + 1
                break
            tokens.append([t.lastgroup, t.group()])
            j = t.end()
            if t.lastgroup == "close":
                out.append(("tag", tokens))
                i = j
                break
            if j >= len(source):
                out.append(("text", source[m.start():]))
                i = j
                break
    return out


def _join(pieces) -> str:
    return "".join(v if k == "text" else "".join(t for _, t in v) for k, v in pieces)


def _skip_ws(tokens, j: int, step: int) -> int:
    j += step
    while 0 <= j < len(tokens) and tokens[j][0] == "ws":
        j += step
    return j


def _matching(tokens, j: int, step: int) -> int:
    """The bracket matching ``tokens[j]``, searching forward (``step`` 1) or back (-1)."""
    opens, closes = ("(", "[", "{"), (")", "]", "}")
    depth = 0
    while 0 <= j < len(tokens):
        v = tokens[j][1]
        if v in (opens if step > 0 else closes):
            depth += 1
        elif v in (closes if step > 0 else opens):
            depth -= 1
            if depth == 0:
                return j
        j += step
    raise ValueError("unbalanced brackets in a template tag")


def _receiver_start(tokens, j: int, filters: bool = False) -> int:
    """Where the postfix expression ending at ``tokens[j]`` begins (names, literals, ``.attr``, ``[key]``,
    calls); with ``filters``, the filter chain before it too (``a | f | g``)."""
    while True:
        kind, value = tokens[j]
        if value in (")", "]", "}"):
            j = _matching(tokens, j, -1)
            p = _skip_ws(tokens, j, -1)
            if value != "}" and p >= 0 and (tokens[p][0] in ("name", "str", "expr") or tokens[p][1] in (")", "]")):
                j = p
                continue
        elif kind not in ("name", "str", "num", "expr"):
            raise ValueError(f"no expression before {value!r}")
        p = _skip_ws(tokens, j, -1)
        if p >= 0 and (tokens[p][1] == "." or (filters and tokens[p][1] == "|")):
            j = _skip_ws(tokens, p, -1)
            continue
        return j


def _text(tokens, a: int, b: int) -> str:
    return "".join(v for _, v in tokens[a:b + 1])


def _rewrite(tokens: list) -> list:
    try:
        return _tojson_calls(_methods(_none_tests(tokens)))
    except ValueError:  # a tag this rewrite does not follow: left to the probes
        return tokens


def _none_tests(tokens: list) -> list:
    """``x is none`` -> ``x == none``, ``x is not none`` -> ``x != none``."""
    out, i = [], 0
    while i < len(tokens):
        if tokens[i][:2] == ["name", "is"]:
            n1 = _skip_ws(tokens, i, 1)
            n2 = _skip_ws(tokens, n1, 1)
            if n1 < len(tokens) and tokens[n1][1] == "not" and n2 < len(tokens) and tokens[n2][1] in ("none", "None"):
                out += [["op", "!="], ["ws", " "], ["name", "none"]]
                i = n2 + 1
                continue
            if n1 < len(tokens) and tokens[n1][1] in ("none", "None"):
                out += [["op", "=="], ["ws", " "], ["name", "none"]]
                i = n1 + 1
                continue
        out.append(tokens[i])
        i += 1
    return out


def _methods(tokens: list) -> list:
    """``R.m(args)`` -> the filter, test or subscript LiteRT-LM has for it, one call at a time (a receiver's own
    calls are rewritten first, being earlier in the tag)."""
    changed = True
    while changed:
        changed = False
        for i in range(len(tokens) - 1):
            if tokens[i][1] != "." or tokens[i + 1][0] != "name":
                continue
            method = tokens[i + 1][1]
            lp = _skip_ws(tokens, i + 1, 1)
            if lp >= len(tokens) or tokens[lp][1] != "(":
                continue
            rp = _matching(tokens, lp, 1)
            args = _expression(_text(tokens, lp + 1, rp - 1).strip())
            start = _receiver_start(tokens, _skip_ws(tokens, i, -1))
            receiver = _text(tokens, start, _skip_ws(tokens, i, -1))
            new = _method_form(method, receiver, args)
            if new is None:
                continue
            tokens = tokens[:start] + [["expr", new]] + tokens[rp + 1:]
            changed = True
            break
    return tokens


def _expression(text: str) -> str:
    """An expression's text (a call's arguments) rewritten as a tag's tokens are: its own calls too."""
    tokens, j = [], 0
    while j < len(text):
        t = _TOKEN.match(text, j)
        if t is None or t.lastgroup == "close":
            return text
        tokens.append([t.lastgroup, t.group()])
        j = t.end()
    return "".join(v for _, v in _rewrite(tokens))


def _method_form(method: str, receiver: str, args: str) -> str | None:
    if method == "get":
        key, default = _first_argument(args)
        return f"({receiver}[{key}] | default({default or 'none'}))"
    if method == "join":
        return f"({args} | join({receiver}))"
    if method == "split":
        return f"({receiver} | split({args}) | list)" if args else f"({receiver} | split | list)"
    if method in _TESTS:
        return f"({receiver} is {_TESTS[method]}({args}))"
    if method == "values" and not args:
        return f"({receiver} | items | map('last') | list)"
    if not args and method in _FILTERS:
        return f"({receiver} | {_FILTERS[method]})"
    if args and method in _FILTERS_WITH_ARGS:
        return f"({receiver} | {_FILTERS_WITH_ARGS[method]}({args}))"
    return None


def _tojson_calls(tokens: list) -> list:
    """``X | tojson(indent=N, ...)`` -> ``_tte_tojson(X, N)`` (LiteRT-LM's tojson takes no argument)."""
    changed = True
    while changed:
        changed = False
        for i, (_, value) in enumerate(tokens):
            if value != "tojson":
                continue
            bar, lp = _skip_ws(tokens, i, -1), _skip_ws(tokens, i, 1)
            if bar < 0 or tokens[bar][1] != "|" or lp >= len(tokens) or tokens[lp][1] != "(":
                continue
            rp = _matching(tokens, lp, 1)
            kwargs = dict(re.findall(r"(\w+)\s*=\s*([^,]+)", _text(tokens, lp + 1, rp - 1)))
            start = _receiver_start(tokens, _skip_ws(tokens, bar, -1), filters=True)
            receiver = _text(tokens, start, _skip_ws(tokens, bar, -1))
            indent = kwargs.get("indent", "none").strip()
            new = f"(_tte_tojson({receiver}, {indent}))" if indent not in ("none", "None") else f"({receiver} | tojson)"
            tokens = tokens[:start] + [["expr", new]] + tokens[rp + 1:]
            changed = True
            break
    return tokens


def _first_argument(args: str) -> tuple[str, str]:
    """``"k, d"`` -> (``k``, ``d``); brackets and quotes respected."""
    depth, quote = 0, None
    for n, c in enumerate(args):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            return args[:n].strip(), args[n + 1:].strip()
    return args.strip(), ""
