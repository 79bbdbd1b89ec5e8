"""Models in the browser: LiteRT.js in headless Chromium against Python LiteRT (issue 7).

One server and one browser serve the whole module (xdist group "web"). The browser has WebGPU on
SwiftShader, Chromium's software Vulkan (driver.mjs --webgpu swiftshader), so the page's default,
'auto', runs models on LiteRT.js's WebGPU accelerator; tests that name an accelerator ("webgpu",
"wasm") check that the page used that one, and one test launches a browser without WebGPU to see
'auto' fall back to WASM and say why. Models come from two sources: small flatbuffer fixtures
(tests/helpers/web_fixtures.py) and zoo models converted with ``tte.convert``; the latter fail with a clear
message while the LiteRT converter is missing. Outputs must match the Python interpreter within
TOL of the output's scale on either accelerator (integers exactly).
"""
from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import web_fixtures as fx
from web_browser import (Browser, BrowserError, compiled_model_outputs, decode, interpreter_outputs, max_error,
                         require_web_deps)

pytestmark = pytest.mark.xdist_group("web")

# Measured (Chromium 156, LiteRT.js 2.5.3, SwiftShader): the largest error against the interpreter,
# relative to the output's scale, is 4.2e-7 on WebGPU (bert_encoder; mobilenet_v2 2.4e-7, llama decode
# 2.3e-7, small_cnn 8.9e-8, the MLP fixture 9.1e-8) and 3.6e-7 on WASM (bert_encoder). SwiftShader has no
# shader-f16, so LiteRT.js's WebGPU delegate computes in fp32 there; one bound serves both paths with
# a margin of 20x. (A GPU with shader-f16 may compute in fp16: not measured, and not what CI runs.)
TOL = 1e-5
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


@pytest.fixture(scope="module")
def server():
    require_web_deps()
    from torchtpu_export.targets.litert import web
    srv = web.start_server({"mlp.tflite": fx.mlp_model()}, port=0)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def browser(server):
    b = Browser(server.url)
    yield b
    b.close()


def assert_matches(got: dict, ref: dict, what: str) -> dict[str, float]:
    assert set(got) == set(ref), f"{what}: outputs {sorted(got)} != reference {sorted(ref)}"
    errors = {}
    for name, r in ref.items():
        g = got[name]
        assert g.dtype == r.dtype and g.shape == r.shape, \
            f"{what}: {name} is {g.dtype}{list(g.shape)}, the interpreter gives {r.dtype}{list(r.shape)}"
        if r.dtype.kind in "iub":
            np.testing.assert_array_equal(g, r, err_msg=f"{what}: {name}")
        errors[name] = max_error(g, r)
        assert errors[name] <= TOL, f"{what}: {name} differs by {errors[name]:.3g} (relative to its scale) > {TOL}"
    return errors


def check_accelerator(acc: dict, expected: str, what: str) -> None:
    """The page ran on ``expected`` ("webgpu", "wasm"), not a fallback, and said so."""
    assert acc["used"] == expected, f"{what}: asked for {expected}, the page ran it on {acc['used']}: {acc['text']}"
    assert acc["text"].startswith({"webgpu": "WebGPU on google swiftshader", "wasm": "WASM ("}[expected]), acc["text"]
    if expected == "webgpu" and not acc["fullyAccelerated"]:  # split: the page names the ops left to WASM
        assert acc["cpuOps"] and acc["cpuOpsSummary"] in acc["text"], acc


