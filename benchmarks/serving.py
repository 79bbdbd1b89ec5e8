"""Serving throughput on this machine's CPU PJRT: the continuous-batching engine against sequential
serving of the same programs, the old host round-trip loop, and transformers' generate (torch eager).

    python -m benchmarks.serving [--configs llama-30m] [--concurrency 1,4,16,64] [--new-tokens 64]
                                 [-o RESULTS-serving.md]
    python -m benchmarks.serving --concurrency '' --prefix 0 --capacity v5e    # sequences one chip holds
    python -m benchmarks.serving --concurrency '' --prefix 0 --start           # a server's start: compile or load

For each config (a Llama built from a config with seeded random weights; token ids only, no tokenizer):
the model is exported once with ``tte.export_llm(..., target="tpu", batch_size=64)`` (and once more with a
paged KV cache, ``kv_pages="auto"``) and then, for 1, 4, 16 and 64 concurrent requests (prompts of 16..48
random tokens, ``--new-tokens`` greedy tokens each,
no early stop), we time:
- engine: all requests submitted at once to :class:`torchtpu_export.engine.Engine` (its thread running),
  the ``decode_batch`` program stepping every slot; paged engine: the same over the paged export
  (:class:`torchtpu_export.engine.PagedEngine`);
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
import re
import sys
import time

import numpy as np

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
    paged_program = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache,
                                   batch_size=slots, kv_pages="auto", platforms=("cpu",))
    batched, single, paged = Engine(program), Engine(program, batched=False), Engine(paged_program)
    for engine in (batched, single, paged):  # every call compiled before timing, as a server does
        engine.warm()
        engine.start()
    # and run once: batched prefill, each prefill length on its own
    warm = prompts(slots, config["vocab_size"], seed=99)
    long = [list(range(3, 3 + sum(lengths) + 1))]
    run_engine(batched, warm, 4, False)
    run_engine(paged, warm, 4, False)
    for engine in (batched, single, paged):
        run_engine(engine, long, 4, True)
    run_transformers(model, warm[:2], 2, True)
    rows = []
    for n in concurrency:
        batch = prompts(n, config["vocab_size"], seed=n)
        e_tps, e_tpot, e_tok = run_engine(batched, batch, new_tokens, sequential=False)
        p_tps, p_tpot, p_tok = run_engine(paged, batch, new_tokens, sequential=False)
        s_tps, s_tpot, s_tok = run_engine(single, batch, new_tokens, sequential=True)
        h_tps, h_tpot, h_tok, h_bytes = run_host_loop(program, batch, new_tokens)
        t_tps, t_tpot, t_tok = run_transformers(model, batch, new_tokens, batched=False)
        tb_tps, tb_tpot, _ = run_transformers(model, batch, new_tokens, batched=True) if n > 1 else (t_tps, t_tpot, None)
        agree = np.mean([a == b for a, b in zip(e_tok, t_tok)])
        rows.append(dict(n=n, engine=(e_tps, e_tpot), paged=(p_tps, p_tpot), paged_same=p_tok == e_tok,
                         sequential=(s_tps, s_tpot), host=(h_tps, h_tpot),
                         hf=(t_tps, t_tpot), hf_batched=(tb_tps, tb_tpot), host_bytes=h_bytes,
                         engine_bytes=4 * slots, same_tokens=float(agree),
                         seq_same=float(np.mean([a == b for a, b in zip(s_tok, h_tok)]))))
        print(f"{name} n={n}: engine {e_tps:.1f} tok/s, paged {p_tps:.1f}, sequential {s_tps:.1f}, "
              f"host loop {h_tps:.1f}, "
              f"transformers {t_tps:.1f} (batched {tb_tps:.1f}); tokens equal to transformers: {agree:.0%}",
              flush=True)
    batched.stop()
    single.stop()
    paged.stop()
    params = sum(p.numel() for p in model.parameters())
    return dict(name=name, params=params, cache=cache, lengths=lengths, slots=slots, export_s=export_s, rows=rows)


# ---- prefix caching: time to first token of a repeated prefix ---------------------------------------------

def prefix_ttft(name: str, prefix: int, new_tokens: int = 8, repeats: int = 3) -> dict:
    """Time to first token of requests that share a ``prefix``-token start (a system prompt), the engine with
    and without its prefix cache: the first request (nothing cached), then later ones with other tails (the
    prefix's pages cached). Medians over ``repeats`` rounds, each with a prefix of its own."""
    import torch
    import torchtpu_export as tte
    from torchtpu_export.engine import Engine
    torch.set_num_threads(2)
    config, _, _ = CONFIGS[name]
    cache, lengths = max(1024, prefix + 64), (16, 64, 256)
    model = build(config)
    program = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache,
                             platforms=("cpu",))
    paged = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache, batch_size=4,
                           kv_pages="auto", platforms=("cpu",))
    engines = {"prefix cache": Engine(program), "no prefix cache": Engine(program, prefix_cache=False),
               "paged, prefix pages shared": Engine(paged), "paged, no prefix cache": Engine(paged, prefix_cache=False)}
    rng = np.random.default_rng(5)
    for engine in engines.values():  # every prefill length and the page copy compiled before timing
        engine.generate(rng.integers(3, config["vocab_size"], sum(lengths) + 40).tolist(), 2)
        engine.generate(rng.integers(3, config["vocab_size"], 40).tolist(), 2)
        engine.generate(rng.integers(3, config["vocab_size"], 40).tolist(), 2)
    times = {k: {"first": [], "repeat": []} for k in engines}
    same = True
    for round_ in range(repeats):
        system = rng.integers(3, config["vocab_size"], prefix).tolist()
        tails = [rng.integers(3, config["vocab_size"], 20).tolist() for _ in range(3)]
        outs = {}
        for key, engine in engines.items():
            got = []
            for i, tail in enumerate(tails):
                r = engine.submit(system + tail, new_tokens)
                while not r.done:
                    engine.step()
                times[key]["first" if i == 0 else "repeat"].append(r.times["first_token"] - r.times["submitted"])
                got.append(r.tokens)
            outs[key] = got
        same = same and all(out == outs["no prefix cache"] for out in outs.values())
    med = {k: {w: float(np.median(v)) for w, v in t.items()} for k, t in times.items()}
    print(f"{name} prefix {prefix}: " + ", ".join(f"{k}: first {v['first'] * 1e3:.0f} ms, repeat "
                                                   f"{v['repeat'] * 1e3:.0f} ms" for k, v in med.items()), flush=True)
    return dict(name=name, prefix=prefix, cache=cache, lengths=lengths, med=med, same=same)


