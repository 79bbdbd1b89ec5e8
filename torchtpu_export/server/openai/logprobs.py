"""A reply's logprobs in OpenAI's form, each token named by its text (or, where texts collide, by its
vocabulary entry or id)."""
from __future__ import annotations

from .protocol import Job, text_work


async def logprobs_of(job: Job, request, start: int, end: int, offset: int, text):
    """The logprobs of tokens ``start:end`` of a choice in OpenAI's form (chat: ``content`` entries with
    ``top_logprobs``; completions: tokens, token_logprobs, top_logprobs, text_offset from ``offset``);
    ``text``, the text workers, name the tokens (None: a model without a tokenizer, ``<id>``)."""
    tokens, entries = request.tokens[start:end], request.logprobs[start:end]
    ids = list(dict.fromkeys(list(tokens) + [t for _, top in entries for t, _ in top]))
    if job.token_ids:
        pieces = [[f"token_id:{t}", f"token_id:{t}", list(f"token_id:{t}".encode())] for t in ids]
    elif text is not None and ids:
        pieces = await text_work("logprobs", text.pieces(ids))
    else:
        pieces = [[f"<{t}>", f"<{t}>", list(f"<{t}>".encode())] for t in ids]
    name = _token_names(ids, pieces)
    shown = {t: p[0] for t, p in zip(ids, pieces)}
    raw = {t: p[2] for t, p in zip(ids, pieces)}
    if job.kind == "text_completion":
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(shown[t])
        return {"tokens": [name[t] for t in tokens], "token_logprobs": [lp for lp, _ in entries],
                "top_logprobs": [{name[a]: v for a, v in top} for _, top in entries] if job.logprobs else None,
                "text_offset": offsets}
    return {"content": [{"token": name[t], "logprob": lp, "bytes": raw[t],
                         "top_logprobs": [{"token": name[a], "logprob": v, "bytes": raw[a]}
                                          for a, v in top[:job.logprobs]]}
                        for t, (lp, top) in zip(tokens, entries)]}


def _token_names(ids: list, pieces: list) -> dict:
    """Each token's name in logprobs: its text, unless another token of the reply has the same text (byte
    tokens of a partial character all read "\ufffd"; completions' ``top_logprobs`` keys them by name): then
    its vocabulary entry (``<0xE2>``, ``âĢ``), and failing that its id."""
    count: dict = {}
    for text, _, _ in pieces:
        count[text] = count.get(text, 0) + 1
    name = {t: (text if count[text] == 1 else entry) for t, (text, entry, _) in zip(ids, pieces)}
    seen: dict = {}
    for t in ids:
        seen[name[t]] = seen.get(name[t], 0) + 1
    return {t: (n if seen[n] == 1 else f"token_id:{t}") for t, n in name.items()}