def check_in_browser(server, browser, name: str, model: bytes, inputs: dict[str, np.ndarray], repeats: int = 3,
                     accelerator: str | None = None, reference: dict | None = None):
    """Serves ``model``, runs it in the page (on ``accelerator``, default the page's auto) and in Python
    (interpreter, CompiledModel); all must agree. Returns (outputs, the page's accelerator report)."""
    url = server.add_model(name, model)
    got, timings = browser.run(url, inputs, repeats=repeats, accelerator=accelerator)
    acc = timings["accelerator"]
    if accelerator is not None:
        check_accelerator(acc, accelerator, name)
    ref = reference if reference is not None else interpreter_outputs(model, inputs)
    errors = assert_matches(got, ref, f"{name} in LiteRT.js on {acc['used']}")
    if reference is None:
        assert_matches(compiled_model_outputs(model, inputs), ref, f"{name} through CompiledModel")
    print(f"{name} on {acc['text']}: max error {max(errors.values()):.2g}; compile {timings['compileMs']:.1f} ms, "
          f"first run {timings['firstRunMs']:.2f} ms, median of {timings['runs']} runs {timings['medianRunMs']:.2f} ms")
    return got, acc


# ---- fixtures: the harness itself ------------------------------------------------------------

@pytest.mark.parametrize("accelerator", ["webgpu", "wasm"])
def test_float_model_matches_interpreter(server, browser, accelerator):
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    _, acc = check_in_browser(server, browser, "fixture_mlp.tflite", fx.mlp_model(), {"x": x}, accelerator=accelerator)
    assert acc["requested"] == accelerator and acc["fullyAccelerated"] and acc["note"] is None, acc


def test_int32_inputs_and_outputs_match_interpreter(server, browser):
    tokens = np.random.default_rng(1).integers(0, 16, (1, 6)).astype(np.int32)
    got, acc = check_in_browser(server, browser, "fixture_embedding.tflite", fx.embedding_model(), {"tokens": tokens})
    np.testing.assert_array_equal(got["output_1"], tokens + 1)
    # auto on WebGPU: its delegate takes the int32 ADD, not this GATHER, which LiteRT.js runs on WASM
    # in the same model (the page loads LiteRT.js's JSPI build, the one that can split a model)
    check_accelerator(acc, "webgpu", "embedding")
    assert not acc["fullyAccelerated"] and acc["build"] == "jspi", acc
    assert "GATHER: Only support 1D indices" in acc["text"], acc["text"]


def test_uint8_io_runs_in_browser(server, browser):
    x = np.array([[0, 1, 2], [127, 254, 255]], np.uint8)
    got, acc = check_in_browser(server, browser, "fixture_u8.tflite", fx.cast_model(np.uint8, np.float32), {"x": x})
    np.testing.assert_array_equal(got["output_0"], x.astype(np.float32))
    check_accelerator(acc, "webgpu", "uint8 cast")


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.float16])
def test_dtypes_litertjs_cannot_hold_are_refused_with_a_hint(server, browser, dtype):
    from torchtpu_export import InputError
    model = fx.cast_model(dtype, np.float32)
    name = f"fixture_in_{np.dtype(dtype).name}.tflite"
    with pytest.raises(InputError, match="LiteRT.js tensors are float32, int32, uint8") as e:
        server.add_model(name, model)
    assert 'io_dtypes="web"' in e.value.user_message()
    # served anyway, the page says the same thing instead of failing somewhere inside LiteRT.js
    url = server.add_model(name, model, check_dtypes=False)
    with pytest.raises(BrowserError, match=r"is not supported.*io_dtypes=\"web\""):
        browser.call("load", url)


def test_runner_page_shows_outputs_and_timings(browser):
    shown = browser.call("clickRun", {"repeats": 3})
    assert not shown["error"], shown["status"]
    # the page's default, auto, found WebGPU (SwiftShader) and says so
    assert shown["status"].endswith("inputs (WebGPU on google swiftshader)"), shown["status"]
    assert shown["modelInfo"].endswith("on WebGPU on google swiftshader"), shown["modelInfo"]
    assert shown["accelerator"]["requested"] == "auto" and shown["accelerator"]["used"] == "webgpu"
    assert [row[:3] for row in shown["outputs"]] == [["output_0", "float32", "[2, 4]"], ["output_1", "float32", "[2, 4]"]]
    assert [row[0] for row in shown["timings"]] == ["fetch model", "compile (webgpu)", "first run", "median of 3 runs"]
    assert all(row[1].endswith(" ms") for row in shown["timings"])
    inputs = {k: decode(v) for k, v in shown["data"]["inputs"].items()}
    assert_matches({k: decode(v) for k, v in shown["data"]["outputs"].items()},
                   interpreter_outputs(fx.mlp_model(), inputs), "runner page")


