"""The host loop: any target's prefill/decode programs driven from the host as LiteRT-LM drives a bundle,
the reference loop of checks and measurements."""
from __future__ import annotations

from typing import Sequence

from ..errors import InputError
from .contract import has_state, prefill_chunks
from .plan import DECODE, StepPlan


class HostLoop:
    """Drives a program with ``prefill_<N>`` and ``decode`` signatures (any target's runnable, or a
    ``.tflite`` made elsewhere with the same contract) from the host the way LiteRT-LM drives a bundle:
    prompt chunks padded as LiteRT-LM pads them (token 0 at position 0, the rows masked), cache writes from
    each chunk's first position, the last prompt token decoded. Steps that take embeddings (a VLM's) get
    ``embed(ids)`` (``[1, n]`` int32 -> ``[1, n, D]``), as LiteRT-LM's embedder gives them. A model with
    recurrent states gets chunks it fills exactly, unless its steps are ``padded`` ones (they find the real
    tokens: LiteRT-LM bundles). A reference loop for checks and measurements: the cache goes through the host."""

    def __init__(self, program, padded: bool = False, embed=None, extra: dict | None = None):
        import numpy as np
        self.program, self.padded, self.embed = program, padded, embed
        self.extra = extra or {}  # inputs every step takes as they are (a LoRA adapter's)
        self.lengths = list(StepPlan.of(program.signatures).lengths)
        specs = {s.name: s for s in program.inputs(DECODE)}
        self.length = specs["mask"].shape[-1]
        self.caches = {n: np.zeros(s.shape, np.dtype(s.dtype)) for n, s in specs.items() if n.startswith("kv_cache_")}
        self.pos = 0

    def step(self, sig: str, tokens: Sequence[int], more: dict | None = None, n: int | None = None):
        """Program ``sig`` on ``tokens`` (padded to its ``n`` positions; ``n`` None: as many as the tokens)."""
        import numpy as np
        n = len(tokens) if n is None else n
        if self.pos + len(tokens) > self.length:
            raise InputError(f"{self.pos + len(tokens)} tokens do not fit the cache of {self.length}")
        pos = np.zeros(n, np.int32)
        pos[:len(tokens)] = np.arange(self.pos, self.pos + len(tokens))
        mask = np.where(np.arange(self.length)[None, :] <= pos[:, None], 0.0, np.finfo(np.float32).min)
        mask[len(tokens):] = np.finfo(np.float32).min
        ids = np.array([list(tokens) + [0] * (n - len(tokens))], np.int32)
        first = dict(tokens=ids) if self.embed is None else dict(embeddings=self.embed(ids))
        feed = dict(**first, input_pos=pos, mask=mask[None, None].astype(np.float32), **self.caches, **self.extra,
                    **(more or {}))
        outs = self.program(signature_name=sig, **feed)
        if not isinstance(outs, dict):  # a file made elsewhere: flat outputs, named by the file
            outs = dict(zip([o.name for o in self.program.outputs(sig)], outs if isinstance(outs, tuple) else [outs]))
        self.caches.update({k: v for k, v in outs.items() if k in self.caches})
        self.pos += len(tokens)
        return outs.get("logits")

    def prefill(self, ids: Sequence[int]) -> None:
        """Fills the cache with ``ids``, in the largest chunks that help."""
        exact = has_state(self.caches) and not self.padded
        for start, take, n in prefill_chunks(len(ids), self.lengths, exact=exact):
            self.step(StepPlan.prefill(n), ids[start:start + take], n=n)

    def decode(self, token: int):
        """The next-token logits ``[vocab]`` after ``token``, which goes into the cache."""
        return self.step(DECODE, [int(token)])[0, -1]


def host_generate(program, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
                  padded: bool = False) -> list[int]:
    """Greedy tokens after ``prompt_ids`` from a program with prefill and decode signatures (:class:`HostLoop`)."""
    import numpy as np
    loop = HostLoop(program, padded)
    ids = list(prompt_ids)
    loop.prefill(ids[:-1])
    out: list[int] = []
    token = ids[-1]
    for _ in range(max_new_tokens):
        token = int(np.argmax(loop.decode(token)))
        if token in stop_ids:
            break
        out.append(token)
    return out


def next_token_logits(program, ids: Sequence[int], start: int, padded: bool = False, embed=None,
                      extra: dict | None = None):
    """The program's next-token logits at every position from ``start`` on, the tokens given (teacher forcing):
    row ``i`` predicts ``ids[start + i + 1]``. ``embed``: token ids ``[1, n]`` -> ``[1, n, D]``, for steps that
    take embeddings; ``extra``: inputs every step takes as they are."""
    import numpy as np
    loop = HostLoop(program, padded, embed, extra)
    loop.prefill(list(ids[:start]))
    return np.stack([loop.decode(t) for t in ids[start:]])
