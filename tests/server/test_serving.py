"""Serving: the continuous-batching engine over an LLM's exported programs, and `torchtpu-export serve`
(KServe's model server) checked with real clients: the official `openai` client (completions, chat,
streaming) and `tritonclient` (Open Inference Protocol v2 over HTTP) for a `.tpu` and a `.tflite` model."""
import concurrent.futures
import types
import urllib.request

import numpy as np
import pytest
import torch

import hf_llms
import torchtpu_export as tte
import zoo
from torchtpu_export.engine import Engine
from serving_harness import PROMPTS, Server, _compile_events, _free_port, _openai, greedy
from torchtpu_export.errors import InputError

pytestmark = pytest.mark.xdist_group("serving")

@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model, tok = hf_llms.build("llama")
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8, 32), cache_length=96, batch_size=4,
                          batch_buckets=(2,), platforms=("cpu",))
    path = tmp_path_factory.mktemp("serve") / "tiny-llama.tpu"
    prog.save(path)
    return model, tok, prog, path


def test_engine_batches_requests_that_join_and_leave(llm):
    """More requests than slots, prompts longer than a prefill chunk, different lengths: every request's
    greedy tokens equal transformers', and a decode step sends only the slots' token ids to the host."""
    model, tok, prog, _ = llm
    engine = Engine(tte.load(llm[3]))
    assert engine.slots == 4
    lengths = [5, 20, 12, 30, 7, 16]
    requests = [engine.submit(tok(p)["input_ids"], n, stop=[2]) for p, n in zip(PROMPTS, lengths)]
    while engine.busy:
        engine.step()
    for p, n, r in zip(PROMPTS, lengths, requests):
        assert r.result() == greedy(model, tok(p)["input_ids"], n), p
        assert r.finish_reason in ("stop", "length")
    s = engine.stats
    assert s["decode_bytes_to_host"] == s["decode_steps"] * 4 * 4 and s["decode_bytes_to_device"] == 0
    # batching: fewer decode steps than tokens made (slots shared the steps)
    assert s["decode_steps"] < s["tokens"]


def test_a_prompt_prefilled_in_place_is_not_written_by_the_decode_steps_beside_it(llm):
    """Requests arriving a few at a time while others decode: a prompt prefilled in place (prefill_batch,
    over several steps) keeps its cache rows while decode steps run every row of the batch. Its row was
    once left at the last request's position, which every decode step then wrote at and advanced: the long
    prompt's greedy text went wrong after a few tokens in about half of these arrival orders."""
    import random
    model, tok, _, path = llm
    want = {p: greedy(model, tok(p)["input_ids"], 16) for p in PROMPTS}
    for seed in (1, 2, 3):
        rng = random.Random(seed)
        engine = Engine(tte.load(path))
        pending, requests = rng.sample(PROMPTS, len(PROMPTS)), {}
        while pending or engine.busy:
            for _ in range(rng.choice([0, 0, 1, 2, 3])):
                if pending:
                    p = pending.pop(0)
                    requests[p] = engine.submit(tok(p)["input_ids"], 16, stop=[2])
            if engine.busy:
                engine.step()
        assert engine.stats.get("batched_prefill_calls", 0) > 0
        for p, r in requests.items():
            assert r.result() == want[p], (seed, p)


def test_engine_cancel_frees_the_slot_and_bad_requests_raise(llm):
    engine = Engine(tte.load(llm[3]))
    ids = llm[1]("hello world")["input_ids"]
    keep = [engine.submit(ids, 30) for _ in range(4)]
    later = engine.submit(ids, 30)  # waits for a slot
    keep[0].cancel()
    for _ in range(3):
        engine.step()
    assert keep[0].finish_reason == "cancelled" and len(keep[0].tokens) < 30
    assert later.tokens  # it took the freed slot
    never = engine.submit(ids, 30)  # waits, and goes before it gets a slot
    never.cancel()
    later.cancel()
    while engine.busy:
        engine.step()
    assert later.finish_reason == never.finish_reason == "cancelled" and len(later.tokens) < 30 and not never.tokens
    assert all(len(r.result()) == 30 for r in keep[1:])
    with pytest.raises(InputError, match="do not fit the cache"):
        engine.submit(ids, 200)
    with pytest.raises(InputError, match=r"token ids must be in \[0, "):
        engine.submit([10 ** 6], 2)
    with pytest.raises(InputError, match="at least one prompt token"):
        engine.submit([], 2)


