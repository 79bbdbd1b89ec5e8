"""Serving over a paged KV cache (`torchtpu-export DIR --target tpu --kv-pages P`): the engine's rows share one
pool of pages, a prompt's cached prefix pages are read in place, and admission waits for pages; every
request still gets transformers' greedy tokens. Attention over the pages is JAX's paged attention kernel on tpu
for decode rows and ours (``paged_blocks``) for rows of several queries (checked by libtpu, and in Pallas
interpret mode against the gather of the XLA rule)."""
import concurrent.futures
import re

import numpy as np
import openai
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from conftest import export_folder, run_cli
from serving_harness import Server, _compile_events, greedy
from torchtpu_export.engine import Engine
from torchtpu_export.targets.tpu.stored import compile_engine
from torchtpu_export.engine.paged import PagedEngine
from torchtpu_export.errors import InputError

pytestmark = pytest.mark.xdist_group("paged")

PAGES = 13  # two sequences of the full 96 positions (6 pages of 16 each) and page 0: fewer than 4 rows' worth


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model, tok = hf_llms.build("llama")
    folder = tmp_path_factory.mktemp("paged") / "tiny-llama"
    path = folder.parent / "tiny-llama.tpu"
    export_folder(model, tok, folder, ["--target", "tpu", "--platforms", "cpu", "--prefill-lengths", "8,32",
                                       "--cache-length", "96", "--batch-size", "4", "--batch-buckets", "2",
                                       "--kv-pages", str(PAGES), "-o", path])
    return model, path


def _prompts(seed, prefix, tails):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 300, prefix).tolist()
    return [system + rng.integers(3, 300, k).tolist() for k in tails]


def _run(engine, prompts, n, waves=3):
    """``prompts`` submitted in waves (the engine stepping in between), all run to their end."""
    requests = []
    for i in range(0, len(prompts), waves):
        requests += [engine.submit(p, n, stop=[2]) for p in prompts[i:i + waves]]
        for _ in range(3):
            engine.step()
    while engine.busy:
        engine.step()
    return [r.result() for r in requests]


def test_paged_engine_gives_transformers_tokens_for_mixed_lengths_and_arrivals(llm):
    """Ten requests of 1 to 70 prompt tokens arriving in waves on 4 rows, the pool holding two full-length
    sequences: each request gets transformers' greedy tokens (as the slot engine does), prompts are prefilled
    in place several rows per call, arrivals' chunks ride in the decode steps (mixed steps), and when all
    have ended every page is back (none held, none reserved)."""
    model, path = llm
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, k).tolist() for k in (1, 9, 70, 33, 5, 17, 2, 48, 12, 26)]
    wants = [greedy(model, p, 14) for p in prompts]
    engine = Engine(tte.load(path), prefix_cache=False)
    assert isinstance(engine, PagedEngine) and (engine.slots, engine.pages, engine.page_size) == (4, PAGES, 16)
    assert _run(engine, prompts, 14) == wants
    s = engine.stats
    assert s["prefill_row_chunks"] > s["batched_prefill_calls"] + s["mixed_steps"] and s["decode_steps"] < s["tokens"]
    assert s["mixed_steps"] > 0  # arrivals while others decode: their chunks and the decode tokens in one call
    assert s["one_row_steps"] > 0  # a request decoding alone steps its own row (decode_paged_1), not all four
    assert s["small_batch_steps"] > 0  # two through decode_paged_2
    assert s["small_prefill_calls"] > 0  # and prefill chunks of one or two rows (prefill_paged_<N>_rows_<b>)
    assert s["most_pages_in_use"] <= PAGES - 1 and s["prefix_hit_tokens"] == 0
    assert engine._pool.in_use() == 0 and engine._pool.reserved == 0 and engine._pool.cached() == 0
    # the one-slot programs serve the same file without the pages (batched=False)
    single = Engine(tte.load(path), batched=False)
    assert not isinstance(single, PagedEngine) and single.generate(prompts[2], 14, stop=[2]) == wants[2]


