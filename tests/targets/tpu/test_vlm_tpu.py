"""Vision-language models on the tpu target: a tiny VLM of each exported family (Gemma 3, whose image tokens
attend to one another; Idefics3), exported by the CLI with its ``vision`` program and ``prefill_image_<N>``
steps, served by ``torchtpu-export serve``: an OpenAI chat request with an image (a data URL) gets the tokens
transformers' ``generate`` gives on the processor's inputs for the same image and prompt, another image other
tokens; bad images and requests get one 400 each, and the server goes on."""
import base64
import io
import json
import types
import urllib.request

import pytest
import torch

import hf_vlms
from conftest import run_cli
from serving_harness import Server, _openai

pytestmark = pytest.mark.xdist_group("vlm_tpu")

STEPS = 32
PROMPT = "what is this"


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_tpu")
    return root, [hf_vlms.save_image(str(root / f"image{i}.png"), i) for i in (1, 2)]


@pytest.fixture(scope="session")
def exports(root):
    """Each family exported and served once for the worker's session, whatever order the tests run in (a
    parametrized module fixture is rebuilt when the scheduler alternates its parameters, and a module fixture
    when the worker runs another module's tests between this module's)."""
    made = {}
    yield root, made
    for *_, server in made.values():
        server.close()


@pytest.fixture(params=list(hf_vlms.FAMILIES))
def served(request, exports):
    return _built(exports, request.param)


def _built(exports, family: str):
    (where, images), made = exports
    if family not in made:
        folder = hf_vlms.save_folder(family, str(where / family))
        out = where / f"{family}.tpu"
        # prefill lengths 8 and 32: a prompt of about 20 tokens goes in chunks of 8, which an image must not
        # straddle
        r = run_cli(folder, "--target", "tpu", "--prefill-lengths", "8,32", "--cache-length", "96", "--batch-size",
                    "2", "--platforms", "cpu", "-o", out)
        assert r.returncode == 0, r.stderr
        made[family] = (family, folder, out, images, r.stdout + r.stderr, Server(out))
    return made[family]


def _data_url(path) -> str:
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode()


def _png_url(width: int, height: int) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(client, content, **kw):
    r = client.chat.completions.create(model=client.served_name, messages=[{"role": "user", "content": content}],
                                       max_tokens=STEPS, temperature=0, logprobs=True,
                                       extra_body={"return_tokens_as_token_ids": True}, **kw)
    return [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]


