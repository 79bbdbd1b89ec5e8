"""LiteRT-LM, Google's on-device LLM runtime (``litert-lm-api``): the engine that runs ``.litertlm``
bundles on the CPU backend here (the same engine runs them on Android, iOS, desktop and the web).

LiteRT-LM aborts the process on some damaged bundles (its tokenizer is a Rust library that panics
across a C API); the target's ``check`` refuses those before a bundle gets here. What LiteRT-LM
still reports as an error (a chat template that fails to render, a step that fails) is the bundle's:
one ArtifactError, exit 5."""
from __future__ import annotations

import logging
import os
import threading

from torchtpu_export.errors import ArtifactError, InputError

_LOCK = threading.Lock()


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

    def __init__(self, path: str, threads: int | None = None):
        lm = _litert_lm()
        self.path = os.fspath(path)
        try:
            with _LOCK:
                self.engine = lm.Engine(self.path, backend=lm.Backend.CPU(thread_count=threads))
        except RuntimeError as e:
            raise ArtifactError(f"LiteRT-LM cannot load {self.path}: {e}",
                                hint="the bundle is damaged or was not made for this LiteRT-LM") from e

    def generate(self, prompt: str, max_new_tokens: int = 64, *, chat: bool = False, top_k: int | None = 1,
                 top_p: float | None = None, temperature: float | None = None, seed: int | None = None) -> str:
        """The text LiteRT-LM generates after ``prompt`` (raw, or as a user message through the bundle's
        chat template with ``chat=True``); greedy by default (top-k 1)."""
        lm = _litert_lm()
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be positive, got {max_new_tokens}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"the prompt is not valid text (character {e.start} cannot be written as UTF-8)") from None
        sampler = lm.SamplerConfig(top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)
        try:
            if chat:
                with self.engine.create_conversation(sampler_config=sampler,
                                                     max_output_tokens=max_new_tokens) as conv:
                    reply = conv.send_message(prompt)
                return "".join(part.get("text", "") for part in _parts(reply))
            with self.engine.create_session(apply_prompt_template=False, sampler_config=sampler,
                                            max_output_tokens=max_new_tokens) as session:
                session.run_prefill([prompt])
                return "".join(session.run_decode().texts[:1])
        except RuntimeError as e:
            # the prompt was checked against the context before; a failure that another prompt would not
            # meet is the prompt's (the chat template's text made it too long, or the template refuses it)
            if chat and self._chat_works(lm):
                raise InputError(f"LiteRT-LM cannot take this prompt through {self.path}'s chat template ({e}): "
                                 "with the template's text it is longer than the context, or the template "
                                 "refuses it", hint="shorten the prompt, or run without --chat") from None
            what = "answer through the chat template of" if chat else "generate from"
            raise ArtifactError(f"LiteRT-LM could not {what} {self.path} ({e})",
                                hint="the bundle is damaged; rerun with -vv for LiteRT-LM's own log") from None

    def _chat_works(self, lm) -> bool:
        try:
            with self.engine.create_conversation(sampler_config=lm.SamplerConfig(top_k=1),
                                                 max_output_tokens=1) as conv:
                conv.send_message("")
            return True
        except RuntimeError:
            return False

    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.tokenize(text))

    def detokenize(self, ids: list[int]) -> str:
        try:
            return self.engine.detokenize(list(ids))
        except (RuntimeError, TypeError, ValueError) as e:
            raise InputError(f"{self.path}'s tokenizer cannot read these token ids ({e})") from None

    def close(self) -> None:
        self.engine.close()


def _parts(message) -> list:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", message)
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p if isinstance(p, dict) else {"type": "text", "text": str(p)} for p in (content or [])]
