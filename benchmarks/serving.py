"""Serving throughput on this machine's CPU PJRT: the continuous-batching engine against sequential
serving of the same programs, the old host round-trip loop, and transformers' generate (torch eager).

    python benchmarks/serving.py [--configs llama-30m] [--concurrency 1,4,16] [--new-tokens 64] [-o RESULTS-serving.md]

For each config (a Llama built from a config with seeded random weights; token ids only, no tokenizer):
the model is exported once with ``tte.export_llm(..., target="tpu", batch_size=16)`` and then, for
1, 4 and 16 concurrent requests (prompts of 16..48 random tokens, ``--new-tokens`` greedy tokens each,
no early stop), we time:
- engine: all requests submitted at once to :class:`torchtpu_export.engine.Engine` (its thread running),
  the ``decode_batch`` program stepping every slot;
- sequential: the same engine on the one-slot ``decode`` program, the requests one after another;
- host loop: the requests one after another through ``llm.HostLoop`` (the KV cache goes device → host →
  device through numpy every step, as ``examples/zoo.py:generate`` did);
- transformers eager: ``model.generate`` on the same weights, one request at a time and the whole batch
  at once (left-padded), torch on the same 2 threads.
Reported: tokens per second (all requests' new tokens over the wall time), time per output token (per
request, from its first token to its last), and each loop's host<->device bytes per decode step.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples"))

CONFIGS = {  # name -> (Llama config, cache length, prefill lengths)
    "llama-30m": (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024), 256, (16, 64)),
    "smollm-135m": (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True), 256, (16, 64)),
}


def build(config: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02)
    return model


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(16, 49))).tolist() for _ in range(n)]


def run_engine(engine, batch, new_tokens: int, sequential: bool):
    t0 = time.perf_counter()
    if sequential:
        requests = []
        for ids in batch:
            r = engine.submit(ids, new_tokens)
            r.result()
            requests.append(r)
    else:
        requests = [engine.submit(ids, new_tokens) for ids in batch]
        for r in requests:
            r.result()
    wall = time.perf_counter() - t0
    tpot = np.mean([(r.times["done"] - r.times["first_token"]) / max(1, len(r.tokens) - 1) for r in requests])
    return sum(len(r.tokens) for r in requests) / wall, tpot, [r.tokens for r in requests]


def run_host_loop(program, batch, new_tokens: int):
    from torchtpu_export import llm
    moved = []

    class Counting:  # the program, with the bytes of every decode call's inputs and outputs counted
        signatures = program.signatures

        def inputs(self, sig):
            return program.inputs(sig)

        def __call__(self, signature_name, **feed):
            outs = program(signature_name=signature_name, **feed)
            if signature_name == llm.DECODE:
                moved.append(sum(v.nbytes for v in feed.values()) + sum(np.asarray(v).nbytes for v in outs.values()))
            return outs

    t0 = time.perf_counter()
    tokens, tpots = [], []
    for ids in batch:
        loop = llm.HostLoop(Counting())
        loop.prefill(ids[:-1])
        out, token = [], ids[-1]
        first = None
        for _ in range(new_tokens):
            token = int(np.argmax(loop.decode(token)))
            out.append(token)
            first = first or time.perf_counter()
        tpots.append((time.perf_counter() - first) / max(1, new_tokens - 1))
        tokens.append(out)
    wall = time.perf_counter() - t0
    return len(batch) * new_tokens / wall, float(np.mean(tpots)), tokens, float(np.mean(moved))


def run_transformers(model, batch, new_tokens: int, batched: bool):
    import torch
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        if batched:
            width = max(len(ids) for ids in batch)
            x = torch.tensor([[0] * (width - len(ids)) + ids for ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            out = model.generate(x, attention_mask=mask, **kw)[:, width:].tolist()
        else:
            out = [model.generate(torch.tensor([ids]), **kw)[0, len(ids):].tolist() for ids in batch]
    wall = time.perf_counter() - t0
    return len(batch) * new_tokens / wall, wall / new_tokens, out


def bench(name: str, concurrency: list[int], new_tokens: int) -> dict:
    import torch
    import torchtpu_export as tte
    from torchtpu_export.engine import Engine
    torch.set_num_threads(2)
    config, cache, lengths = CONFIGS[name]
    model = build(config)
    slots = max(concurrency)
    t = time.perf_counter()
    program = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache,
                             batch_size=slots, platforms=("cpu",))
    export_s = time.perf_counter() - t
    batched, single = Engine(program).start(), Engine(program, batched=False).start()
    # every program compiled before timing: batched prefill, and each prefill length on its own
    warm = prompts(slots, config["vocab_size"], seed=99)
    long = [list(range(3, 3 + sum(lengths) + 1))]
    run_engine(batched, warm, 4, False)
    for engine in (batched, single):
        run_engine(engine, long, 4, True)
    run_transformers(model, warm[:2], 2, True)
    rows = []
    for n in concurrency:
        batch = prompts(n, config["vocab_size"], seed=n)
        e_tps, e_tpot, e_tok = run_engine(batched, batch, new_tokens, sequential=False)
        s_tps, s_tpot, s_tok = run_engine(single, batch, new_tokens, sequential=True)
        h_tps, h_tpot, h_tok, h_bytes = run_host_loop(program, batch, new_tokens)
        t_tps, t_tpot, t_tok = run_transformers(model, batch, new_tokens, batched=False)
        tb_tps, tb_tpot, _ = run_transformers(model, batch, new_tokens, batched=True) if n > 1 else (t_tps, t_tpot, None)
        agree = np.mean([a == b for a, b in zip(e_tok, t_tok)])
        rows.append(dict(n=n, engine=(e_tps, e_tpot), sequential=(s_tps, s_tpot), host=(h_tps, h_tpot),
                         hf=(t_tps, t_tpot), hf_batched=(tb_tps, tb_tpot), host_bytes=h_bytes,
                         engine_bytes=4 * slots, same_tokens=float(agree),
                         seq_same=float(np.mean([a == b for a, b in zip(s_tok, h_tok)]))))
        print(f"{name} n={n}: engine {e_tps:.1f} tok/s, sequential {s_tps:.1f}, host loop {h_tps:.1f}, "
              f"transformers {t_tps:.1f} (batched {tb_tps:.1f}); tokens equal to transformers: {agree:.0%}",
              flush=True)
    batched.stop()
    single.stop()
    params = sum(p.numel() for p in model.parameters())
    return dict(name=name, params=params, cache=cache, lengths=lengths, slots=slots, export_s=export_s, rows=rows)


def table(results: list[dict], args) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [f"# Serving on CPU PJRT ({datetime.date.today()}, {os.cpu_count()} cores, {cpu}, "
             f"Python {platform.python_version()})", "",
             f"`python benchmarks/serving.py --configs {','.join(r['name'] for r in results)} "
             f"--concurrency {args.concurrency} --new-tokens {args.new_tokens}`", "",
             "Tokens per second over all requests (higher is better) and time per output token per request "
             "(ms). `engine`: continuous batching on the exported `decode_batch`; `sequential`: the same engine "
             "on the one-slot `decode`, one request after another; `host loop`: the cache through numpy each "
             "step; `transformers`: `generate` in torch eager, one request at a time and (batched) all at once.", ""]
    for r in results:
        lines += [f"## {r['name']} ({r['params'] / 1e6:.0f}M parameters, cache {r['cache']}, prefill "
                  f"{'/'.join(map(str, r['lengths']))}, {r['slots']} slots; export {r['export_s']:.0f} s)", "",
                  "| requests | engine tok/s | sequential tok/s | host loop tok/s | transformers tok/s | "
                  "transformers batched tok/s | engine / sequential | engine / transformers (best) | "
                  "TPOT engine ms | TPOT sequential ms | TPOT transformers ms | host bytes per decode step: "
                  "engine / host loop |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in r["rows"]:
            best_hf = max(row["hf"][0], row["hf_batched"][0])
            lines.append(
                f"| {row['n']} | {row['engine'][0]:.1f} | {row['sequential'][0]:.1f} | {row['host'][0]:.1f} | "
                f"{row['hf'][0]:.1f} | {row['hf_batched'][0]:.1f} | {row['engine'][0] / row['sequential'][0]:.2f}x | "
                f"{row['engine'][0] / best_hf:.2f}x | {row['engine'][1] * 1e3:.1f} | {row['sequential'][1] * 1e3:.1f} | "
                f"{row['hf'][1] * 1e3:.1f} | {row['engine_bytes']:,} / {row['host_bytes']:,.0f} |")
        same = ", ".join(f"{row['n']}: {row['same_tokens']:.0%}" for row in r["rows"])
        lines += ["", f"Greedy tokens equal to transformers' (share of requests, by concurrency): {same}.", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="llama-30m")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    concurrency = [int(n) for n in args.concurrency.split(",")]
    results = [bench(name, concurrency, args.new_tokens) for name in args.configs.split(",")]
    text = table(results, args)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