def test_paged_prefix_hits_read_cached_pages_in_place(llm):
    """Prompts sharing a 40-token start: the first request's two full pages stay in the pool when it ends,
    later prompts read them (no copy) and prefill only the rest, rows reading the same page at once; the
    tokens are the misses'. A prompt differing in its first token matches nothing."""
    model, path = llm
    prompts = _prompts(1, 40, (3, 9, 17, 1, 30))
    prompts.append([prompts[0][0] + 1] + prompts[0][1:])
    wants = [greedy(model, p, 10) for p in prompts]
    engine = Engine(tte.load(path))
    assert engine.generate(prompts[0], 10, stop=[2]) == wants[0]
    assert engine.stats["prefix_pages_stored"] == 2 and engine._pool.cached() == 2 and engine._pool.in_use() == 0
    before = dict(engine.stats)
    together = [engine.submit(p, 10, stop=[2]) for p in prompts[1:5]]
    while engine.busy:
        engine.step()
    assert [r.result() for r in together] == wants[1:5]
    assert engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 4 * 32
    assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == sum(len(p) - 1 - 32 for p in prompts[1:5])
    before = dict(engine.stats)
    assert engine.generate(prompts[5], 10, stop=[2]) == wants[5]
    assert engine.stats["prefix_hit_tokens"] == before["prefix_hit_tokens"]


def test_a_small_pool_makes_requests_wait_and_evicts_cached_pages(llm):
    """Twelve requests of six 35-token starts on a pool of two full-length sequences: a request is admitted
    when its prompt fits (others wait, none fails; those that arrived last are preempted when the pool runs
    short), cached pages are evicted in the order they were let go when pages are wanted, some requests still
    hit, and every request gets the tokens it gets without the cache."""
    model, path = llm
    prompts = [p for seed in range(6) for p in _prompts(10 + seed, 35, (4, 11))]
    wants = [greedy(model, p, 40) for p in prompts]
    engine = Engine(tte.load(path))
    assert _run(engine, prompts, 40) == wants
    s = engine.stats
    assert s["prefix_evictions"] > 0 and s["prefix_hit_tokens"] > 0 and s["most_pages_in_use"] <= PAGES - 1
    assert engine._pool.in_use() == 0 and engine._pool.reserved == 0 and engine._pool.cached() <= PAGES - 1
    # a cancelled request gives its pages back
    r = engine.submit(prompts[0], 40)
    engine.step()
    assert engine._pool.in_use() > 0
    r.cancel()
    while engine.busy:
        engine.step()
    assert r.finish_reason == "cancelled" and engine._pool.in_use() == 0 and engine._pool.reserved == 0


def test_requests_preempted_when_the_pool_runs_short_make_the_tokens_they_would_have(llm):
    """Four requests of 20-odd prompt tokens and 60 new ones (5 pages each, 20 together) on a pool of 12: all
    four are admitted on their prompts' pages, and as they grow the pool runs short, so the last to arrive are
    preempted (their written pages kept in the pool, their decode state saved) and readmitted later. Each
    request's tokens are those it makes alone: greedy ones transformers', one with penalties (its reply's
    token counts go with its saved state) and one sampled with a seed (its key goes with it) the same as
    alone. With the prefix cache off the preempted ones prefill their prompt and tokens again."""
    model, path = llm
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 300, k).tolist() for k in (21, 17, 25, 19)]
    wants = [greedy(model, p, 60) for p in prompts[:2]]
    extra = [dict(frequency_penalty=0.7, repetition_penalty=1.3), dict(temperature=0.9, top_p=0.95, seed=5)]
    for prefix_cache in (True, False):
        engine = Engine(tte.load(path), prefix_cache=prefix_cache)
        alone = [engine.generate(p, 60, **kw) for p, kw in zip(prompts[2:], extra)]
        assert all(len(a) == 60 for a in alone) and engine.stats["preemptions"] == 0
        requests = [engine.submit(p, 60, stop=[2]) for p in prompts[:2]]
        requests += [engine.submit(p, 60, **kw) for p, kw in zip(prompts[2:], extra)]
        while engine.busy:
            engine.step()
        assert [r.result() for r in requests] == wants + alone
        s = engine.stats
        assert s["preemptions"] > 0 and s["most_pages_in_use"] <= PAGES - 1, s
        assert engine._pool.in_use() == 0 and engine._pool.reserved == 0
        if prefix_cache:  # readmitted, they read the pages they had written
            assert s["prefix_hit_tokens"] > 0