def test_auto_falls_back_to_wasm_without_webgpu(server):
    """Chromium without the WebGPU flags has navigator.gpu but no adapter: auto runs the model on WASM
    and says why; asking for webgpu (API or URL) is an error that says the same, not a fallback."""
    plain = Browser(server.url, webgpu="off")
    try:
        found = plain.call("webgpu")
        shown = plain.call("clickRun", {"repeats": 1})
        with pytest.raises(BrowserError, match=r"WebGPU was asked for \(accelerator=webgpu\) and is unavailable: "
                                               r"no adapter"):
            plain.call("load", {"model": "/model.tflite", "accelerator": "webgpu"})
        asked = plain.call("clickRun", {"repeats": 0}, page="/?accelerator=webgpu")
    finally:
        plain.close()
    assert found["webgpu"]["available"] is False and found["webgpu"]["reason"].startswith("no adapter"), found
    assert not shown["error"], shown["status"]
    acc = shown["accelerator"]
    assert (acc["requested"], acc["used"]) == ("auto", "wasm"), acc
    assert acc["note"].startswith("WebGPU unavailable: no adapter (requestAdapter() found no GPU"), acc["note"]
    assert re.search(r"\(WASM \((multi|single)-threaded\); WebGPU unavailable: no adapter", shown["status"]), \
        shown["status"]
    assert [row[0] for row in shown["timings"]][1] == "compile (wasm)"
    inputs = {k: decode(v) for k, v in shown["data"]["inputs"].items()}
    assert_matches({k: decode(v) for k, v in shown["data"]["outputs"].items()},
                   interpreter_outputs(fx.mlp_model(), inputs), "runner page on WASM")
    assert asked["error"] and asked["accelerator"] is None, asked
    assert "WebGPU was asked for (accelerator=webgpu) and is unavailable: no adapter" in asked["status"], asked["status"]


def test_url_chooses_the_accelerator(browser):
    shown = browser.call("clickRun", {"repeats": 0}, page="/?accelerator=wasm")
    assert not shown["error"], shown["status"]
    assert (shown["accelerator"]["requested"], shown["accelerator"]["used"]) == ("wasm", "wasm")
    assert shown["accelerator"]["note"] is None and re.search(r"\(WASM \((multi|single)-threaded\)\)$",
                                                              shown["status"]), shown["status"]
    found = browser.call("webgpu", page="/?accelerator=wasm")
    # a page set to wasm loads LiteRT.js's multi-threaded WASM (serve-web's pages are cross-origin isolated)
    # and does not use WebGPU at all (see initLiteRt: LiteRT.js 2.5.3 can hang freeing a WebGPU model there)
    assert (found["accelerator"], found["build"], found["webgpu"]["available"]) == ("wasm", "threaded", False), found
    with pytest.raises(BrowserError, match=r"WebGPU was asked for \(accelerator=webgpu\) and is unavailable: "
                                           r"a page set to wasm loads LiteRT.js's multi-threaded WASM"):
        browser.call("load", {"model": "/model.tflite", "accelerator": "webgpu"}, page="/?accelerator=wasm")
    bad = browser.call("clickRun", {"repeats": 0}, page="/?accelerator=cuda")
    assert bad["error"] and "?accelerator=cuda: choose one of auto, webgpu, wasm" in bad["status"], bad["status"]