def test_the_engine_steps_the_smallest_batch_that_holds_the_load(llm):
    """The engine picks the program by load: a request alone in the batch steps through the one-slot decode,
    two through decode_batch_2 (their rows taken out of the batch's, put back when the load outgrows it),
    three or four through decode_batch; requests joining and leaving move between them, and the tokens are
    transformers'."""
    model, tok, _, path = llm
    engine = Engine(tte.load(path))
    assert sorted(engine._buckets) == [1, 2]
    ids = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    wants = [greedy(model, i, n) for i, n in zip(ids, (10, 14, 20, 6))]
    assert engine.generate(ids[0], 10, stop=[2]) == wants[0]
    assert engine.stats["one_row_steps"] == engine.stats["decode_steps"] > 0
    first = engine.stats["decode_steps"]
    two = [engine.submit(i, 10, stop=[2]) for i in ids[:2]]
    while engine.busy:
        engine.step()
    assert [r.result() for r in two] == [wants[0], wants[1][:10]]
    assert engine.stats["small_batch_steps"] >= 5 and engine.stats["decode_steps"] - first < 20
    # four of different lengths: all four rows, then three, then two and one as they end; a fifth joins late
    requests = [engine.submit(i, n, stop=[2]) for i, n in zip(ids, (10, 14, 20, 6))]
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
        if steps == 16:
            late = engine.submit(ids[3], 6, stop=[2])
    assert [r.result() for r in requests] == wants and late.result() == wants[3]
    small = engine.stats["small_batch_steps"]
    assert engine.stats["decode_steps"] - engine.stats["one_row_steps"] - small >= 5  # the batch stepped them


def test_a_load_at_a_bucket_s_edge_does_not_move_its_rows_each_step():
    """The engine's choice of rows (64 slots, buckets 1, 4, 16): a load that falls to a smaller program moves
    there once the larger steps have read as many extra rows as the move and its way back would read and write
    (four times its rows), so a load going 17, 16, 17, 16, ... stays in the whole batch; a load that stays
    small moves after a step or two, and at once where its rows are not those taken out or nothing decoded
    before it."""
    e = types.SimpleNamespace(_buckets={1: None, 4: None, 16: None}, slots=64, _part=None, _waste=0)

    def pick(n, start=0):
        rows = Engine._rows_for(e, list(range(start, start + n)))
        e._part = None if rows == 64 else [list(range(start, start + n)) + [-1] * (rows - n), None, None]
        return rows
    assert [pick(n) for n in (17, 16, 17, 16, 17, 16, 16, 16)] == [64, 64, 64, 64, 64, 64, 16, 16]
    assert [pick(n) for n in (3, 3, 3, 1, 1)] == [16, 4, 4, 4, 1]  # 12 then 24 >= 16 extra rows; 3 then 6 >= 4
    assert pick(2, start=10) == 4  # rows outside those taken out: taken anew, into the smallest that holds them
    assert [pick(n) for n in (5, 17)] == [16, 64]  # a growing load moves at once
    e._waste = None  # a step with nothing decoding: a new load starts where it fits
    assert pick(1) == 1


# ---- prefix caching ---------------------------------------------------------------------------------

def _prompts(seed, prefix, tails):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 300, prefix).tolist()
    return [system + rng.integers(3, 300, k).tolist() for k in tails]


