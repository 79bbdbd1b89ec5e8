"""Hostile requests and served files against `torchtpu-export serve`, as the round-4 review reported them:
the model-repository routes that let anyone unload the model, one request's sampling values failing
everyone's step, cross-site and DNS-rebinding requests, prompts and message lists that stalled the event
loop and grew the server, chat templates in the file that loop for ever or build gigabyte strings, and
a hostile tokenizer. Each request gets a 4xx with one message while another client's request runs
beside it and completes with transformers' tokens; the server stays responsive and bounded."""
import concurrent.futures
import hashlib
import json
import signal
import socket
import threading
import time
import types
import urllib.error
import urllib.request
import zipfile

import pytest

import hf_llms
import torchtpu_export as tte
from conftest import run_cli
from serving_harness import PROMPTS, Server, greedy
from torchtpu_export.engine import Engine, SamplingParams
from torchtpu_export.errors import InputError

pytestmark = pytest.mark.xdist_group("hostile_server")

# a template that behaves by the first message: loops for ever, builds huge strings two ways, or renders
# ChatML as the model's own template does
HOSTILE_TEMPLATE = (
    "{% if messages[0]['content'] == 'loop' %}{% for a in range(99999) %}{% for b in range(99999) %}"
    "{% endfor %}{% endfor %}"
    "{% elif messages[0]['content'] == 'multiply' %}{{ 'x' * 1500000000 }}"
    "{% elif messages[0]['content'] == 'double' %}{% set ns = namespace(s='x') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    "{% else %}" + hf_llms.CHAT_TEMPLATE + "{% endif %}")


def _rewrite(src, dst, template=None, tokenizer: bytes | None = None):
    """``src`` with another chat template or tokenizer (the tokenizer's digest updated): a hostile file
    that passes every check of the .tpu reader."""
    with zipfile.ZipFile(src) as zin:
        entries = {i.filename: zin.read(i.filename) for i in zin.infolist()}
        infos = zin.infolist()
    manifest = json.loads(entries["manifest.json"])
    if template is not None:
        manifest["llm"]["chat_template"] = template
    if tokenizer is not None:
        entries["llm/tokenizer.json"] = tokenizer
        manifest["digests"]["llm/tokenizer.json"] = hashlib.sha256(tokenizer).hexdigest()
    entries["manifest.json"] = json.dumps(manifest).encode()
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in infos:
            zout.writestr(info, entries[info.filename])
    return dst


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model, tok = hf_llms.build("llama")
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8, 32), cache_length=96, batch_size=4,
                          platforms=("cpu",))
    d = tmp_path_factory.mktemp("hostile_server")
    good = d / "tiny.tpu"
    prog.save(good)
    return types.SimpleNamespace(model=model, tok=tok, good=good, dir=d,
                                 hostile=_rewrite(good, d / "hostile.tpu", template=HOSTILE_TEMPLATE))


@pytest.fixture(scope="module")
def server(llm):
    s = Server(llm.good)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hostile_server(llm):
    s = Server(llm.hostile, "--text-timeout", "2", "--allow-origin", "https://app.example")
    yield s
    s.close()