def test_mixed_steps_are_packed_and_read_a_window_s_pages_under_its_own_mask():
    """A packed mixed step is one sequence of B decode tokens and one row's N prompt tokens (``mixed_paged_<N>``:
    tokens ``[1, B + N]``, a position per token, B + 1 page table rows), or N in blocks of several rows'
    (``mixed_paged_<N>_blocks_<k>``: a table row per block, two blocks of 4 here). Gemma 3's sliding-window layers
    attend under a mask of their own (the pages gathered per decode token and per block), its full layers through
    the paged attention op; requests arriving while others decode, their prompts longer than the window and the
    chunk, two of them together (their chunks in one step), get transformers' greedy tokens, through mixed steps of
    all three rows and of one; once the engine is warm, none of its calls compiles."""
    model, tok = hf_llms.build("gemma3")
    prog = tte.export_llm(model, tok, target="tpu", platforms=("cpu",), prefill_lengths=(8,), cache_length=48,
                          batch_size=3, batch_buckets=(), kv_pages="auto", page_size=8)
    shapes = {s.name: tuple(s.shape) for s in prog.inputs("mixed_paged_8")}
    assert (shapes["tokens"], shapes["input_pos"], shapes["page_table"]) == ((1, 11), (11,), (4, 6)), shapes
    shapes = {s.name: tuple(s.shape) for s in prog.inputs("mixed_paged_8_blocks_2")}
    assert (shapes["tokens"], shapes["input_pos"], shapes["page_table"]) == ((1, 11), (11,), (5, 6)), shapes
    assert tuple(prog.outputs("mixed_paged_8_rows_1")[0].shape) == (1, 1, model.config.vocab_size)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, k).tolist() for k in (3, 19, 12, 27, 9, 11, 5)]
    wants = [greedy(model, p, 12) for p in prompts]
    engine = Engine(prog, prefix_cache=False)
    engine.warm()
    events = _compile_events()
    requests = [engine.submit(prompts[0], 12, stop=[2])]
    for i, p in enumerate(prompts[1:4]):
        engine.step()
        engine.step()
        requests.append(engine.submit(p, 12, stop=[2], **({"logprobs": 2} if i == 1 else {})))
    while engine.busy:
        engine.step()
    requests.append(engine.submit(prompts[4], 12, stop=[2]))
    engine.step()
    # two arrive together: the first's 8, then its 2 left and the second's 4 in one step (a block each)
    requests += [engine.submit(p, 12, stop=[2]) for p in prompts[5:]]
    while engine.busy:
        engine.step()
    assert [r.result() for r in requests] == wants and events == [], events
    s = engine.stats
    assert s["mixed_steps"] > s.get("small_mixed_steps", 0) > 0 and s["most_chunks_in_a_step"] >= 2, s


def test_paged_engine_through_the_kernels_in_interpret_mode_gives_the_gathers_tokens(monkeypatch):
    """The engine over a bf16 paged export whose programs on this CPU are the tpu lowering, its kernels in Pallas
    interpret mode (ours for prefill chunks and mixed steps' chunks and blocks; JAX's paged attention for decode
    rows is left out: its TPU interpret mode calls back to the host, which an exported program cannot, so the
    single-step test above checks it), against the same export through the gather of the XLA rule: requests of
    mixed lengths arriving while others decode, two of them together (a step of blocks), get the same tokens."""
    from torchtpu_export.converters import stablehlo
    from torchtpu_export.converters.stablehlo import pallas
    model = _kernel_model()
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 300, k).tolist() for k in (5, 21, 3, 40, 2, 7)]

    def tokens():
        prog = tte.export_llm(model, None, target="tpu", platforms=("cpu",), prefill_lengths=(16,), cache_length=64,
                              batch_size=4, batch_buckets=(), kv_pages="auto", quant_config="bf16")
        engine = Engine(prog, prefix_cache=False)
        requests = [engine.submit(prompts[0], 10)]
        for p in prompts[1:4]:
            engine.step()
            requests.append(engine.submit(p, 10))
        engine.step()
        requests += [engine.submit(p, 10) for p in prompts[4:]]  # together: a step of blocks
        while engine.busy:
            engine.step()
        used = {(e["program"].split("_")[0], e.get("kernel")) for e in prog.kernels()
                if e["op"] == "tte.paged_attention.default"}
        return [r.result() for r in requests], used, engine.stats

    gathered, used, _ = tokens()
    assert not any(kernel for _, kernel in used), used  # the cpu lowering: the gather
    lowering = stablehlo.LoweringContext
    monkeypatch.setattr(stablehlo, "LoweringContext",
                        lambda platform, **kw: lowering("tpu", **dict(kw, kernels_off=("paged_attention",))))
    with pallas.interpret_mode():
        kernels, used, stats = tokens()
    assert {("prefill", "pallas.paged_blocks"), ("mixed", "pallas.paged_blocks")} <= used, used
    assert stats["mixed_steps"] > 0 and stats["most_chunks_in_a_step"] >= 2, stats
    assert kernels == gathered