def test_prefix_cache_hits_give_the_tokens_of_misses(llm):
    """Prompts sharing a 40-token start (two full pages of 16 and a part), one after another and four at once
    (the batch's own prefill, then the pool): with the prefix cache every request gets transformers' greedy
    tokens, the repeats prefill only what follows the cached pages, and a prompt differing in its first token
    matches nothing (the pages are a hash chain from position 0)."""
    model, _, _, path = llm
    prompts = _prompts(1, 40, (3, 9, 17, 1, 30, 6))
    prompts.append([prompts[0][0] + 1] + prompts[0][1:])  # the same tokens after a different first one
    prompts.append(list(prompts[1]))  # a prompt served before, whole
    wants = [greedy(model, p, 12) for p in prompts]
    cold = Engine(tte.load(path), prefix_cache=False)
    assert [cold.generate(p, 12, stop=[2]) for p in prompts] == wants
    engine = Engine(tte.load(path))
    assert engine.page_size == 16 and engine._prefix.pages == 4 * (96 // 16)
    first = engine.generate(prompts[0], 12, stop=[2])
    assert first == wants[0] and engine.stats["prefix_hit_tokens"] == 0 and engine.stats["prefix_pages_stored"] == 2
    together = [engine.submit(p, 12, stop=[2]) for p in prompts[1:5]]
    while engine.busy:
        engine.step()
    assert [r.result() for r in together] == wants[1:5]
    assert engine.stats["prefix_hit_tokens"] == 4 * 32
    for i, (p, want) in enumerate(zip(prompts[5:], wants[5:]), 5):
        before = dict(engine.stats)
        assert engine.generate(p, 12, stop=[2]) == want
        hit = engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        assert engine.stats["prefill_tokens"] - before["prefill_tokens"] == len(p) - 1 - hit
        assert hit == {5: 32, 6: 0, 7: 48}[i]  # 7: all 48 prompt positions before its last token
    assert cold.stats["prefill_tokens"] > engine.stats["prefill_tokens"] + 200


def test_a_small_page_pool_evicts_and_loses_no_request_or_token(llm):
    """Twelve requests of six different 35-token starts, four slots, a pool of 3 pages (one and a half
    prompts' worth): pages are evicted least recently used first, some requests still hit, and every request
    gets the tokens it gets without the cache."""
    model, _, _, path = llm
    prompts = [p for seed in range(6) for p in _prompts(10 + seed, 35, (4, 11))]
    wants = [greedy(model, p, 8) for p in prompts]
    engine = Engine(tte.load(path), prefix_pages=3)
    requests = []
    for i in range(0, len(prompts), 3):  # arrivals in waves, the engine busy in between
        requests += [engine.submit(p, 8, stop=[2]) for p in prompts[i:i + 3]]
        for _ in range(4):
            engine.step()
    while engine.busy:
        engine.step()
    assert [r.result() for r in requests] == wants
    assert engine.stats["prefix_evictions"] > 0 and engine.stats["prefix_hit_tokens"] > 0
    assert len(engine._prefix) <= 3
    with pytest.raises(InputError, match="prefix_pages must be a positive integer"):
        Engine(tte.load(path), prefix_pages=0)
    from conftest import run_cli
    shown = run_cli("inspect", path)
    assert "serving: prefix cache of 24 pages of 16 positions (0.2 MiB" in shown.stdout, shown.stdout
    from torchtpu_export.server import Served
    served = Served(path, prefix_cache=False, text_workers=1)  # serve --no-prefix-cache
    try:
        assert served.engine._prefix is None
    finally:
        served.close()


# ---- the server -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm_server(llm):
    server = Server(llm[3])
    yield server
    server.close()


def test_openai_client_completions_chat_and_streaming(llm, llm_server):
    model, tok, _, _ = llm
    client = _openai(llm_server)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    ids = tok(PROMPTS[0])["input_ids"]
    want = greedy(model, ids, 12)
    done = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert done.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == len(want)
    # the same, streamed
    stream = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason
    # chat: the model's template, then greedy tokens
    messages = [{"role": "user", "content": "hello there"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
    want_chat = tok.decode(greedy(model, list(chat_ids), 10), skip_special_tokens=True)
    reply = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == want_chat and reply.usage.prompt_tokens == len(chat_ids)
    streamed = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    parts = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want_chat
    assert parts[-1].usage.completion_tokens == reply.usage.completion_tokens
    # seeded sampling is repeatable
    a = client.completions.create(model="tiny-llama", prompt="x", max_tokens=8, temperature=1.0, seed=5)
    b = client.completions.create(model="tiny-llama", prompt="x", max_tokens=8, temperature=1.0, seed=5)
    assert a.choices[0].text == b.choices[0].text


def test_sixteen_concurrent_streams_and_bad_requests_beside_them(llm, llm_server):
    """16 streaming requests at once over 4 slots all get their own greedy tokens, while malformed and
    oversized requests get a 4xx and a client that hangs up mid-stream frees its slot."""
    import openai
    model, tok, _, _ = llm
    client = _openai(llm_server)

    def stream(prompt):
        s = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in s)

    def hang_up():
        s = client.completions.create(model="tiny-llama", prompt="hang up", max_tokens=60, temperature=0, stream=True)
        next(iter(s))
        s.close()
        return "closed"

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(stream, p) for p in PROMPTS] + [pool.submit(hang_up)]
        with pytest.raises(openai.BadRequestError, match="do not fit the cache"):
            client.completions.create(model="tiny-llama", prompt="hello", max_tokens=500)
        req = urllib.request.Request(llm_server.url + "/v1/completions", data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400 and b"not valid JSON" in e.value.read()
        with pytest.raises(openai.BadRequestError, match="prompt must be"):
            client.completions.create(model="tiny-llama", prompt=[1.5], max_tokens=4)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=4)
        got = [f.result(timeout=300) for f in futures]
    for prompt, text in zip(PROMPTS, got):
        assert text == tok.decode(greedy(model, tok(prompt)["input_ids"], 16), skip_special_tokens=True), prompt
    assert got[-1] == "closed"
    # still serving
    assert client.completions.create(model="tiny-llama", prompt="a", max_tokens=2, temperature=0).choices


def test_v2_generate_on_the_llm(llm, llm_server):
    import tritonclient.http as httpclient
    model, tok, _, _ = llm
    client = httpclient.InferenceServerClient(llm_server.url.removeprefix("http://"))
    assert client.is_server_ready() and client.is_model_ready("tiny-llama")
    ids = np.array(tok(PROMPTS[3])["input_ids"], np.int32)
    inp = httpclient.InferInput("input_ids", list(ids.shape), "INT32")
    inp.set_data_from_numpy(ids, binary_data=False)
    n = httpclient.InferInput("max_new_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([9], np.int32), binary_data=False)
    out = client.infer("tiny-llama", [inp, n]).as_numpy("output_ids")
    assert out.tolist() == greedy(model, ids.tolist(), 9)


@pytest.fixture(scope="module")
def image_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-img")
    model, args = zoo.small_cnn()
    model.eval()
    tte.export(model, args, target="tpu", platforms=("cpu",)).save(folder / "cnn.tpu")
    tte.convert(model, args).export(folder / "cnn.tflite")
    with torch.no_grad():
        want = model(*args).numpy()
    return folder, args[0].numpy(), want


@pytest.mark.parametrize("suffix", ["tpu", "tflite"])
def test_tritonclient_v2_on_an_image_model(image_models, suffix):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    folder, x, want = image_models
    server = Server(folder / f"cnn.{suffix}", "--name", "cnn")
    try:
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
        assert client.is_server_ready() and client.is_model_ready("cnn")
        meta = client.get_model_metadata("cnn")
        (spec,) = meta["inputs"]
        assert spec["datatype"] == "FP32" and spec["shape"] == list(x.shape)
        for binary in (False, True):
            inp = httpclient.InferInput(spec["name"], list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("cnn", [inp])
            got = result.as_numpy(meta["outputs"][0]["name"])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        bad = httpclient.InferInput(spec["name"], [1, 2], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 2), np.float32), binary_data=False)
        with pytest.raises(InferenceServerException, match="must have shape"):
            client.infer("cnn", [bad])
        wrong = httpclient.InferInput(spec["name"], list(x.shape), "INT32")
        wrong.set_data_from_numpy(np.zeros(x.shape, np.int32), binary_data=False)
        with pytest.raises(InferenceServerException, match="must be FP32"):
            client.infer("cnn", [wrong])
        assert client.infer("cnn", [inp]).as_numpy(meta["outputs"][0]["name"]).shape == want.shape
    finally:
        server.close()


def test_serve_refuses_a_missing_file_and_a_bad_port(cli, tmp_path):
    r = cli("serve", tmp_path / "nope.tpu")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", tmp_path / "nope.tpu", "--port", "70000")
    assert r.returncode == 2 and "--port" in r.stderr
    r = cli("serve", tmp_path / "nope.tpu", "--distributed", "--coordinator", "127.0.0.1:1")
    assert r.returncode == 2 and "go together" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", tmp_path / "nope.tpu", "--distributed", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
            "--process-id", "2")
    assert r.returncode == 2 and "--process-id must be from 0 to 1" in r.stderr


