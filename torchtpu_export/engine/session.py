"""An LLM artifact's serving parts, built once from its facts: the engine over its programs, its tokenizer
and chat template in worker processes, and the grammars of structured outputs. ``serve`` (one per served
file) and ``TpuProgram.generate`` (one per loaded program) build theirs here, so that both read the same
facts the same way."""
from __future__ import annotations

import threading

from ..errors import ArtifactError, InputError
from .scheduler import Engine


class LlmSession:
    """``engine`` (:class:`~.scheduler.Engine`, or its paged kind for a paged program), ``text`` (the
    tokenizer and chat template in ``text_workers`` worker processes, each operation within ``text_budget``
    seconds; None for a file without a tokenizer), ``stop_ids``, ``tokenizer_json`` and, on first use,
    :meth:`grammars` (llguidance's, for response formats). ``warm``: every device call compiled (or loaded)
    before the session is returned. ArtifactError for a file whose special token ids its vocabulary does not
    hold."""

    def __init__(self, program, *, batched: bool = True, prefix_cache: bool = True, warm: bool = False,
                 text_workers: int = 1, text_budget: float = 10.0):
        llm = program.llm
        if llm is None:
            raise InputError("an LLM session needs an LLM's programs (tte.export_llm)")
        self.llm = llm
        self.engine = Engine(program, batched=batched, prefix_cache=prefix_cache)
        self.stop_ids = tuple(llm.get("stop_ids", ()))
        special = [i for i in (*self.stop_ids, llm.get("bos_id"), llm.get("pad_id")) if i is not None]
        if any(i >= self.engine.vocab for i in special):  # said before warm's compiling, not after it
            raise ArtifactError(f"its special token ids {special} are not all below the model's vocabulary of "
                                f"{self.engine.vocab}")
        if warm:  # every device call compiled now: no request waits for the compiler
            self.engine.warm()
        self.tokenizer_json = self.text = None
        self._grammars = None
        self._grammars_made = threading.Lock()
        tok = llm.get("tokenizer")
        if tok:
            from ..llm.textproc import TextWorkers, image_text
            raw = program.artifact.extras[tok]
            self.tokenizer_json = raw.decode("utf-8", "replace")
            self.text = TextWorkers(raw, template=llm.get("chat_template"), bos_id=llm.get("bos_id"),
                                    eos_id=self.stop_ids[0] if self.stop_ids else None,
                                    max_chars=TextWorkers.chars_for(self.engine.length), workers=text_workers,
                                    time_budget=text_budget, images=image_text(self.engine.vision),
                                    specials=llm.get("specials"))

    def grammars(self):
        """The model's grammars (:class:`~torchtpu_export.llm.grammar.Grammars`: its tokenizer loaded by
        llguidance, its grammar worker started), made once; InputError for a file without a tokenizer."""
        if self.tokenizer_json is None:
            raise InputError("structured outputs need the model's tokenizer, which this artifact does not carry")
        with self._grammars_made:
            if self._grammars is None:
                from ..llm.grammar import Grammars
                self._grammars = Grammars(self.tokenizer_json, self.engine.vocab, self.stop_ids)
        return self._grammars

    def close(self) -> None:
        """Stops the engine's thread and ends the text and grammar workers."""
        self.engine.stop()
        for pool in (self.text, self._grammars):
            if pool is not None:
                pool.close()
