"""Structured outputs: what a grammar costs a decode step, on this machine's CPU.

    python -m benchmarks.structured [--vocab 32000] [--slots 8] [-o RESULTS-structured.md]

A Llama of ``--vocab`` tokens (the llama-30m shape of benchmarks/serving.py, seeded random weights) is
exported with ``tte.export_llm(..., target="tpu", batch_size=--slots)`` and served by the engine with every
slot busy. Its tokenizer is a byte-level BPE of ``--vocab`` tokens made here (random lowercase pieces over
the 256 byte tokens: no download), which llguidance reads as it would a real one. Measured:
- mask: llguidance's ``compute_bitmask`` for one reply, per step, over the tokens of replies to a JSON
  schema, a regular expression and a Lark grammar (the host's work for each constrained slot and step);
- step: the engine's decode step with no constrained slot (no mask sent), and with every slot constrained
  (each step: the masks computed, ``B * V / 8`` bytes sent, applied on the device with the penalties);
the mask's share of a step (the issue's bound: under 10% of a decode step at 32k tokens).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
FORMATS = [("json_schema", SCHEMA), ("regex", "[A-Z][a-z]{2,8}( [a-z]{1,8}){3,6}[.!?]"),
           ("grammar", 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\n'
                       'NUMBER: /[0-9]{1,4}/\n')]


def tokenizer_json(vocab: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json of ``vocab`` tokens: the 256 byte tokens, then random pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(seed)
    tokens = {c: i for i, c in enumerate(sorted(alphabet))}
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(tokens) < vocab - 1:
        piece = ("Ġ" if rng.random() < 0.4 else "") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))
        tokens.setdefault(piece, len(tokens))
    tokens["<eos>"] = len(tokens)
    tok = Tokenizer(models.BPE(vocab=tokens, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def mask_cost(grammars, kind: str, value, steps: int = 400) -> tuple[float, int]:
    """Mean microseconds of one mask, over the steps of replies that take the allowed token nearest a
    random pick (a random walk through the grammar), and the number of steps timed."""
    from torchtpu_export.engine.step import mask_words
    rng = np.random.default_rng(0)
    row = np.zeros(mask_words(grammars.vocab), np.int32)
    spent, count = 0.0, 0
    while count < steps:
        m = grammars.matcher(kind, value)
        for _ in range(200):
            t = time.perf_counter()
            m.fill(row)
            spent += time.perf_counter() - t
            count += 1
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:grammars.vocab]
            allowed = np.flatnonzero(bits)
            if not len(allowed) or m.stopped:
                break
            m.consume(int(rng.choice(allowed)))
            if m.error or count >= steps:
                break
    return spent / count * 1e6, count


def main(argv=None) -> int:
    from benchmarks import publish
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per case")
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args(argv)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchtpu_export as tte
    from torchtpu_export.engine import Engine
    from torchtpu_export.llm.grammar import Grammars
    import llguidance
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=args.vocab - 1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    prog = tte.export_llm(model, target="tpu", prefill_lengths=(16,), cache_length=512, batch_size=args.slots,
                          platforms=("cpu",))
    t = time.perf_counter()
    grammars = Grammars(tokenizer_json(args.vocab), args.vocab, [args.vocab - 1])
    tok_s = time.perf_counter() - t
    masks = [(kind, *mask_cost(grammars, kind, value)) for kind, value in FORMATS]

    def steps(constrained: bool) -> float:
        engine = Engine(prog)
        prompt = list(range(5, 21))
        kind, value = FORMATS[0]
        requests = [engine.submit(prompt, args.steps + 60, constraint=grammars.matcher(kind, value)
                                  if constrained else None) for _ in range(engine.slots)]
        for _ in range(3):  # prefill, insert, compile
            engine.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        per = (time.perf_counter() - t) / args.steps
        for r in requests:
            r.cancel()
        while engine.step():
            pass
        return per

    plain, constrained = steps(False), steps(True)
    mean_mask = float(np.mean([m[1] for m in masks]))
    now = datetime.datetime.now().strftime("%Y-%m-%d")
    lines = [f"# Structured outputs: mask cost per decode step ({now}, {platform.machine()}, {os.cpu_count()} cores)",
             "", f"`python -m benchmarks.structured --vocab {args.vocab} --slots {args.slots}`: a llama-30m-shaped "
             f"model with a {args.vocab:,}-token vocabulary, {args.slots} slots, CPU PJRT; llguidance "
             f"{llguidance.get_version()}, "
             f"tokenizer read in {tok_s:.2f} s.", "",
             "| grammar | mask per slot and step | steps timed |", "|---|---|---|"]
    lines += [f"| {kind} | {us:.0f} µs | {n} |" for kind, us, n in masks]
    lines += ["", "| decode step (every slot busy) | ms |", "|---|---|",
              f"| no constrained slot | {plain * 1e3:.1f} |",
              f"| every slot constrained (JSON schema) | {constrained * 1e3:.1f} |", "",
              f"One slot's mask is {mean_mask / 1e3 / (plain * 1e3) * 100:.2f}% of a decode step; all {args.slots} "
              f"slots' masks {args.slots * mean_mask / 1e3 / (plain * 1e3) * 100:.1f}%; the constrained step "
              f"measured {(constrained / plain - 1) * 100:+.1f}% against the plain one."]
    text = "\n".join(lines) + "\n"
    return publish(text, args.output)


if __name__ == "__main__":
    sys.exit(main())
