"""Models in the browser: LiteRT.js (WASM) in headless Chromium against Python LiteRT (issue 7).

One server and one browser serve the whole module (xdist group "web"). Models come from two
sources: small flatbuffer fixtures (tests/web_fixtures.py) and zoo models converted with
``tte.convert``; the latter fail with a clear message while the LiteRT converter is missing.
Outputs must match the Python interpreter within 1e-5 of the output's scale (integers exactly).
"""
from __future__ import annotations

import io
import os
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

TOL = 1e-5
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


@pytest.fixture(scope="module")
def server():
    require_web_deps()
    from torchtpu_export import web
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


def check_in_browser(server, browser, name: str, model: bytes, inputs: dict[str, np.ndarray], repeats: int = 3):
    """Serves ``model``, runs it in the page and in Python (interpreter, CompiledModel); all must agree."""
    url = server.add_model(name, model)
    got, timings = browser.run(url, inputs, repeats=repeats)
    ref = interpreter_outputs(model, inputs)
    errors = assert_matches(got, ref, f"{name} in LiteRT.js")
    assert_matches(compiled_model_outputs(model, inputs), ref, f"{name} through CompiledModel")
    print(f"{name}: max error {max(errors.values()):.2g}; compile {timings['compileMs']:.1f} ms, first run "
          f"{timings['firstRunMs']:.2f} ms, median of {timings['runs']} runs {timings['medianRunMs']:.2f} ms")
    return got


# ---- fixtures: the harness itself ------------------------------------------------------------

def test_float_model_matches_interpreter(server, browser):
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    check_in_browser(server, browser, "fixture_mlp.tflite", fx.mlp_model(), {"x": x})


def test_int32_inputs_and_outputs_match_interpreter(server, browser):
    tokens = np.random.default_rng(1).integers(0, 16, (1, 6)).astype(np.int32)
    got = check_in_browser(server, browser, "fixture_embedding.tflite", fx.embedding_model(), {"tokens": tokens})
    np.testing.assert_array_equal(got["output_1"], tokens + 1)


def test_uint8_io_runs_in_browser(server, browser):
    x = np.array([[0, 1, 2], [127, 254, 255]], np.uint8)
    got = check_in_browser(server, browser, "fixture_u8.tflite", fx.cast_model(np.uint8, np.float32), {"x": x})
    np.testing.assert_array_equal(got["output_0"], x.astype(np.float32))


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
    assert [row[:3] for row in shown["outputs"]] == [["output_0", "float32", "[2, 4]"], ["output_1", "float32", "[2, 4]"]]
    assert [row[0] for row in shown["timings"]] == ["fetch model", "compile (wasm)", "first run", "median of 3 runs"]
    assert all(row[1].endswith(" ms") for row in shown["timings"])
    inputs = {k: decode(v) for k, v in shown["data"]["inputs"].items()}
    assert_matches({k: decode(v) for k, v in shown["data"]["outputs"].items()},
                   interpreter_outputs(fx.mlp_model(), inputs), "runner page")


def test_given_inputs_are_used_in_signature_order(tmp_path, browser):
    from torchtpu_export import web
    model = fx.difference_model()
    assert [t["name"] for t in web.signature_tensors(model)["serving_default"]["inputs"]] == ["zeta", "alpha"]
    zeta = np.linspace(-2, 2, 4)                 # float64 on disk: cast to the model's float32
    alpha = np.array([3, 1, 4, 1], np.int64)     # integers are fine for a float input too
    np.save(tmp_path / "first.npy", zeta)
    np.save(tmp_path / "second.npy", alpha)
    (tmp_path / "diff.tflite").write_bytes(model)
    srv = web.start_server([tmp_path / "diff.tflite"], port=0,
                           inputs=[str(tmp_path / "first.npy"), str(tmp_path / "second.npy")])
    try:
        shown = browser.call("clickRun", {"repeats": 0}, page=srv.url)
        details = browser.call("load", "/models/diff.tflite", page=srv.url)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [i["name"] for i in details["signatures"]["serving_default"]["inputs"]] == ["zeta", "alpha"]
    assert shown["status"].startswith("ran serving_default on given inputs"), shown["status"]
    got = decode(shown["data"]["outputs"]["output_0"])
    np.testing.assert_array_equal(got, zeta.astype(np.float32) - alpha.astype(np.float32))


def check_classify_page(server, browser, name: str, model: bytes) -> dict:
    """The demo draws a picture, feeds it to ``model`` and ranks the classes; checks every step."""
    url = server.add_model(name, model)
    res = browser.call("classify", {"model": url, "repeats": 3}, page="classify.html")
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
    print(f"{name}: {res['layout']} input {res['inputShape']}, top-1 {res['top'][0]['label']}; "
          f"timings {res['timings']}")
    return res


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_classify_page_feeds_the_canvas_in_the_models_layout(server, browser, layout):
    res = check_classify_page(server, browser, f"fixture_classifier_{layout}.tflite",
                              fx.image_classifier(24, layout=layout))
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
    proc = subprocess.Popen([sys.executable, "-m", "torchtpu_export.web", str(model), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving m.tflite at http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split(" at ")[1].split()[0]
        assert _get(url + "models.json")[0] == 200
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
    from torchtpu_export.web import signature_tensors
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
    import torch
    import torch.utils._pytree as pytree

    from torchtpu_export.numerics import compare
    module, args = _zoo_case(case)
    edge = _convert(module, args)
    model = edge.model_content()
    inputs = _web_inputs(edge, model, args)
    got = check_in_browser(server, browser, f"{case}.tflite", model, inputs)
    # the web I/O casts must not change the numbers: the browser agrees with torch eager too
    with torch.no_grad():
        eager = [t.numpy() for t in pytree.tree_leaves(module(*args))]
    agreement = compare([got[s.name] for s in edge.outputs()], eager)
    assert agreement.ok, f"{case}: browser vs torch eager: {agreement}"


def test_classify_page_with_converted_mobilenet(server, browser):
    import zoo
    module, args = zoo.mobilenet_v2(batch=1, size=64)
    edge = _convert(module, args)
    check_classify_page(server, browser, "mobilenet_v2.tflite", edge.model_content())