def prefix_text(r: dict, args) -> str:
    lines = [f"## Prefix caching: time to first token ({r['name']}, a {r['prefix']}-token shared prefix + 20 "
             f"tokens, cache {r['cache']}, prefill {'/'.join(map(str, r['lengths']))})", "",
             f"`python -m benchmarks.serving --concurrency '' --prefix {r['prefix']}` (medians of 3 prefixes; "
             "each prefix's first request, then two more with other tails)", "",
             "| engine | first request ms | repeat of the prefix ms | repeat / first |", "|---|---:|---:|---:|"]
    for k, v in r["med"].items():
        lines.append(f"| {k} | {v['first'] * 1e3:.0f} | {v['repeat'] * 1e3:.0f} | {v['repeat'] / v['first']:.2f} |")
    lines += ["", f"Tokens with and without the prefix cache, slots and paged, equal: {'yes' if r['same'] else 'NO'}.",
              "The slot engine copies cached pages into the request's own cache; the paged engine's request reads "
              "them in place (`export_llm(..., batch_size=4, kv_pages='auto')`).", ""]
    return "\n".join(lines) + "\n"


# ---- a server's start: every engine call compiled, or loaded from the file -------------------------------

_START = """
import sys, time
t0 = time.perf_counter()
import torchtpu_export as tte
from torchtpu_export.engine import Engine
t1 = time.perf_counter()
program = tte.load(sys.argv[1], trust_stored_executables=True)  # the benchmark's own files
t2 = time.perf_counter()
engine = Engine(program)
t3 = time.perf_counter()
engine.warm()
t4 = time.perf_counter()
tokens = engine.generate(list(range(3, 40)), 4)
t5 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, len(list(engine.calls())))
"""