def _reference(folder, image: str, stops) -> list[int]:
    """transformers' greedy token ids for PROMPT about ``image`` (the processor's inputs, Gemma 3's
    token_type_ids among them), up to a stop token."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=Image.open(image), return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    out = out.tolist()
    return out[:next((i for i, t in enumerate(out) if t in stops), len(out))]


def _client(served):
    family, folder, out, images, said, server = served
    client = _openai(server)
    client.served_name = out.stem
    return client


def test_a_tpu_vlm_answers_an_openai_chat_with_an_image_as_transformers_does(served):
    family, folder, out, images, said, server = served
    assert f"vision ({family}): a 32x32 image is 4 rows of the prompt" in said
    assert "checked against transformers' VLM on a probe image" in said
    with __import__("zipfile").ZipFile(out) as z:
        stops = set(json.loads(z.read("manifest.json"))["llm"]["stop_ids"])
    client = _client(served)
    content = [[{"type": "image_url", "image_url": {"url": _data_url(image)}}, {"type": "text", "text": PROMPT}]
               for image in images]
    ours = [_chat(client, c) for c in content]
    refs = [_reference(folder, image, stops) for image in images]
    assert ours == refs
    assert ours[0] != ours[1] and len(ours[0]) > 8  # the image is seen
    # a text request beside it is a text request (no image, no image tokens)
    assert _chat(client, PROMPT)
    # the CLI's run, through the same programs
    r = run_cli("run", out, "--prompt", PROMPT, "--image", images[0], "--max-new-tokens", "8")
    assert r.returncode == 0 and "generated in" in r.stdout + r.stderr, r.stderr


def test_bad_images_and_requests_get_one_400_and_the_server_goes_on(served, tmp_path):
    import openai
    family, folder, out, images, said, server = served
    client = _client(served)
    marker = {"gemma3": "<start_of_image>", "idefics3": "<image>"}[family]
    not_png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40).decode()
    for content, says in (
            ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "fetches no remote images"),
            ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "not valid base64"),
            ([{"type": "image_url", "image_url": {"url": not_png}}], "is not an image that can be read"),
            ([{"type": "image_url", "image_url": {"url": _data_url(images[0])}}] * 9, "more than the 8"),
            # 1 x 67,108,864 pixels in 130 KB: within the pixel bound, 192 MiB to decode as RGB
            ([{"type": "image_url", "image_url": {"url": _png_url(1, 64 << 20)}}], "decodes to"),
            ([{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
              {"type": "text", "text": f"and {marker}"}], "image tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, content)
        assert says in str(e.value), str(e.value)
    # the server goes on
    assert _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(images[1])}},
                          {"type": "text", "text": PROMPT}])


def test_an_image_is_never_cut_where_its_rows_attend_to_one_another():
    """The engine's chunks of an image request: the longest prefill length the rest fills; with Gemma 3's
    bidirectional image rows a chunk ends before an image it would cut, or holds all of it."""
    from torchtpu_export.engine.scheduler import Engine
    from torchtpu_export.errors import InputError
    prompt = [1] * 5 + [9] * 5 + [1] * 10 + [2]  # an image at positions 5-9, 20 tokens to prefill
    for bidirectional, want in ((True, [(5, 8), (8, 8), (7, 8)]), (False, [(8, 8), (8, 8), (4, 8)])):
        engine = types.SimpleNamespace(lengths=[8, 32], vision={"image_token_id": 9, "bidirectional": bidirectional})
        assert Engine._image_chunks(engine, types.SimpleNamespace(prompt=prompt), 0) == want
    engine = types.SimpleNamespace(lengths=[4], vision={"image_token_id": 9, "bidirectional": True})
    with pytest.raises(InputError, match="rows do not fit one prefill step"):
        Engine._image_chunks(engine, types.SimpleNamespace(prompt=prompt), 0)


def test_a_tpu_vlm_is_served_from_slots_on_one_chip(root, tmp_path):
    """A VLM with a paged cache or a mesh is refused at export, with one message."""
    where, _ = root
    folder = hf_vlms.save_folder("idefics3", str(tmp_path / "idefics3"))
    r = run_cli(folder, "--target", "tpu", "--kv-pages", "auto", "--platforms", "cpu", "-o", tmp_path / "v.tpu")
    assert r.returncode == 2 and "served from the engine's slots on one chip: not with kv_pages" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "v.tpu").exists()


def test_a_vision_entry_its_programs_do_not_bear_out_is_refused(served, tmp_path):
    """The file is untrusted: a manifest whose image rows are not its vision program's is refused when an engine
    is made (one message, code 5 from the CLI), never served with rows out of place."""
    import zipfile

    import torchtpu_export as tte
    from torchtpu_export.engine import Engine
    from torchtpu_export.errors import ArtifactError
    out = served[2]
    bad = tmp_path / "bad.tpu"
    with zipfile.ZipFile(out) as z, zipfile.ZipFile(bad, "w") as w:
        for info in z.infolist():
            data = z.read(info)
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                manifest["llm"]["vision"]["rows"] = 5
                data = json.dumps(manifest).encode()
            w.writestr(info, data)
    with pytest.raises(ArtifactError, match="does not match its vision program"):
        Engine(tte.load(bad))


def test_libtpu_compiles_a_vlms_engine_calls_ahead_of_time(tmp_path):
    """`compile --topology v5e` on a VLM: the engine over libtpu's description of the chip (no runnable program
    there) reads the vision entry from the manifest, and the compiler takes the vision and image prefill calls."""
    import torchtpu_export as tte
    folder = hf_vlms.save_folder("idefics3", str(tmp_path / "idefics3"))
    prog = tte.export_llm(folder, target="tpu", prefill_lengths=(8,), cache_length=32, batch_size=2,
                          platforms=("tpu", "cpu"), kernels="xla", check=False)
    calls = prog.compile("v5e").manifest["llm"]["engine"]["v5e:1x1"]["calls"]
    assert {"vision", "prefill_image_8", "prefill_8", "decode_batch.top0"} <= set(calls)


def test_slow_images_are_stopped_and_never_stall_text_requests(exports):
    """Images decode in image workers of their own (``--image-timeout``): three requests whose JPEG decodes
    for seconds each are refused at the budget, one after another as the two workers free up, while a
    text-only chat and the readiness probe are answered at once; images decode again afterwards."""
    import concurrent.futures
    import time

    import openai
    from image_craft import _scans_jpeg
    family, folder, out, images, said, _ = _built(exports, next(iter(hf_vlms.FAMILIES)))
    server = Server(out, "--image-timeout", "2")
    try:
        client = _openai(server)
        client.served_name = out.stem
        slow = "data:image/jpeg;base64," + base64.b64encode(_scans_jpeg(4096, 3000)).decode()
        done = {}

        def image_chat(k):
            try:
                _chat(client, [{"type": "image_url", "image_url": {"url": slow}}, {"type": "text", "text": PROMPT}])
                done[k] = ("answered", time.monotonic())
            except openai.BadRequestError as e:
                done[k] = (str(e), time.monotonic())

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(image_chat, k) for k in range(3)]
            time.sleep(0.5)  # the images are being decoded
            assert _chat(client, PROMPT)
            text_done = time.monotonic()
            with urllib.request.urlopen(server.url + "/v2/health/ready", timeout=5) as r:
                assert r.status == 200
            for f in futures:
                f.result()
        assert all("took longer than 2 s" in why for why, _ in done.values()), done
        assert text_done < min(at for _, at in done.values())
        assert _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(images[0])}},
                              {"type": "text", "text": PROMPT}])
    finally:
        server.close()
