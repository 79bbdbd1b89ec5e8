"""LiteRT-LM, Google's on-device LLM runtime (``litert-lm-api``): the engine that runs ``.litertlm``
bundles on the CPU backend here (the same engine runs them on Android, iOS, desktop and the web)."""
from __future__ import annotations

import os
import threading

from torchtpu_export.errors import ArtifactError, InputError

_LOCK = threading.Lock()


def _litert_lm():
    try:
        import litert_lm
    except ImportError as e:
        raise InputError("running a .litertlm needs LiteRT-LM's engine: pip install 'torchtpu-export[litertlm]'") from e
    litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)
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
        sampler = lm.SamplerConfig(top_k=top_k, top_p=top_p, temperature=temperature, seed=seed)
        if chat:
            with self.engine.create_conversation(sampler_config=sampler, max_output_tokens=max_new_tokens) as conv:
                reply = conv.send_message(prompt)
            return "".join(part.get("text", "") for part in _parts(reply))
        with self.engine.create_session(apply_prompt_template=False, sampler_config=sampler,
                                        max_output_tokens=max_new_tokens) as session:
            session.run_prefill([prompt])
            return "".join(session.run_decode().texts[:1])

    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.tokenize(text))

    def close(self) -> None:
        self.engine.close()


def _parts(message) -> list:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", message)
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [p if isinstance(p, dict) else {"type": "text", "text": str(p)} for p in (content or [])]