def start_times(name: str, repeats: int = 3) -> dict:
    """What ``serve`` does before it takes requests, for the default tpu export (8 slots, prefix cache) of
    ``name``, each in a fresh process: import, load the file, build the engine, ready every device call
    (``Engine.warm``: compiled, or loaded where the file stores them, ``compile --topology cpu``), then one
    request. Medians over ``repeats`` processes, without and with stored executables."""
    import subprocess
    import tempfile

    import torch
    import torchtpu_export as tte
    config, cache, lengths = CONFIGS[name]
    model = build(config)
    with tempfile.TemporaryDirectory() as tmp:
        plain, stored = os.path.join(tmp, "plain.tpu"), os.path.join(tmp, "stored.tpu")
        with torch.no_grad():
            program = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache,
                                     platforms=("cpu",))
        program.save(plain)
        t = time.perf_counter()
        program.compile("cpu").save(stored)
        compile_s = time.perf_counter() - t
        out = {}
        for key, path in (("compiled at start", plain), ("stored executables loaded", stored)):
            runs = []
            for _ in range(repeats):
                r = subprocess.run([sys.executable, "-c", _START, path], capture_output=True, text=True, check=True)
                runs.append([float(v) for v in r.stdout.split()])
            out[key] = [float(np.median([run[i] for run in runs])) for i in range(6)]
            sizes = os.path.getsize(path)
            out[key].append(sizes)
        print(f"{name} start: " + ", ".join(f"{k}: warm {v[3]:.2f} s" for k, v in out.items()), flush=True)
    return dict(name=name, cache=cache, lengths=lengths, compile_s=compile_s, times=out)


def start_text(r: dict, args) -> str:
    calls = int(next(iter(r["times"].values()))[5])
    lines = [f"## A server's start ({r['name']}, the default tpu export: 8 slots, cache {r['cache']}, prefill "
             f"{'/'.join(map(str, r['lengths']))}; {calls} engine calls)", "",
             "`python -m benchmarks.serving --concurrency '' --prefix 0 --start` (medians of 3 fresh processes; "
             f"`compile --topology cpu` took {r['compile_s']:.1f} s once, at build time)", "",
             "| file | import s | load s | engine s | warm (every call ready) s | first request (4 tokens) s | "
             "start to ready s | file MB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, v in r["times"].items():
        lines.append(f"| {key} | {v[0]:.2f} | {v[1]:.2f} | {v[2]:.2f} | {v[3]:.2f} | {v[4]:.2f} | "
                     f"{sum(v[:4]):.2f} | {v[6] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


# ---- serving dtypes and the TPU compiler's view of a decode step ----------------------------------------

TPU_CONFIGS = {  # name -> (builder, config); Qwen3-0.6B's shape (hidden 1024, 28 layers, GQA 16:8, head 128)
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 max_position_embeddings=40960, tie_word_embeddings=True)),
}


def build_any(kind: str, config: dict):
    import torch
    if kind == "llama":
        return build(config)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**config, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model = model.to_empty(device="cpu").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0.0, 0.02, generator=gen)
    return model


def _stats(prog, sig: str, topology: str) -> dict:
    st = prog.compiled_stats(topology, signature_name=sig)
    return dict(hbm=st["hbm_bytes"]["total"], aliased=st["hbm_bytes"].get("aliased", 0), fits=st["fits"],
                capacity=st["hbm_capacity_bytes"], flops=st["flops"], bytes=st["bytes_accessed"],
                seconds=st["roofline"]["seconds"], bound=st["roofline"]["bound"])