def _post(url, body, headers=None, timeout=60):
    """(status, parsed JSON or text, headers) of a POST; ``body`` a dict (JSON) or bytes as they are. A body
    over 1 MB is announced first: the server answers 413 from its declared length without reading it
    (and closes the connection, so a client that sends it all first sees a broken pipe)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    if len(data) > 1 << 20:
        host, port = url.split("//")[1].split("/")[0].split(":")
        path = "/" + url.split("//")[1].split("/", 1)[1]
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode() + data[:1 << 16])
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < int(
                    reply.lower().split(b"content-length:")[1].split(b"\r\n")[0]):
                chunk = s.recv(1 << 16)
                assert chunk, reply
                reply += chunk
        head, _, rest = reply.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(rest), {}
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    return _answer(req, timeout)


def _get(url, headers=None, timeout=60):
    return _answer(urllib.request.Request(url, headers=headers or {}), timeout)


def _answer(req, timeout):
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, headers = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, headers = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(errors="replace"), headers


def _message(answer) -> str:
    body = answer[1]
    err = body.get("error") if isinstance(body, dict) else body
    return err.get("message", "") if isinstance(err, dict) else str(err)


def _tree_rss_mb(pid) -> dict:
    """Resident MB of the server and of each of its text workers (psutil), and each worker's peak (VmHWM)."""
    import psutil
    proc = psutil.Process(pid)
    peaks = []
    for child in proc.children():
        with open(f"/proc/{child.pid}/status") as f:
            peaks += [int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM")]
    return {"server": proc.memory_info().rss / 2 ** 20, "worker_peaks": peaks}


# ---- 1: the routes -------------------------------------------------------------------------------

def test_nobody_can_unload_the_model_and_only_the_served_routes_answer(llm, server):
    status, body, _ = _post(server.url + "/v2/repository/models/tiny/unload", {})
    assert status == 404 and "no route" in body["error"]
    for path in ("/v2/repository/index", "/openapi.json", "/docs", "/v1/models/tiny:predict", "/"):
        assert _get(server.url + path)[0] == 404, path
    assert _get(server.url + "/v1/completions")[0] == 405
    assert _get(server.url + "/v2/health/ready")[:2] == (200, {"ready": True})
    assert _get(server.url + "/v2/health/live")[:2] == (200, {"live": True})
    assert _get(server.url + "/v2/models/tiny/ready")[0] == 200
    status, body, _ = _post(server.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_readiness_says_when_the_engine_has_stopped(llm):
    """In process: ready while the model is loaded and its engine runs, 503 once the engine stops."""
    from torchtpu_export import server as srv
    served = srv.Served(str(llm.good), text_workers=1)
    try:
        assert not served.ready()  # not registered yet
        (model,) = served.app_models(srv.import_kserve())
        model.start()
        assert served.ready() and served.live()
        served.engine.stop()
        assert not served.ready() and not served.live()
    finally:
        served.close()


# ---- 2: one request's values never fail the others -----------------------------------------------

HOSTILE_BODIES = [
    {"prompt": "hello", "max_tokens": 3, "top_k": 2 ** 40, "temperature": 1.0},  # more than the vocabulary: all
    {"prompt": "hello", "max_tokens": 10 ** 30},
    {"prompt": "hello", "max_tokens": 3, "seed": 2 ** 70},
    {"prompt": "hello", "max_tokens": 3, "top_k": -5},
    {"prompt": "hello", "max_tokens": 3, "top_p": 0},
    {"prompt": "hello", "max_tokens": 3, "temperature": 1e308},
    {"prompt": "hello", "max_tokens": 3, "n": 10 ** 6},
    {"prompt": "hello", "max_tokens": 3, "stop": ["a"] * 10},
    {"prompt": "hello", "max_tokens": 3, "stream": "yes"},
    {"prompt": [10 ** 12], "max_tokens": 3},
    {"prompt": [1] * 100_000, "max_tokens": 3},
    {"prompt": "x" * 8_000_000, "max_tokens": 3},
    {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 3},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], "max_tokens": 3},
    {"messages": [{"role": "user", "content": "x" * 400_000}], "max_tokens": 3},
]
RAW_BODIES = [b'{"prompt": "hello", "temperature": NaN}', b'{"prompt": "hello", "max_tokens": ' + b"9" * 5000 + b"}",
              b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "hello"', b"\xff\xfe"]


def test_hostile_values_get_4xx_while_another_users_stream_completes(llm, server):
    import openai
    ids = llm.tok(PROMPTS[1])["input_ids"]
    want = greedy(llm.model, ids, 40)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # the engine's programs compiled and the text workers warm before the server's size is taken
    client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=8)
    got = []

    def stream():
        for chunk in client.completions.create(model="tiny", prompt=ids, max_tokens=40, temperature=0, stream=True):
            got.append(chunk)
    before = _tree_rss_mb(server.proc.pid)["server"]
    t = threading.Thread(target=stream)
    t.start()
    health = []
    for body in HOSTILE_BODIES + RAW_BODIES:
        status, answer, _ = _post(server.url + "/v1/" + ("chat/completions" if isinstance(body, dict) and
                                                         "messages" in body else "completions"), body)
        t0 = time.perf_counter()
        assert _get(server.url + "/v2/health/ready")[0] == 200
        health.append(time.perf_counter() - t0)
        if isinstance(body, dict) and body.get("top_k") == 2 ** 40:
            assert status == 200, answer  # top-k past the vocabulary is all of it
        else:
            assert 400 <= status < 500 and _message((status, answer)), (str(body)[:80], status, answer)
    t.join(300)
    text = "".join(c.choices[0].text for c in got)
    assert text == llm.tok.decode(want, skip_special_tokens=True)
    assert max(health) < 2.0, health
    grew = _tree_rss_mb(server.proc.pid)["server"] - before
    print(f"the server grew by {grew:.0f} MB")
    assert grew < 100, f"the server grew by {grew:.0f} MB"


