"""Vision-language models to LiteRT-LM bundles: a tiny Gemma 3 VLM (seeded random weights, the local tokenizer
with Gemma 3's image tokens, its image processor saved) exported by the CLI, run by LiteRT-LM's own engine
with an image; greedy text equals transformers' ``generate`` on the processor's inputs for the same image
and prompt (image tokens attending to one another, as transformers reads them), and another image changes
it. The encoder section alone agrees with transformers' vision tower on the processor's pixels."""
import json
import os

import numpy as np
import pytest
import torch

import hf_vlms
from conftest import run_cli

pytestmark = pytest.mark.xdist_group("vlm")

STEPS = 32
PROMPT = "what is this"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    folder = hf_vlms.save_folder("gemma3", str(root / "gemma3"))
    out = root / "gemma3.litertlm"
    r = run_cli(folder, "--target", "litertlm", "--prefill-lengths", "4,32", "--cache-length", "96", "-o", out)
    assert r.returncode == 0, r.stderr
    images = [hf_vlms.save_image(str(root / f"image{i}.png"), i) for i in (1, 2)]
    return folder, out, images, r.stdout


def _reference(folder, image: str) -> str:
    """transformers' greedy reply to PROMPT about ``image`` (the processor's inputs, token_type_ids with them),
    up to a stop token, as text."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=Image.open(image), return_tensors="pt", add_special_tokens=False)
    assert "token_type_ids" in inputs
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    out = out.tolist()
    cut = next((i for i, t in enumerate(out) if t == model.config.text_config.eos_token_id), len(out))
    return processor.tokenizer.decode(out[:cut])


def test_a_gemma3_vlm_bundle_answers_about_an_image_as_transformers_does(gemma3):
    folder, out, images, said = gemma3
    assert "vision (gemma3): a 32x32 image is 5 rows of the prompt" in said
    assert "signatures prefill_8, prefill_32, decode" in said  # no prefill step shorter than an image
    import torchtpu_export as tte
    bundle = tte.load(out)
    replies = [bundle.generate(PROMPT, STEPS, images=[image]).text for image in images]
    refs = [_reference(folder, image) for image in images]
    assert replies == refs
    assert replies[0] != replies[1]  # the image is seen
    assert len(replies[0]) > 8
    # the bundle's sections, as inspect tells them
    r = run_cli("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    roles = {s["model_type"]: s["role"] for s in json.loads(r.stdout)["sections"] if s["model_type"]}
    assert roles["tf_lite_vision_encoder"].startswith("the image encoder")
    assert roles["tf_lite_vision_adapter"].startswith("the image adapter")
    assert roles["tf_lite_embedder"].startswith("the token embedder")


def test_the_encoder_section_alone_agrees_with_the_vision_tower(gemma3):
    """The encoder .tflite, read out of the bundle and run on the LiteRT interpreter on an image's pixels / 255
    (what LiteRT-LM gives it), against transformers' tower on the image processor's pixel_values."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from torchtpu_export.targets.litert.target import EdgeModel
    from torchtpu_export.targets.litertlm.target import check, section_bytes
    folder, out, images, _ = gemma3
    checked = check(str(out))
    section = next(s for s in checked.reads["tflite"] if s["model_type"] == "tf_lite_vision_encoder")
    encoder = EdgeModel(section_bytes(str(out), section))
    [spec] = encoder.inputs()
    assert (spec.name, list(spec.shape), spec.dtype) == ("images", [1, 32, 32, 3], "float32")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    for image in images:
        pixels = np.asarray(Image.open(image).convert("RGB"), np.float32)[None] / 255
        ours = np.asarray(encoder.run_flat([pixels])[0], np.float64)
        with torch.no_grad():
            ref = model.model.vision_tower(pixel_values=processor.image_processor(
                Image.open(image), return_tensors="pt")["pixel_values"]).last_hidden_state.double().numpy()
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_run_with_an_image_and_bad_images(gemma3, tmp_path):
    folder, out, images, _ = gemma3
    r = run_cli("run", out, "--prompt", PROMPT, "--image", images[0], "--max-new-tokens", "8")
    assert r.returncode == 0 and "generated in" in r.stderr + r.stdout, r.stderr
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    for image, says in ((tmp_path / "none.png", "cannot read the image"), (bad, "is not an image that can be read")):
        r = run_cli("run", out, "--prompt", PROMPT, "--image", image)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("run", out, "--image", images[0])
    assert r.returncode == 2 and "--image goes with --prompt" in r.stderr


def test_a_vlm_is_refused_where_its_image_parts_cannot_go(gemma3, tmp_path):
    """The tpu target does not take images yet: the folder is refused there, never exported as text alone; a
    VLM family that is not exported is refused for litertlm, naming the ones that are."""
    folder = gemma3[0]
    r = run_cli(folder, "--target", "tpu", "-o", tmp_path / "g.tpu")
    assert r.returncode == 2 and "vision tower beside its text decoder" in r.stderr, r.stderr
    assert not (tmp_path / "g.tpu").exists()
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 1}}))
    r = run_cli(other, "--target", "litertlm", "-o", tmp_path / "l.litertlm")
    assert r.returncode == 2 and "vision-language models of the families gemma3" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "l.litertlm")
