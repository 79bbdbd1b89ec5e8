"""Vision-language models to LiteRT-LM bundles: a tiny VLM of each exported family (Gemma 3; Idefics3, which
SmolVLM is), seeded random weights, the local tokenizer with the family's image tokens, its image processor
saved, exported by the CLI and run by LiteRT-LM's own engine with an image; greedy text equals transformers'
``generate`` on the processor's inputs for the same image and prompt (Gemma 3's image tokens attending to one
another, as transformers reads them), and another image changes it. The encoder section alone agrees with
transformers' vision tower on the processor's pixels."""
import json

import numpy as np
import pytest
import torch

import hf_vlms
from conftest import run_cli

pytestmark = pytest.mark.xdist_group("vlm")

STEPS = 32
PROMPT = "what is this"


# family -> (rows an image takes, the prefill signatures export makes of --prefill-lengths 4,32)
FAMILIES = {"gemma3": (5, "prefill_8, prefill_32"),  # no prefill step shorter than an image
            "idefics3": (4, "prefill_4, prefill_32")}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return root, [hf_vlms.save_image(str(root / f"image{i}.png"), i) for i in (1, 2)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, root):
    where, images = root
    family = request.param
    folder = hf_vlms.save_folder(family, str(where / family))
    out = where / f"{family}.litertlm"
    r = run_cli(folder, "--target", "litertlm", "--prefill-lengths", "4,32", "--cache-length", "96", "-o", out)
    assert r.returncode == 0, r.stderr
    return family, folder, out, images, r.stdout


@pytest.fixture
def gemma3(root):
    where, images = root
    return hf_vlms.save_folder("gemma3", str(where / "gemma3-alone")), images


def _reference(folder, image: str) -> str:
    """transformers' greedy reply to PROMPT about ``image`` (the processor's inputs: Gemma 3's token_type_ids
    among them), up to a stop token, as text."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=Image.open(image), return_tensors="pt", add_special_tokens=False)
    assert "token_type_ids" in inputs or model.config.model_type != "gemma3"
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    out = out.tolist()
    stops = {model.config.text_config.eos_token_id, processor.tokenizer.eos_token_id}
    cut = next((i for i, t in enumerate(out) if t in stops), len(out))
    return processor.tokenizer.decode(out[:cut])


def test_a_vlm_bundle_answers_about_an_image_as_transformers_does(vlm):
    family, folder, out, images, said = vlm
    rows, signatures = FAMILIES[family]
    assert f"vision ({family}): a 32x32 image is {rows} rows of the prompt" in said
    assert f"signatures {signatures}, decode" in said
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


def test_the_encoder_section_alone_agrees_with_the_vision_tower(vlm):
    """The encoder .tflite, read out of the bundle and run on the LiteRT interpreter on an image's pixels / 255
    (what LiteRT-LM gives it), against transformers' tower on the image processor's pixel_values."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from torchtpu_export.targets.litert.target import EdgeModel
    from torchtpu_export.targets.litertlm.artifact import section_bytes
    from torchtpu_export.targets.litertlm.checks import check
    family, folder, out, images, _ = vlm
    checked = check(str(out))
    section = next(s for s in checked.reads["tflite"] if s["model_type"] == "tf_lite_vision_encoder")
    encoder = EdgeModel(section_bytes(str(out), section))
    [spec] = encoder.inputs()
    assert (spec.name, list(spec.shape), spec.dtype) == ("images", [1, 32, 32, 3], "float32")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    tower = getattr(model.model, "vision_tower", None) or model.model.vision_model
    for image in images:
        pixels = np.asarray(Image.open(image).convert("RGB"), np.float32)[None] / 255
        ours = np.asarray(encoder.run_flat([pixels])[0], np.float64)
        given = processor.image_processor(Image.open(image), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            ref = tower(pixel_values=given.reshape(1, 3, 32, 32)).last_hidden_state.double().numpy()
        assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def test_run_with_an_image_and_bad_images(vlm, tmp_path):
    family, folder, out, images, _ = vlm
    r = run_cli("run", out, "--prompt", PROMPT, "--image", images[0], "--max-new-tokens", "8")
    assert r.returncode == 0 and "generated in" in r.stderr + r.stdout, r.stderr
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    for image, says in ((tmp_path / "none.png", "none.png (--image): No such file"), (bad, "is not an image that can be read")):
        r = run_cli("run", out, "--prompt", PROMPT, "--image", image)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_cli("run", out, "--image", images[0])
    assert r.returncode == 2 and "--image goes with --prompt" in r.stderr


def test_the_executor_metadata_is_checked_before_litert_lm_reads_it(vlm, tmp_path):
    """Gemma 3's bundle carries an ExecutorMetadata (the vision-bidirectional mask, the caches as state
    buffers), a causal family's none; one whose state buffer names a sequence axis no cache has is exit 5
    with one message, before LiteRT-LM follows it."""
    from litert_lm_builder.runtime.proto import executor_metadata_pb2

    from torchtpu_export.targets.litertlm.artifact import read_sections
    family, folder, out, images, _ = vlm
    found = [s for s in read_sections(str(out)) if s["type"] == "ExecutorMetadataProto"]
    assert len(found) == (family == "gemma3")
    if not found:
        return
    data = bytearray(out.read_bytes())
    begin, end = found[0]["begin"], found[0]["end"]
    meta = executor_metadata_pb2.ExecutorMetadata.FromString(bytes(data[begin:end]))
    assert meta.llm_executor_metadata.attention_mask_settings.attention_mask_type == \
        executor_metadata_pb2.ATTENTION_MASK_TYPE_VISION_BIDIRECTIONAL
    meta.llm_executor_metadata.state_buffers[0].sequence_axis = 9  # one byte, as 2 was
    data[begin:end] = meta.SerializeToString()
    bad = tmp_path / "bad.litertlm"
    bad.write_bytes(bytes(data))
    for args in (("inspect", bad), ("run", bad, "--prompt", PROMPT, "--image", images[0])):
        r = run_cli(*args)
        assert r.returncode == 5 and "sequence axis 9, out of range" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize("change,says", [
    ({"do_pan_and_scan": True}, "pan and scan"),
    ({"rescale_factor": "1/255"}, "scales pixels by 1/255"),
    ({"size": [32, 32]}, "size must be a JSON object"),
    ({"size": {"height": 64, "width": 64}}, "resizes to 64x64, its vision tower takes 32x32"),
    ({"image_mean": "gray"}, "image_mean and image_std must be numbers")])
def test_an_image_processor_the_encoder_cannot_follow_is_refused(gemma3, tmp_path, change, says):
    """What the image processor's config asks that LiteRT-LM's encoder input cannot give is refused at export
    with one message, before anything is converted."""
    import shutil
    folder = tmp_path / "vlm"
    shutil.copytree(gemma3[0], folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"].update(change)
    (folder / "processor_config.json").write_text(json.dumps(config))
    r = run_cli(folder, "--target", "litertlm", "-o", tmp_path / "out.litertlm")
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out.litertlm").exists()