def test_model_webgpu_cannot_take_whole_runs_on_wasm_without_the_jspi_build(server, browser):
    """Only LiteRT.js's JSPI build runs a model split between WebGPU and WASM; without it (?jspi=0
    here, or a browser without JSPI) auto runs such a model on WASM and says which ops WebGPU lacks."""
    url = server.add_model("fixture_embedding_nojspi.tflite", fx.embedding_model())
    info = browser.call("load", {"model": url}, page="/?jspi=0")
    acc = info["accelerator"]
    assert (acc["requested"], acc["used"], acc["build"]) == ("auto", "wasm", "single"), acc
    assert acc["note"] == ("WebGPU cannot run the whole model (GATHER: Only support 1D indices) and splitting it "
                           "between WebGPU and WASM needs LiteRT.js's JSPI build, which ?jspi=0 turned off"), acc["note"]
    with pytest.raises(BrowserError, match=r"WebGPU was asked for \(accelerator=webgpu\) but WebGPU cannot run the "
                                           r"whole model \(GATHER"):
        browser.call("load", {"model": url, "accelerator": "webgpu"}, page="/?jspi=0")
    whole = browser.call("load", {"model": "/model.tflite", "accelerator": "webgpu"}, page="/?jspi=0")["accelerator"]
    check_accelerator(whole, "webgpu", "MLP without the JSPI build")


def test_given_inputs_are_used_in_signature_order(tmp_path, browser):
    from torchtpu_export.targets.litert import web
    model = fx.difference_model()
    assert [t["name"] for t in web.signature_tensors(model)["serving_default"]["inputs"]] == ["zeta", "alpha"]
    zeta = np.linspace(-2, 2, 4)                 # float64 on disk: cast to the model's float32
    alpha = np.array([3, 1, 4, 1], np.int64)     # integers are fine for a float input too
    np.save(tmp_path / "first.npy", zeta)
    np.save(tmp_path / "second.npy", alpha)
    (tmp_path / "diff.tflite").write_bytes(model)
    # serve-web --accelerator wasm: the page's default becomes wasm (its /config.json says so)
    srv = web.start_server([tmp_path / "diff.tflite"], port=0, accelerator="wasm",
                           inputs=[str(tmp_path / "first.npy"), str(tmp_path / "second.npy")])
    try:
        shown = browser.call("clickRun", {"repeats": 0}, page=srv.url)
        details = browser.call("load", "/models/diff.tflite", page=srv.url)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [i["name"] for i in details["signatures"]["serving_default"]["inputs"]] == ["zeta", "alpha"]
    assert shown["status"].startswith("ran serving_default on given inputs (WASM ("), shown["status"]
    assert (shown["accelerator"]["requested"], shown["accelerator"]["used"]) == ("wasm", "wasm")
    got = decode(shown["data"]["outputs"]["output_0"])
    np.testing.assert_array_equal(got, zeta.astype(np.float32) - alpha.astype(np.float32))


def check_classify_page(server, browser, name: str, model: bytes, accelerator: str) -> dict:
    """The demo draws a picture, feeds it to ``model`` on ``accelerator`` and ranks the classes; checks every step."""
    url = server.add_model(name, model)
    res = browser.call("classify", {"model": url, "accelerator": accelerator, "repeats": 3}, page="classify.html")
    check_accelerator(res["accelerator"], accelerator, name)
    h, w = res["height"], res["width"]
    rgb = decode({"b64": res["rgba"], "dtype": "uint8", "shape": [h, w, 4]})[..., :3]
    expected = ((rgb.astype(np.float32) / 255 - MEAN) / STD)[None]  # NHWC, ImageNet normalisation
    if res["layout"] == "NCHW":
        expected = expected.transpose(0, 3, 1, 2)
    fed = decode({"b64": res["input"], "dtype": "float32", "shape": res["inputShape"]})
    np.testing.assert_allclose(fed, expected, rtol=0, atol=1e-6)
    assert rgb.std() > 10, "the sample picture is blank"
    ref = interpreter_outputs(model, {res["inputName"]: fed})[res["outputName"]]
    logits = decode({"b64": res["logits"], "dtype": "float32", "shape": list(ref.shape)})
    assert max_error(logits, ref) <= TOL
    assert [t["index"] for t in res["top"]] == list(np.argsort(-ref.reshape(-1), kind="stable")[:5])
    probs = np.exp(ref.reshape(-1) - ref.max())
    np.testing.assert_allclose([t["probability"] for t in res["top"]], np.sort(probs / probs.sum())[::-1][:5],
                               rtol=1e-5)
    print(f"{name} on {res['accelerator']['text']}: {res['layout']} input {res['inputShape']}, "
          f"top-1 {res['top'][0]['label']}; timings {res['timings']}")
    return res


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_classify_page_feeds_the_canvas_in_the_models_layout(server, browser, layout):
    for accelerator in ("webgpu", "wasm"):
        res = check_classify_page(server, browser, f"fixture_classifier_{layout}.tflite",
                                  fx.image_classifier(24, layout=layout), accelerator)
        assert res["layout"] == layout


