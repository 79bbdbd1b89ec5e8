"""An LLM's text side: its tokenizer (the HF ``tokenizer.json``), special tokens and chat template, as a
bundle or a served program carries them."""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from ..errors import InputError


# The runtime passes a message's content as a list of {"type": "text", "text": ...} parts; HF templates
# expect a string. This prelude joins the parts, so the model's own template works unchanged on both.
_PARTS_PRELUDE = (
    "{%- set _tte = namespace(msgs=[], text='') -%}"
    "{%- for _m in messages -%}"
    "{%- if _m['content'] is string -%}{%- set _tte.msgs = _tte.msgs + [_m] -%}"
    "{%- else -%}{%- set _tte.text = '' -%}"
    "{%- for _p in _m['content'] -%}{%- if _p['type'] == 'text' -%}{%- set _tte.text = _tte.text + _p['text'] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set _tte.msgs = _tte.msgs + [{'role': _m['role'], 'content': _tte.text}] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- set messages = _tte.msgs -%}"
)


def parts_template(template: str) -> str:
    """``template`` (an HF chat template) taking message contents as strings or lists of text parts."""
    return _PARTS_PRELUDE + template


@dataclasses.dataclass
class LlmTokenizer:
    """What a bundle needs of a tokenizer: the HF ``tokenizer.json``, the special tokens and the chat template."""

    json: str
    bos_id: int | None  # the token the tokenizer's post-processor puts first (None: it puts none)
    stop_ids: list[int]
    pad_id: int | None
    chat_template: str | None
    # the special tokens' text transformers passes a chat template (bos_token, eos_token, unk_token, pad_token)
    specials: dict = dataclasses.field(default_factory=dict)
    # where it came from (a folder, or transformers' tokenizer object): transformers' tokenizer for the export's
    # chat probes is made from it on demand (:meth:`reference`)
    origin: object = dataclasses.field(default=None, repr=False, compare=False)

    def reference(self):
        """transformers' tokenizer for this one, as ``AutoTokenizer`` loads the folder (from its checked files
        alone), or the object it came from; None where there is none (a bare ``tokenizers.Tokenizer``)."""
        if isinstance(self.origin, str):
            self.origin = _auto_tokenizer(self.origin)
        return self.origin

    @classmethod
    def from_dir(cls, path: str, stop_ids: Sequence[int] = ()) -> "LlmTokenizer":
        """From a Hugging Face folder: ``tokenizer.json`` (required), ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` (optional), each read only if it is a regular
        file inside the folder (:mod:`.hf_folder`)."""
        from . import hf_folder
        text = hf_folder.read_text(path, "tokenizer.json", hf_folder.MAX_TOKENIZER_BYTES)
        if text is None:
            raise InputError(f"{path} has no tokenizer.json",
                             hint="save the tokenizer there (tokenizer.save_pretrained(folder)) or pass tokenizer=; "
                                  "only fast (tokenizers-library) tokenizers can be bundled")
        config = hf_folder.read_json(path, "tokenizer_config.json") or {}
        template = hf_folder.read_text(path, "chat_template.jinja")
        if template is None:
            template = chat_template_from(config.get("chat_template"), os.path.join(path, "tokenizer_config.json"))
        gen = hf_folder.read_json(path, "generation_config.json") or {}
        stops = token_ids(gen.get("eos_token_id"), os.path.join(path, "generation_config.json"))
        specials = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                    if k in SPECIALS and isinstance(v.get("content") if isinstance(v, dict) else v, str)}
        return dataclasses.replace(cls.build(text, config, template, [*stop_ids, *stops]), specials=specials,
                                   origin=path)

    @classmethod
    def build(cls, text: str, config: dict, template: str | None, stop_ids: Sequence[int]) -> "LlmTokenizer":
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:
            raise InputError(f"tokenizer.json is not a tokenizer the tokenizers library reads: {e}") from e

        def token_id(key):
            tok_str = config.get(key)
            if isinstance(tok_str, dict):
                tok_str = tok_str.get("content")
            return tok.token_to_id(tok_str) if isinstance(tok_str, str) else None

        with_special, plain = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
        bos = with_special[0] if len(with_special) > len(plain) and with_special[-len(plain):] == plain else None
        stops = list(dict.fromkeys([*stop_ids, *([token_id("eos_token")] if token_id("eos_token") is not None
                                                   else [])]))
        return cls(text, bos, stops, token_id("pad_token"), template)

    @classmethod
    def from_object(cls, tokenizer, stop_ids: Sequence[int] = ()) -> "LlmTokenizer":
        """From a transformers fast tokenizer, a ``tokenizers.Tokenizer`` or a folder path."""
        if isinstance(tokenizer, (str, os.PathLike)):
            return cls.from_dir(os.fspath(tokenizer), stop_ids)
        from tokenizers import Tokenizer
        if isinstance(tokenizer, Tokenizer):
            return cls.build(tokenizer.to_str(), {}, None, stop_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise InputError(f"tokenizer {type(tokenizer).__name__} has no tokenizer.json form",
                             hint="use a fast tokenizer (transformers' PreTrainedTokenizerFast)")
        config = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
        from .chat import specials_of
        return dataclasses.replace(cls.build(backend.to_str(), config, getattr(tokenizer, "chat_template", None),
                                             stop_ids), specials=specials_of(tokenizer), origin=tokenizer)


SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what transformers passes a template by name


def _auto_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained`` over a private folder of the model folder's checked tokenizer files (a
    tokenizer transformers cannot load gives None: no chat probes)."""
    import json
    import tempfile

    from . import hf_folder
    with tempfile.TemporaryDirectory(prefix="tte-tokenizer-") as stage:
        for name in ("tokenizer.json", "chat_template.jinja"):
            text = hf_folder.read_text(path, name, hf_folder.MAX_TOKENIZER_BYTES)
            if text is not None:
                with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                    f.write(text)
        for name in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
            value = hf_folder.read_json(path, name)
            if value is not None:
                with open(os.path.join(stage, name), "w", encoding="utf-8") as f:
                    json.dump(value, f)
        try:
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(stage)
        except Exception:  # noqa: BLE001 - whatever transformers makes of it: no reference, no probes
            return None


def token_ids(value, where: str) -> list[int]:
    """Token ids given as one id or a list (``eos_token_id``); InputError naming ``where`` otherwise."""
    if value is None:
        return []
    ids = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2 ** 31 for i in ids):
        raise InputError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r:.80}")
    return ids


def chat_template_from(value, where: str) -> str | None:
    """tokenizer_config.json's ``chat_template``: a template, or named ones (the ``default`` is taken)."""
    if isinstance(value, list):
        if not all(isinstance(t, dict) for t in value):
            raise InputError(f"{where}: chat_template must be a template or a list of {{name, template}}")
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    if value is not None and not isinstance(value, str):
        raise InputError(f"{where}: chat_template must be text, got {type(value).__name__}")
    return value


# ---- loading ----------------------------------------------------------------------------------