def dtypes(name: str, slots: int, topologies: list[str], steps: int = 32) -> list[dict]:
    """float, bf16 (weights, activations and KV cache) and int8 weight-only: bytes, quality against float
    (next-token top-1 agreement and KL over teacher-forced positions) and the compiled decode step."""
    import torch
    import torchtpu_export as tte
    from torchtpu_export import llm
    config, cache, lengths = CONFIGS[name]
    model = build(config)
    texts = prompts(4, config["vocab_size"], seed=7)
    with torch.no_grad():  # the float model's own greedy continuations, fed back (teacher forcing)
        seqs = [model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                               pad_token_id=0)[0].tolist() for ids in texts]
        ref = [torch.log_softmax(model(torch.tensor([s])).logits[0, len(ids) - 1:-1].float(), -1).numpy()
               for s, ids in zip(seqs, texts)]
    rows = []
    for recipe in (None, "bf16", "int8_weight_only"):
        prog = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache,
                              batch_size=slots, quant_config=recipe, platforms=("tpu", "cpu"))
        agree, kl = [], []
        for s, ids, r in zip(seqs, texts, ref):
            got = llm.next_token_logits(prog, s, len(ids) - 1)[:steps].astype(np.float64)
            logq = got - np.log(np.exp(got - got.max(-1, keepdims=True)).sum(-1, keepdims=True)) - got.max(-1, keepdims=True)
            agree.append(np.mean(got.argmax(-1) == r.argmax(-1)))
            kl.append(np.mean((np.exp(r) * (r - logq)).sum(-1)))
        row = dict(recipe=recipe or "float", weights=sum(w.nbytes for w in prog.artifact.weights.values()),
                   agree=float(np.mean(agree)), kl=float(np.mean(kl)),
                   cache_dtype=next(i.dtype for i in prog.inputs("decode") if i.name.startswith("kv_cache")))
        for topo in topologies:
            row[topo] = _stats(prog, llm.DECODE_BATCH, topo)
        rows.append(row)
        print(f"{name} {row['recipe']}: {row['weights'] / 1e6:.1f} MB, top-1 {row['agree']:.3f}, KL {row['kl']:.4f}",
              flush=True)
    return rows


def tpu_table(name: str, batches: list[int], topologies: list[str], cache: int, recipe: str | None) -> list[dict]:
    """The decode step of a full-size config compiled by libtpu for each batch: HBM, fit, roofline."""
    import torchtpu_export as tte
    from torchtpu_export import llm
    kind, config = TPU_CONFIGS[name]
    model = build_any(kind, config)
    rows = []
    for b in batches:
        prog = tte.export_llm(model, None, target="tpu", prefill_lengths=(16,), cache_length=cache,
                              batch_size=b, quant_config=recipe, platforms=("tpu",))
        sig = llm.DECODE if b == 1 else llm.DECODE_BATCH
        row = dict(batch=b)
        for topo in topologies:
            row[topo] = _stats(prog, sig, topo)
        rows.append(row)
        print(f"{name} batch {b}: " + ", ".join(f"{t} {row[t]['hbm'] / 2**30:.2f} GiB, {row[t]['seconds'] * 1e3:.2f} ms"
                                              for t in topologies), flush=True)
        del prog
    params = sum(p.numel() for p in model.parameters())
    return [dict(name=name, params=params, cache=cache, recipe=recipe or "float", rows=rows)]


# ---- capacity: concurrent sequences one chip holds, paged cache against a cache per slot -----------------