# ---- the server and its CLI (no browser) -----------------------------------------------------

def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, "", b""


def test_server_serves_litertjs_locally_and_nothing_else(server):
    assert server.server_address[0] == "127.0.0.1"
    status, mime, body = _get(server.url + "vendor/@litertjs/core/wasm/litert_wasm_internal.wasm")
    assert (status, mime, body[:4]) == (200, "application/wasm", b"\0asm")
    assert _get(server.url + "vendor/@litertjs/core/dist/index.js")[:2] == (200, "text/javascript")
    assert _get(server.url + "model.tflite")[2] == fx.mlp_model()
    assert _get(server.url + "config.json")[2] == b'{"accelerator": "auto"}'
    for path in ("package.json", "driver.mjs", "vendor/playwright-core/package.json", "node_modules/x",
                 "vendor/@litertjs/core/package.json", "vendor/@litertjs/core/../../playwright-core/index.js",
                 "vendor/@litertjs/core/%2e%2e/%2e%2e/playwright-core/index.js", "models/missing.tflite"):
        assert _get(server.url + path)[0] == 404, path
    for page in ("index.html", "classify.html"):
        text = _get(server.url + page)[2].decode()
        assert "/vendor/@litertjs/core/dist/index.js" in text and "cdn" not in text.lower()