def _traffic(engine, prompts, n):
    """Requests that reach every kind of engine call: one alone, several at once (logprobs, two choices,
    a prefix the pool holds), a cancel; their results."""
    first = engine.generate(prompts[0], n, stop=[2])
    requests = [engine.submit(p, n, stop=[2], **({"logprobs": 2} if i % 2 else {})) for i, p in enumerate(prompts)]
    requests += list(engine.submit_many(prompts[1], 2, 4, temperature=0.8, seed=1))
    gone = engine.submit(prompts[2], n)
    engine.step()
    gone.cancel()
    while engine.busy:
        engine.step()
    return [first] + [r.result() for r in requests[:len(prompts)]]


def test_a_server_compiles_nothing_once_started_and_loads_stored_executables(llm, cli, tmp_path):
    """Zero compilation at serve time, checked with JAX's compile logging. `compile --topology cpu` stores
    the engine's calls for this host: an engine over that file compiles nothing at all (construction, warm,
    then every kind of request), with transformers' tokens. Without stored executables `warm` compiles every
    call before serving, and serving compiles nothing. A file whose stored executables are for another jax
    is refused by `serve` with one message rather than compiled behind; other files cannot take cpu."""
    model, _, _, path = llm
    prompts = _prompts(5, 40, (1, 9, 30))
    wants = [greedy(model, p, 10) for p in [prompts[0], *prompts]]
    stored = tmp_path / "stored.tpu"
    r = cli("compile", path, "--topology", "cpu", "-o", stored)
    assert r.returncode == 0, r.stderr
    assert "cpu serving engine (Engine): 22 calls stored" in r.stdout and "starts without compiling" in r.stdout
    assert "serving engine [cpu, cpu, jax" in cli("inspect", stored).stdout
    events = _compile_events()
    engine = Engine(tte.load(stored, trust_stored_executables=True))
    engine.warm()
    assert engine.stats["stored_executables"] == 22
    assert _traffic(engine, prompts, 10) == wants and events == [], events
    assert engine.stats["prefix_hit_tokens"] > 0 and engine.stats.get("one_row_steps", 0) > 0
    plain = Engine(tte.load(path))
    plain.warm()
    assert plain.stats["stored_executables"] == 0 and plain.stats["warm_seconds"] > 0
    events.clear()
    assert _traffic(plain, prompts, 10) == wants and events == [], events
    prog = tte.load(stored)
    prog.manifest["llm"]["engine"]["cpu"]["jax"] = "0.0.1"
    prog.save(tmp_path / "old.tpu")
    r = cli("serve", tmp_path / "old.tpu", "--port", str(_free_port()), "--trust-stored-executables")
    assert r.returncode == 5 and "stored engine executables cannot run here" in r.stderr, r.stderr
    assert "compiled by jax 0.0.1" in r.stderr and "Traceback" not in r.stderr
    r = cli("compile", path, "--topology", "cpu", "--signature", "decode_batch", "-o", tmp_path / "one.tpu")
    assert r.returncode == 2 and "the cpu topology compiles an LLM's serving engine" in r.stderr


def test_a_file_whose_special_ids_its_vocabulary_lacks_is_refused_before_compiling(llm, tmp_path, monkeypatch):
    """serve (and generate) refuse a file naming a stop token past the model's vocabulary, with the file's
    path, before the engine's calls are compiled (warm)."""
    from torchtpu_export.engine.scheduler import Engine as SlotEngine
    from torchtpu_export.server.app import Served
    prog = tte.load(llm[3])
    vocab = llm[0].config.vocab_size
    prog.manifest["llm"]["stop_ids"] = [vocab + 7]
    bad = tmp_path / "bad-stop.tpu"
    prog.save(bad)

    def warm(self):
        raise AssertionError("compiled before the refusal")
    monkeypatch.setattr(SlotEngine, "warm", warm)
    with pytest.raises(tte.ArtifactError, match=rf"bad-stop.tpu: its special token ids \[{vocab + 7}, .*\] are not "
                                                rf"all below the model's vocabulary of {vocab}"):
        Served(str(bad), warm=True)
    with pytest.raises(tte.ArtifactError, match="not all below"):
        tte.load(bad).generate([1, 2, 3], 2)