def capacity(name: str, topology: str, cache: int = 2048, page: int = 16, slot_batches=(8, 16), rows: int = 128,
             pools=(1025, 2049), mix=(100, 2000), recipe: str = "bf16") -> dict:
    """How many sequences of a length mix (uniform in ``mix``: prompt and reply) one chip of ``topology``
    holds at once, from the TPU compiler's memory analysis of the decode step (weights, cache, temporaries):
    with a cache per slot (``decode_batch``: every slot holds ``cache`` positions, whatever its sequence's
    length) and with a paged cache (``decode_paged`` over ``rows`` rows: a sequence holds its own pages).
    Each program's HBM is compiled at two sizes (slots, pool pages); bytes per slot and per page are the
    slope, the rest the intercept (the pool that fills the chip is not compiled itself: exporting it takes
    its sample caches in host memory, more than this machine has)."""
    import torchtpu_export as tte
    from torchtpu_export import llm
    kind, config = TPU_CONFIGS[name]
    model = build_any(kind, config)

    def hbm(sig: str, **kw) -> dict:
        prog = tte.export_llm(model, None, target="tpu", prefill_lengths=(16,), cache_length=cache, quant_config=recipe,
                              platforms=("tpu",), check=False, **kw)
        stats = _stats(prog, sig, topology)
        print(f"{name} {sig} {kw}: {stats['hbm'] / 2 ** 30:.2f} GiB (fits: {stats['fits']})", flush=True)
        return stats

    slots = {b: hbm(llm.DECODE_BATCH, batch_size=b) for b in slot_batches}
    (b1, s1), (b2, s2) = slots.items()
    per_slot = (s2["hbm"] - s1["hbm"]) / (b2 - b1)
    chip = s1["capacity"]
    slots_fit = int((chip - (s1["hbm"] - b1 * per_slot)) // per_slot)
    paged = {p: hbm(llm.DECODE_PAGED, batch_size=rows, kv_pages=p, page_size=page) for p in pools}
    (p1, q1), (p2, q2) = paged.items()
    per_page = (q2["hbm"] - q1["hbm"]) / (p2 - p1)
    pool = int((chip - (q1["hbm"] - p1 * per_page)) // per_page)
    lengths = np.random.default_rng(0).integers(mix[0], mix[1] + 1, 100_000)
    used = np.cumsum(-(-lengths // page))  # pages of the first k sequences (page 0 is no sequence's)
    by_pages = int(np.searchsorted(used, pool - 1, side="right"))
    return dict(name=name, topology=topology, cache=cache, page=page, recipe=recipe, mix=mix, rows=rows,
                chip=chip, per_slot=per_slot, slots_fit=slots_fit, slots=slots, per_page=per_page, pool=pool,
                paged=paged, by_pages=by_pages, paged_fit=min(by_pages, rows), mean=float(lengths.mean()),
                params=sum(p.numel() for p in model.parameters()))


# ---- mixed steps: packed (decode tokens and prompt chunks in one sequence) against the padded rows --------

def mixed_cost(name: str, topology: str, rows: int = 32, cache: int = 1024, lengths=(64, 256), page: int = 16,
               pages: int = 257, recipe: str = "bf16") -> dict:
    """The TPU compiler's view (FLOPs, bytes accessed, roofline) of a paged export's steps while prompts arrive
    during decoding: the packed mixed steps the engine calls (``mixed_paged_<N>``: ``rows`` decode tokens and one
    row's ``N``-token chunk, ``rows + N`` tokens; ``mixed_paged_<N>_blocks_<k>``: the N in k blocks, each a
    prompt's, for a burst of arrivals), against the ``rows x N`` tokens of the call that carried the same work when
    every row was padded to the chunk (``prefill_paged_<N>``, what the engine called before, then with each row's
    first-token logits too), and the plain decode step (``decode_paged``). The pool is small (``pages``): a step's
    cost reads the rows' page tables, not the pool's size, and each program's sample pools are in host memory while
    it is exported."""
    import torchtpu_export as tte
    from torchtpu_export import llm
    kind, config = TPU_CONFIGS[name]
    model = build_any(kind, config)
    prog = tte.export_llm(model, None, target="tpu", prefill_lengths=lengths, cache_length=cache, quant_config=recipe,
                          platforms=("tpu",), check=False, batch_size=rows, batch_buckets=(), kv_pages=pages,
                          page_size=page)
    out = dict(name=name, topology=topology, rows=rows, cache=cache, pages=pages, recipe=recipe, steps={},
               chunks=llm.mixed_chunks(lengths[0], rows))
    for sig in [llm.DECODE_PAGED] + [s for n in lengths for s in (
            llm.MIXED_PAGED.format(n), llm.MIXED_PAGED_BLOCKS.format(n, llm.mixed_chunks(n, rows)),
            llm.PREFILL_PAGED.format(n))]:
        out["steps"][sig] = _stats(prog, sig, topology)
        st = out["steps"][sig]
        print(f"{name} {sig}: {st['flops'] / 1e9:.1f} GFLOP, {st['bytes'] / 1e9:.2f} GB, "
              f"{st['seconds'] * 1e3:.2f} ms", flush=True)
    return out


def mixed_text(m: dict, args) -> str:
    steps = m["steps"]
    lines = [f"## Mixed steps: packed against padded, {m['name']} on {m['topology']} ({datetime.date.today()}, "
             f"libtpu's cost analysis ahead of time on {os.cpu_count()} CPU cores)", "",
             f"`python -m benchmarks.serving --concurrency '' --prefix 0 --mixed {m['topology']}`", "",
             f"A paged export of {m['rows']} rows ({m['recipe']}, cache {m['cache']} positions, pool "
             f"{m['pages']} pages). While rows decode, "
             "arriving prompts' chunks ride in the decode step. Packed (`mixed_paged_<N>`, what the engine calls): "
             f"the {m['rows']} decode tokens and one row's chunk of N, {m['rows']} + N tokens; for a burst of "
             f"short prompts (`mixed_paged_<N>_blocks_{m['chunks']}`), the N in {m['chunks']} blocks, each a "
             "prompt's, attending over its own pages. Padded "
             f"(`prefill_paged_<N>`, the call that carried the same work before): every row padded to the chunk, "
             f"{m['rows']} x N tokens.", "",
             "| step | tokens | GFLOP | bytes accessed | roofline |", "|---|---:|---:|---:|---:|"]
    for sig, st in steps.items():
        n = int(re.match(r"\w+?_paged_(\d+)", sig).group(1)) if sig != "decode_paged" else 0
        tokens = m["rows"] + n if sig.startswith("mixed") else m["rows"] * max(n, 1)
        lines.append(f"| `{sig}` | {tokens:,} | {st['flops'] / 1e9:,.1f} | {st['bytes'] / 1e9:.2f} GB | "
                     f"{st['seconds'] * 1e3:.2f} ms ({st['bound']}) |")
    lines += ["", "The roofline is the larger of FLOPs over the chip's peak and bytes over its HBM bandwidth; "
              "the compiler's bytes accessed count staging through on-chip memory too, so compare them between "
              "these programs only.", ""]
    return "\n".join(lines)


def capacity_text(c: dict, args) -> str:
    gib = 2 ** 30
    s1 = next(iter(c["slots"].values()))
    p, q = next(iter(c["paged"].items()))
    lines = [f"## Capacity: {c['name']} on one {c['topology']} chip ({datetime.date.today()}, libtpu's memory analysis "
             f"ahead of time on {os.cpu_count()} CPU cores)", "",
             f"`python -m benchmarks.serving --concurrency '' --prefix 0 --capacity {c['topology']}`", "",
             f"Sequences of {c['mix'][0]}-{c['mix'][1]} tokens each (prompt and reply, uniform; mean "
             f"{c['mean']:.0f}) held at once, {c['recipe']} weights and cache, cache {c['cache']} positions per "
             f"sequence at most. Slots: `decode_batch`, each slot {c['cache']} positions whatever its sequence's "
             f"length. Paged: `decode_paged` of {c['rows']} rows over a pool of {c['page']}-position pages "
             "(`export_llm(..., kv_pages=P)`), each sequence holding its own pages.", "",
             "| cache | HBM per unit (compiler) | fixed HBM (weights, temporaries) | units on the chip | sequences "
             "of the mix at once |", "|---|---:|---:|---:|---:|",
             f"| a slot per sequence | {c['per_slot'] / 2 ** 20:.1f} MiB per slot | "
             f"{(s1['hbm'] - next(iter(c['slots'])) * c['per_slot']) / gib:.2f} GiB | {c['slots_fit']} slots | "
             f"**{c['slots_fit']}** |",
             f"| paged ({c['rows']} rows) | {c['per_page'] / 2 ** 20:.2f} MiB per page | "
             f"{(q['hbm'] - p * c['per_page']) / gib:.2f} GiB | {c['pool']:,} pages | "
             f"**{c['paged_fit']}**" + (f" (the pages hold {c['by_pages']}; rows cap it)" if c['by_pages'] > c['rows']
                                        else "") + " |", "",
             "Compiled: " + "; ".join(f"{sig} at {n:,} {unit}: {st['hbm'] / gib:.2f} GiB (aliased "
                                      f"{st['aliased'] / gib:.2f})" for sig, unit, group in (
                                          ("`decode_batch`", "slots", c["slots"]), ("`decode_paged`", "pages",
                                                                                     c["paged"]))
                                      for n, st in group.items())
             + f", of the chip's {c['chip'] / gib:.1f} GiB. Units on the chip extrapolate those lines.", ""]
    return "\n".join(lines)


def tpu_text(dtype_rows, name, tpu, topologies, args) -> str:
    gib = 2 ** 30
    lines = []
    if dtype_rows:
        lines += [f"# Serving dtypes and the TPU decode step ({datetime.date.today()}, compiled ahead of time by "
                  f"libtpu on {os.cpu_count()} CPU cores)", "",
                  f"`python -m benchmarks.serving --concurrency '' --configs {name} --slots {args.slots} "
                  f"--topologies {args.topologies} --tpu-configs {args.tpu_configs} --tpu-batches {args.tpu_batches} "
                  f"--tpu-cache {args.tpu_cache}`", "",
                  f"## Serving dtypes ({name}, decode_batch of {args.slots} slots)", "",
                  "Quality: the float model's greedy continuations of 4 prompts fed back (teacher forcing) through "
                  "the exported program; top-1 agreement of its next-token predictions with torch eager float and "
                  "the mean KL(float || program).", "",
                  "| recipe | weights | KV cache | top-1 agreement | KL | " +
                  " | ".join(f"{t} HBM (aliased)" for t in topologies) + " | " +
                  " | ".join(f"{t} step (roofline)" for t in topologies) + " |",
                  "|---|---:|---|---:|---:|" + "---:|" * (2 * len(topologies))]
        for r in dtype_rows:
            lines.append(f"| {r['recipe']} | {r['weights'] / 1e6:.1f} MB | {r['cache_dtype']} | {r['agree']:.3f} | "
                         f"{r['kl']:.2e} | " +
                         " | ".join(f"{r[t]['hbm'] / 1e6:.1f} MB ({r[t]['aliased'] / 1e6:.1f} MB)" for t in topologies)
                         + " | " + " | ".join(f"{r[t]['seconds'] * 1e6:.0f} us ({r[t]['bound']})" for t in topologies)
                         + " |")
        lines.append("")
    for t in tpu:
        lines += [f"## {t['name']} decode step on TPU ({t['params'] / 1e9:.2f}B parameters, {t['recipe']}, cache "
                  f"{t['cache']} positions per slot; compiled by libtpu ahead of time)", "",
                  "| batch | " + " | ".join(f"{tp} HBM / capacity | {tp} fits | {tp} roofline step | {tp} tokens/s (roofline)"
                                         for tp in topologies) + " |",
                  "|---:|" + "---:|---|---:|---:|" * len(topologies)]
        for r in t["rows"]:
            cells = []
            for tp in topologies:
                s = r[tp]
                cells += [f"{s['hbm'] / gib:.2f} / {s['capacity'] / gib:.0f} GiB (aliased {s['aliased'] / gib:.2f})",
                          "yes" if s["fits"] else "NO", f"{s['seconds'] * 1e3:.2f} ms ({s['bound']})",
                          f"{r['batch'] / s['seconds']:,.0f}"]
            lines.append(f"| {r['batch']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def table(results: list[dict], args) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [f"# Serving on CPU PJRT ({datetime.date.today()}, {os.cpu_count()} cores, {cpu}, "
             f"Python {platform.python_version()})", "",
             f"`python -m benchmarks.serving --configs {','.join(r['name'] for r in results)} "
             f"--concurrency {args.concurrency} --new-tokens {args.new_tokens}`", "",
             "Tokens per second over all requests (higher is better) and time per output token per request "
             "(ms). `engine`: continuous batching on the exported `decode_batch`; `sequential`: the same engine "
             "on the one-slot `decode`, one request after another; `host loop`: the cache through numpy each "
             "step; `transformers`: `generate` in torch eager, one request at a time and (batched) all at once.", ""]
    for r in results:
        lines += [f"## {r['name']} ({r['params'] / 1e6:.0f}M parameters, cache {r['cache']}, prefill "
                  f"{'/'.join(map(str, r['lengths']))}, {r['slots']} slots; export {r['export_s']:.0f} s)", "",
                  "| requests | engine tok/s | paged engine tok/s | sequential tok/s | host loop tok/s | "
                  "transformers tok/s | transformers batched tok/s | engine / sequential | engine / transformers "
                  "(best) | paged / transformers (best) | TPOT engine ms | TPOT paged ms | TPOT sequential ms | "
                  "TPOT transformers ms | host bytes per decode step: engine / host loop |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in r["rows"]:
            best_hf = max(row["hf"][0], row["hf_batched"][0])
            lines.append(
                f"| {row['n']} | {row['engine'][0]:.1f} | {row['paged'][0]:.1f} | {row['sequential'][0]:.1f} | "
                f"{row['host'][0]:.1f} | {row['hf'][0]:.1f} | {row['hf_batched'][0]:.1f} | "
                f"{row['engine'][0] / row['sequential'][0]:.2f}x | {row['engine'][0] / best_hf:.2f}x | "
                f"{row['paged'][0] / best_hf:.2f}x | {row['engine'][1] * 1e3:.1f} | {row['paged'][1] * 1e3:.1f} | "
                f"{row['sequential'][1] * 1e3:.1f} | {row['hf'][1] * 1e3:.1f} | "
                f"{row['engine_bytes']:,} / {row['host_bytes']:,.0f} |")
        same = ", ".join(f"{row['n']}: {row['same_tokens']:.0%}" for row in r["rows"])
        paged_same = "yes" if all(row["paged_same"] for row in r["rows"]) else "NO"
        lines += ["", f"Greedy tokens equal to transformers' (share of requests, by concurrency): {same}. The paged "
                  f"engine's (`kv_pages='auto'`, {r['slots']} rows) equal the slot engine's: {paged_same}.", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    from benchmarks import publish
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="llama-30m")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--topologies", default="", help="TPU topologies for the compiler's view of the serving dtypes "
                   "and the full-size decode step, e.g. v5e,v6e ('' for none)")
    p.add_argument("--tpu-configs", default="qwen3-0.6b", help="full-size configs compiled for TPU ('' for none)")
    p.add_argument("--tpu-batches", default="1,8,32")
    p.add_argument("--tpu-cache", type=int, default=1024)
    p.add_argument("--slots", type=int, default=16, help="decode_batch slots of the dtype comparison")
    p.add_argument("--prefix", type=int, default=900, help="shared prefix tokens of the time-to-first-token "
                   "comparison with and without the prefix cache (0: none)")
    p.add_argument("--capacity", default="", help="a TPU topology (e.g. v5e): concurrent sequences of a "
                   "100-2000 token mix one chip holds for the first --tpu-configs model, paged cache against slots "
                   "('' for none)")
    p.add_argument("--mixed", default="", help="a TPU topology (e.g. v5e): the first --tpu-configs model's packed "
                   "mixed step against the padded one, from the TPU compiler's cost analysis ('' for none)")
    p.add_argument("--start", action="store_true", help="a server's start for the first --configs model: every "
                   "engine call compiled, against loaded from the file (compile --topology cpu)")
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    concurrency = [int(n) for n in args.concurrency.split(",") if n]
    names = [n for n in args.configs.split(",") if n]
    text = table([bench(name, concurrency, args.new_tokens) for name in names], args) if concurrency else ""
    if args.prefix:
        text += "\n" + prefix_text(prefix_ttft(names[0], args.prefix), args)
    topologies = [t for t in args.topologies.split(",") if t]
    if topologies:
        rows = dtypes(names[0], args.slots, topologies)
        tpu = [t for name in args.tpu_configs.split(",") if name
               for t in tpu_table(name, [int(b) for b in args.tpu_batches.split(",")], topologies, args.tpu_cache,
                                  "bf16")]
        text += "\n" + tpu_text(rows, names[0], tpu, topologies, args)
    if args.start:
        text += "\n" + start_text(start_times(names[0]), args)
    if args.capacity:
        text += "\n" + capacity_text(capacity(args.tpu_configs.split(",")[0], args.capacity), args)
    if args.mixed:
        text += "\n" + mixed_text(mixed_cost(args.tpu_configs.split(",")[0], args.mixed), args)
    return publish(text, args.output)


if __name__ == "__main__":
    sys.exit(main())