def test_the_page_pool_counts_and_evicts_idle_cached_pages_in_the_order_they_were_let_go():
    """PagePool's bookkeeping without an engine: a cached page held by a sequence is never evicted nor counted
    as available; idle cached pages go in the order they were let go, a hit taking its page out of that line."""
    from torchtpu_export.engine.prefix import PagePool
    pool = PagePool(6, 4)
    pages = [pool.take() for _ in range(4)]
    for key, page in zip((b"a", b"b", b"c"), pages):
        pool.publish(key, page)
    assert pool.available() == 1  # page 0 is no sequence's; 4 held
    pool.release(pages[2:])  # c cached and idle, the fourth page free (beside the one never taken)
    pool.release(pages[:2])  # then a and b
    assert pool.available() == 5 and pool.cached() == 3
    assert pool.match([b"a", b"x"]) == [pages[0]]  # a held again: not evictable, not available
    assert pool.available() == 4
    taken = [pool.take() for _ in range(4)]  # the two free pages, then c (let go first), then b
    assert taken[2:] == [pages[2], pages[1]] and pool.stats["prefix_evictions"] == 2
    assert pool.available() == 0 and pool.cached() == 1
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.take()


def test_paged_export_is_inspected_and_bad_page_options_are_refused(llm, tmp_path):
    model, path = llm
    shown = run_cli("inspect", path)
    assert ("serving: paged KV cache of 13 pages of 16 positions (0.1 MiB on the device) shared by 4 rows: 192 "
            "positions, 2 sequence(s) of the full 96") in shown.stdout, shown.stdout
    with pytest.raises(InputError, match="kv_pages must be 'auto' or an integer of at least 7"):
        tte.export_llm(model, target="tpu", cache_length=96, prefill_lengths=(8,), kv_pages=6)
    with pytest.raises(InputError, match="page_size must be a positive integer dividing"):
        tte.export_llm(model, target="tpu", cache_length=96, prefill_lengths=(8,), kv_pages="auto", page_size=10)
    with pytest.raises(InputError, match="kv_pages .* applies to target='tpu'"):
        tte.export_llm(model, target="litert", cache_length=96, prefill_lengths=(8,), kv_pages="auto")
    with pytest.raises(InputError, match="prefix_pages sizes the slots' prefix pool"):
        Engine(tte.load(path), prefix_pages=4)
    mamba, tok = hf_llms.moe("lfm2")
    with pytest.raises(InputError, match="recurrent states cannot have a paged cache"):
        tte.export_llm(mamba, tok, target="tpu", cache_length=32, prefill_lengths=(8,), kv_pages="auto")
    bad = run_cli(tmp_path, "--target", "tpu", "--kv-pages", "many", "-o", tmp_path / "x.tpu")
    assert bad.returncode == 2 and "--kv-pages takes an integer or 'auto'" in bad.stderr
    assert "Traceback" not in bad.stderr
    with pytest.raises(InputError, match=r"batch_buckets must be integers from 2 to below batch_size \(4\)"):
        tte.export_llm(model, target="tpu", cache_length=96, prefill_lengths=(8,), batch_size=4, batch_buckets=(2, 4))
    bad = run_cli(tmp_path, "--target", "tpu", "--batch-buckets", "two", "-o", tmp_path / "x.tpu")
    assert bad.returncode == 2 and "--batch-buckets takes comma-separated integers" in bad.stderr