def test_a_failed_prefill_ends_that_request_only(llm, monkeypatch):
    """In process: the engine's per-request work (a prefill, the insert into the batch) failing for one
    request fails that request, and the others give transformers' tokens."""
    engine = Engine(tte.load(llm.good))
    calls = []

    def flaky(real):  # the second request's insert into the batch fails (either way of inserting)
        def call(*args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return real(*args)
        return call
    monkeypatch.setattr(engine, "_insert", flaky(engine._insert))
    monkeypatch.setattr(engine, "_set_row", flaky(engine._set_row))
    prompts = [llm.tok(p)["input_ids"] for p in PROMPTS[:3]]
    requests = [engine.submit(ids, 12, stop=[2]) for ids in prompts]
    while engine.busy:
        engine.step()
    assert [r.finish_reason == "error" for r in requests] == [False, True, False]
    for ids, r in zip(prompts, requests):
        if r.finish_reason != "error":
            assert r.result() == greedy(llm.model, ids, 12)
    with pytest.raises(RuntimeError, match="injected"):
        requests[1].result()


@pytest.mark.parametrize("params", [dict(top_k=2 ** 31), dict(top_k=0), dict(seed=2 ** 64), dict(seed=-1),
                                    dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_p=float("nan")), dict(max_new_tokens=True)])
def test_sampling_values_the_device_cannot_take_are_refused(params):
    with pytest.raises(InputError):
        SamplingParams(**{"max_new_tokens": 4, **params}).check(4, 96)


# ---- 9: cross-site requests ---------------------------------------------------------------------