def test_serve_web_cli_serves_until_interrupted(tmp_path):
    require_web_deps()
    model = tmp_path / "m.tflite"
    model.write_bytes(fx.mlp_model())
    # Ctrl-C as a terminal delivers it: the test worker may run with SIGINT ignored (inherited by children,
    # which Python then leaves ignored), so the server starts with the default disposition
    proc = subprocess.Popen([sys.executable, "-m", "torchtpu_export.targets.litert.web", str(model), "--port", "0",
                             "--accelerator", "webgpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving m.tflite at http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        assert _get(url + "models.json")[0] == 200
        assert _get(url + "config.json")[2] == b'{"accelerator": "webgpu"}'
        # a client that stays connected and idle (a browser tab) must not hold the server's exit
        host, port = url.split("//")[1].rstrip("/").rsplit(":", 1)
        idle = socket.create_connection((host, int(port)))
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    idle.close()
    assert proc.returncode == 0, err


def test_serve_web_cli_errors(cli, tmp_path):
    require_web_deps()
    r = cli("serve-web", tmp_path / "missing.tflite")
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "junk.tflite").write_bytes(b"not a flatbuffer")
    r = cli("serve-web", tmp_path / "junk.tflite")
    assert r.returncode == 5 and "not a valid .tflite" in r.stderr
    (tmp_path / "m.tflite").write_bytes(fx.mlp_model())
    np.save(tmp_path / "bad.npy", np.zeros((3, 8), np.float32))
    r = cli("serve-web", tmp_path / "m.tflite", "--inputs", tmp_path / "bad.npy")
    assert r.returncode == 2 and "x has shape [3, 8], the model takes [2, 8]" in r.stderr
    (tmp_path / "i64.tflite").write_bytes(fx.cast_model(np.int64, np.float32))
    r = cli("serve-web", tmp_path / "i64.tflite")
    assert r.returncode == 2 and "int64" in r.stderr and "io_dtypes" in r.stderr
    r = cli("serve-web", tmp_path / "m.tflite", "--accelerator", "cuda")
    assert r.returncode == 2 and "invalid choice: 'cuda'" in r.stderr


# ---- converted zoo models ------------------------------------------------------------------

def _convert(module, args):
    """``tte.convert`` for the browser: int64 inputs need ``io_dtypes="web"`` (issue 7, item 3)."""
    import torch

    import torchtpu_export as tte
    options = {"io_dtypes": "web"} if any(a.dtype == torch.int64 for a in args) else {}
    try:
        return tte.convert(module, args, **options)
    except (TypeError, tte.InputError) as e:
        if "io_dtypes" not in str(e):
            raise
        missing = str(e)
    pytest.fail(f"tte.convert has no io_dtypes=\"web\" option yet, which int64 inputs need in the browser: "
                f"{missing}", pytrace=False)


def _web_inputs(edge, model: bytes, args) -> dict[str, np.ndarray]:
    """The sample args under the converted model's input names, cast to its (web) input dtypes."""
    from torchtpu_export.targets.litert.web import signature_tensors
    specs = {t["name"]: t for t in next(iter(signature_tensors(model).values()))["inputs"]}
    out = {}
    for spec, a in zip(edge.inputs(), args):
        a = a.detach().numpy()
        want = np.dtype(specs[spec.name]["dtype"])
        if want.kind in "iu":
            assert np.iinfo(want).min <= a.min() and a.max() <= np.iinfo(want).max
        out[spec.name] = a.astype(want)
    return out


def _llama_decode_step():
    import torch

    import zoo
    model, _ = zoo.llama()
    prompt = torch.randint(0, model.embed.num_embeddings, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, k, v = model.prefill(prompt)
    token = logits[:, -1:].argmax(-1)
    return zoo.Decode(model), (token, torch.tensor([prompt.shape[1]]), k, v)


def _zoo_case(name):
    import zoo
    if name == "small_cnn":
        return zoo.small_cnn(batch=1, size=32)
    if name == "bert_encoder":
        return zoo.bert_encoder(batch=2, seq=16)
    return _llama_decode_step()


@pytest.mark.parametrize("case", ["small_cnn", "bert_encoder", "llama_decode"])
def test_converted_model_in_browser(server, browser, case):
    """Each model on both accelerators. On WebGPU, small_cnn and bert_encoder run whole; the Llama decode
    step runs split: the zoo model keeps its KV cache as one 5-D stack per k and v, and LiteRT.js's WebGPU
    takes no 5-D tensor (GQA's k/v repeat is lowered in 4-D: it no longer adds any)."""
    import torch
    import torch.utils._pytree as pytree

    from torchtpu_export.numerics import compare
    module, args = _zoo_case(case)
    edge = _convert(module, args)
    model = edge.model_content()
    inputs = _web_inputs(edge, model, args)
    ref = interpreter_outputs(model, inputs)
    assert_matches(compiled_model_outputs(model, inputs), ref, f"{case} through CompiledModel")
    with torch.no_grad():
        eager = [t.numpy() for t in pytree.tree_leaves(module(*args))]
    for accelerator in ("webgpu", "wasm"):
        got, acc = check_in_browser(server, browser, f"{case}.tflite", model, inputs, repeats=1,
                                    accelerator=accelerator, reference=ref)
        if case != "llama_decode":
            assert acc["fullyAccelerated"], acc["text"]
        elif accelerator == "webgpu":  # WebGPU rejects only the ops on the model's own 5-D cache stack
            assert acc["cpuOps"] and all("less than 5" in op or "rank > 4" in op for op in acc["cpuOps"]), acc
        # the web I/O casts must not change the numbers: the browser agrees with torch eager too
        agreement = compare([got[s.name] for s in edge.outputs()], eager)
        assert agreement.ok, f"{case} on {accelerator}: browser vs torch eager: {agreement}"


def test_classify_page_with_converted_mobilenet(server, browser):
    import zoo
    module, args = zoo.mobilenet_v2(batch=1, size=64)
    edge = _convert(module, args)
    check_classify_page(server, browser, "mobilenet_v2.tflite", edge.model_content(), "webgpu")