def _kernel_model():
    """A Llama whose decode attention JAX's paged attention kernel takes (head_dim 128, GQA 2:1), in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128, vocab_size=320, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def test_paged_programs_compile_for_tpu_with_the_kernel_where_it_pays():
    """The TPU compiler (libtpu, ahead of time, v5e) accepts the paged decode and prefill steps of a bf16 export
    with the pool updated in place (aliased); decode attention is JAX's paged attention kernel and prefill chunks'
    and a mixed step's blocks are ours (``paged_blocks``), each kept because the program accesses fewer bytes than
    with the gather (both figures recorded). The engine's calls around them (sampling, mixed steps) compile for v5e
    as well, for a server to load."""
    prog = tte.export_llm(_kernel_model(), None, target="tpu", prefill_lengths=(16,), cache_length=128, batch_size=4,
                          kv_pages="auto", quant_config="bf16")
    entries = {(e["program"], e["node"]): e for e in prog.kernels() if e["op"] == "tte.paged_attention.default"
               and e["platform"] == "tpu"}
    decode = [e for (p, _), e in entries.items() if p == "decode_paged"]
    assert len(decode) == 2 and all(e.get("kernel") == "pallas.paged_attention" for e in decode), entries
    blocks = [e for (p, _), e in entries.items() if p in ("prefill_paged_16", "mixed_paged_16_blocks_4")
              and e.get("kernel") == "pallas.paged_blocks"]
    assert len(blocks) == 4, entries  # a prefill chunk per row, and a mixed step's blocks
    for sig in ("decode_paged", "prefill_paged_16", "mixed_paged_16_blocks_4"):
        cost = prog.manifest["programs"][sig]["kernel_cost"]
        assert cost["kept"] == "pallas" and cost["pallas"]["v5e:2x2"] < cost["xla"]["v5e:2x2"], (sig, cost)
        # each paged kernel was also left out in turn, and stayed because the program accessed more without it
        kept = {e["kernel"].removeprefix("pallas.") for e in prog.manifest["programs"][sig]["kernels"]
                if e.get("kernel", "").startswith("pallas.paged")}
        assert all(cost["without"][k]["v5e:2x2"] > cost["pallas"]["v5e:2x2"] for k in kept), (sig, cost)
    # a kind left out where the program accessed fewer bytes without it says so, with both figures
    left = [e for e in prog.kernels() if "the program without pallas." in e.get("reason", "")]
    assert left and all(re.search(r"accesses [\d.]+ MB on v5e:2x2, with [\d.]+ MB", e["reason"]) for e in left), left
    pools = [s for s in prog.inputs("decode_paged") if s.name.startswith("kv_cache_")]
    pool = sum(int(np.prod(s.shape)) * 2 for s in pools)
    # the compiler cannot see inside the kernel: its reads (every page of every row's table) are added to the
    # figures, so a layer's keys and values (the pool less page 0) are not counted as free
    pages = pools[0].shape[1]
    assert all(e["cost"]["bytes_accessed"] >= pool / len(decode) * (pages - 1) / pages for e in decode), decode
    for sig in ("decode_paged", "prefill_paged_16"):
        stats = prog.compiled_stats("v5e:1x1", sig)
        assert stats["fits"] and stats["hbm_bytes"]["aliased"] >= pool, (sig, stats)
        assert stats.get("kernel_estimates", 0) == 2, (sig, stats)
    # every call of the server's engine (steps with sampling, mixed steps, row and pool work) compiles for v5e too
    engine = compile_engine(prog, "v5e:1x1")
    assert engine["server"] == "PagedEngine" and engine["device_kind"] == "TPU v5 lite" and engine["libtpu"]
    assert {"decode_paged.top0", "decode_paged.top20", "prefill_paged_16", "mixed_paged_16.top0",
            "mixed_paged_16.top20", "decode_paged_1.top0", "decode_paged_1.top20", "set_row.4",
            "pages_zeros", "prefill_paged_16_rows_1", "mixed_paged_16_rows_1.top0", "get_row.4",
            "mixed_paged_16_rows_1.top20", "mixed_paged_16_blocks_4.top0",
            "mixed_paged_16_blocks_4.top20"} == set(engine["calls"])
    assert all(c["bytes"] > 0 for c in engine["calls"].values())


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "mixed-blocks"])
def test_paged_kernels_in_interpret_mode_agree_with_the_gather(mixed):
    """The tpu lowering of a bf16 paged step (in Pallas interpret mode on this CPU) against the cpu lowering (the
    pages gathered) and torch, rows at positions 0 to 127 of scattered pages: the same logits within bf16's
    precision and the same top-1 tokens. A decode step's attention is JAX's paged attention kernel, and its first
    layer's cache writes are the same bits. A packed mixed step's blocks of prompt tokens (two blocks of 16, at
    positions 40 and 0 of their own rows) are our ``paged_blocks`` kernel, its decode lanes JAX's: the second
    layer's cache writes (which read the first layer's attention of every token) agree within bf16's precision."""
    import jax
    import torch.utils._pytree as pytree

    from torchtpu_export.capture import capture
    from torchtpu_export.converters import stablehlo
    from torchtpu_export.converters.stablehlo import pallas
    from torchtpu_export.llm.contract import mixed_inputs, paged_inputs
    from torchtpu_export.llm.step import CacheStep, grouped_attention_in, probe_layout
    from torchtpu_export.safetensors_io import to_numpy
    model = _kernel_model().to(torch.bfloat16)
    layout = probe_layout(model, 128, "bfloat16")
    g = torch.Generator().manual_seed(1)
    lanes = dict(tokens=torch.tensor([[5], [17], [200], [3]], dtype=torch.int32),
                 input_pos=torch.tensor([0, 17, 60, 127], dtype=torch.int32))
    if mixed:
        step = CacheStep(model, layout, logits=True, slots=True, lanes=4)
        feed = mixed_inputs(layout, 4, 32, 49, 16, chunks=2)
        feed.update(tokens=torch.cat([lanes["tokens"].T, torch.randint(3, 300, (1, 32), generator=g)], 1).int(),
                    input_pos=torch.cat([lanes["input_pos"], torch.arange(40, 56), torch.arange(16)]).int(),
                    page_table=(torch.randperm(48, generator=g) + 1).reshape(6, 8).to(torch.int32))
    else:
        step = CacheStep(model, layout, logits=True, slots=True)
        feed = paged_inputs(layout, 4, 1, 33, 16)
        feed.update(lanes, page_table=(torch.randperm(32, generator=g) + 1).reshape(4, 8).to(torch.int32))
    for k in feed:
        if k.startswith("kv_cache"):
            feed[k] = torch.randn(feed[k].shape, generator=g).to(torch.bfloat16)
    with torch.no_grad(), grouped_attention_in(model):
        cap = capture(step, (), feed, keep=stablehlo.KEEP_WHOLE)
        ref = pytree.tree_leaves(step(**{k: v.clone() for k, v in feed.items()}))[0].float().numpy()
    stablehlo.fuse_hot_ops(cap)

    def run(platform):
        ctx = stablehlo.LoweringContext(platform, kernels="auto")
        fn = stablehlo.to_jax_function(cap, ctx)
        weights = {k: to_numpy(v) for k, v in cap.weights.items()}
        with pallas.interpret_mode(), jax.enable_x64(True):
            out = jax.jit(fn)(weights, *[to_numpy(a) for a in cap.flatten_inputs((), feed)])
        return [np.asarray(o, np.float32) for o in out], ctx.kernel_log

    kernel, log = run("tpu")
    used = [e.get("kernel") for e in log if e["op"] == "tte.paged_attention.default"]
    assert used == (["pallas.paged_attention", "pallas.paged_blocks"] if mixed else ["pallas.paged_attention"]) * 2
    xla, _ = run("cpu")
    scale = np.abs(ref).max()
    assert np.abs(kernel[0] - xla[0]).max() / scale < 2e-2 and np.abs(xla[0] - ref).max() / scale < 2e-2
    assert (kernel[0].argmax(-1) == ref.argmax(-1)).all() and (xla[0].argmax(-1) == ref.argmax(-1)).all()
    assert np.array_equal(kernel[1], xla[1]) and np.array_equal(kernel[2], xla[2])  # layer 0's k and v pools
    for a, b in zip(kernel[3:5], xla[3:5]):  # layer 1's: written from layer 0's attention of each token
        assert np.abs(a - b).max() / np.abs(b).max() < 2e-2


def test_serve_batches_concurrent_streams_over_the_pages(llm):
    """`torchtpu-export serve` on a paged export: 8 streaming OpenAI requests at once get transformers'
    greedy tokens."""
    model, path = llm
    tok = hf_llms.build("llama")[1]
    prompts = ["hello world", "the quick brown fox", "a", "tiny language model", "tokens are made locally",
               "one two three", "small corpus of text", "what comes next"]
    server = Server(path)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def stream(prompt):
            s = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0,
                                          stream=True)
            return "".join(c.choices[0].text for c in s)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(stream, prompts))
    finally:
        server.close()
    for prompt, text in zip(prompts, got):
        assert text == tok.decode(greedy(model, tok(prompt)["input_ids"], 12), skip_special_tokens=True), prompt