def test_cross_site_and_rebinding_requests_are_refused(server):
    url = server.url + "/v1/completions"
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    status, answer, _ = _post(url, body, {"Content-Type": "text/plain"})  # a form or fetch() without preflight
    assert status == 415 and "application/json" in answer["error"]
    status, answer, _ = _post(url, body, {"Origin": "https://evil.example"})
    assert status == 403 and "--allow-origin" in answer["error"]
    assert _get(server.url + "/v2/health/ready", {"Origin": "https://evil.example"})[0] == 403
    status, answer, _ = _get(server.url + "/v2/health/ready", {"Host": "evil.example:80"})  # DNS rebinding
    assert status == 421
    # no content type (a browser's no-cors Blob also has an Origin, refused above): JSON on v2 only
    req = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST")
    req.remove_header("Content-type")
    assert _answer(req, 60)[0] == 415
    with socket.create_connection(("127.0.0.1", server.port)) as s:  # a declared length past the limit
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999\r\n\r\n{")
        assert b" 413 " in s.recv(1024).split(b"\r\n")[0]


def test_allowed_origins_get_cors(hostile_server):
    url = hostile_server.url + "/v1/chat/completions"
    req = urllib.request.Request(url, method="OPTIONS", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    status, _, headers = _answer(req, 30)
    assert status == 204 and headers["access-control-allow-origin"] == "https://app.example"
    status, body, headers = _post(url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
                                  {"Origin": "https://app.example"})
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example", body
    assert _post(url, {"messages": []}, {"Origin": "https://other.example"})[0] == 403


# ---- 5, 10: templates that loop or build huge strings ------------------------------------------

def test_a_looping_template_fails_its_request_alone_and_the_server_answers(llm, hostile_server):
    url = hostile_server.url + "/v1/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        t0 = time.perf_counter()
        looping = pool.submit(_post, url, {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 2})
        time.sleep(0.3)
        health = []
        while not looping.done():
            t1 = time.perf_counter()
            assert _get(hostile_server.url + "/v2/health/ready", timeout=5)[0] == 200
            health.append(time.perf_counter() - t1)
            time.sleep(0.2)
        other = _post(url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
        status, body, _ = looping.result()
    assert status == 400 and "took longer than 2 s" in body["error"]["message"], body
    assert time.perf_counter() - t0 < 30 and max(health) < 1.0, health
    assert other[0] == 200 and other[1]["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("how", ["multiply", "double"])
def test_a_template_building_a_huge_string_is_refused_in_bounded_memory(llm, hostile_server, how):
    url = hostile_server.url + "/v1/chat/completions"
    status, body, _ = _post(url, {"messages": [{"role": "user", "content": how}], "max_tokens": 2})
    assert status == 400 and "chat template" in body["error"]["message"], body
    mem = _tree_rss_mb(hostile_server.proc.pid)
    bound = 300 + 4 * llm.hostile.stat().st_size / 2 ** 20
    assert max(mem["worker_peaks"]) < bound, mem
    assert _post(url, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})[0] == 200


def test_sigterm_ends_the_server_while_a_template_loops(llm, hostile_server):
    """The last test of the module: it stops the hostile server."""
    url = hostile_server.url + "/v1/chat/completions"
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.submit(_post, url, {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 2})
    time.sleep(0.5)
    t0 = time.perf_counter()
    hostile_server.proc.send_signal(signal.SIGTERM)
    hostile_server.proc.wait(30)
    assert time.perf_counter() - t0 < 30
    pool.shutdown(wait=False)


# ---- 11: a hostile tokenizer in a served file ------------------------------------------------

def _bpe(vocab: dict, merges: list) -> bytes:
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
                       "model": {"type": "BPE", "vocab": vocab, "merges": merges}}).encode()


@pytest.mark.parametrize("tokenizer", [
    b"{not json", b"[" * 5000 + b"]" * 5000, _bpe({"a": 0, "b": 1}, ["a b", "x y"]),
    json.dumps({"model": {"type": "WordPiece", "vocab": {}}}).encode(), b"\x00" * 64,
    _bpe({"a": 0}, []).replace(b'"pre_tokenizer": null', b'"pre_tokenizer": {"type": "Split", "pattern": '
                                                            b'{"Regex": "(a+)+$"}, "behavior": "Isolated"}')])
def test_a_hostile_tokenizer_is_refused_at_start_or_fails_its_requests_alone(tokenizer):
    """The served file's tokenizer either does not load (serve exits 5 before it listens) or every
    operation on it returns or fails with a message: never a crash of the server."""
    import asyncio
    from torchtpu_export.errors import ArtifactError
    from torchtpu_export.llm.textproc import TextError, TextWorkers
    try:
        text = TextWorkers(tokenizer, template=hf_llms.CHAT_TEMPLATE, bos_id=None, eos_id=None, max_chars=4096,
                           workers=1, time_budget=2)
    except ArtifactError as e:
        assert "tokenizer" in str(e)
        return

    async def use():
        outcomes = []
        for op in (text.encode("a" * 40 + "b"), text.chat([{"role": "user", "content": "aaa"}]),
                   text.decode([0, 1, 5], 1)):
            try:
                outcomes.append(await op)
            except TextError as e:
                outcomes.append(str(e))
        return outcomes
    try:
        assert len(asyncio.run(use())) == 3
    finally:
        text.close()


def test_serve_refuses_a_file_whose_tokenizer_does_not_load(llm):
    path = _rewrite(llm.good, llm.dir / "badtok.tpu", tokenizer=b"{not json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("serve", path, "--port", port, timeout=300)
    assert r.returncode == 5 and "tokenizer" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr


def test_a_failed_decode_batch_fails_only_the_request_whose_tokens_cause_it():
    """The detokenizing windows of all streams go to a worker in one message per step; when that message
    fails, each window is decoded alone, and only the failing one's request gets the error."""
    import asyncio
    from torchtpu_export.llm.textproc import TextError, TextWorkers
    text = TextWorkers.__new__(TextWorkers)  # the batching alone: no worker processes
    text._decodes, text._flusher = [], None

    async def call(op, *args):
        if op == "decode_many":
            if any(666 in ids for ids, _ in args[0]):
                raise TextError("the model's tokenizer failed on this request")
            return [[str(ids[:split]), str(ids)] for ids, split in args[0]]
        ids, split = args
        if 666 in ids:
            raise TextError("the model's tokenizer failed on this request")
        return [str(ids[:split]), str(ids)]
    text.call = call

    async def streams():
        return await asyncio.gather(text.decode([1, 2], 1), text.decode([666], 0), text.decode([3], 0),
                                    return_exceptions=True)
    first, failed, last = asyncio.run(streams())
    assert first == ("[1]", "[1, 2]") and last == ("[]", "[3]")
    assert isinstance(failed, TextError)
