"""export_llm's defaults fit the model, and a folder it cannot carry whole is refused: the cache length
defaults to the smaller of 1024 and the model's max_position_embeddings (and the output says so), and a
vision-language folder is never exported as its text decoder alone."""
import json

import pytest

import hf_llms
from conftest import run_cli

pytestmark = pytest.mark.xdist_group("llm_defaults")  # a group of its own: nothing shared with test_llm_bundles' folders


def test_the_default_cache_length_fits_the_model(tmp_path):
    folder = hf_llms.save_folder("llama", str(tmp_path / "llama"))  # max_position_embeddings 512
    out = tmp_path / "llama.tpu"
    r = run_cli(folder, "--target", "tpu", "--prefill-lengths", "16", "--platforms", "cpu", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "cache 512 positions (the default" in r.stdout + r.stderr
    r = run_cli(folder, "--target", "tpu", "--prefill-lengths", "16", "--cache-length", "2048", "-o", out)
    assert r.returncode == 2 and "max_position_embeddings 512" in r.stderr and "at most 512" in r.stderr, r.stderr


@pytest.mark.parametrize("family,target,says", [
    ("gemma3", "litert", "vision-language models are exported with --target litertlm or tpu"),
    ("llava", "tpu", "the tpu target exports vision-language models of the families gemma3, idefics3"),
    ("llava", "litertlm", "the litertlm target exports vision-language models of the families gemma3, idefics3")])
def test_a_vision_language_folder_is_refused_not_truncated(tmp_path, family, target, says):
    """A VLM folder the target cannot export whole (any for litert; a family litertlm and tpu do not export) is
    refused from its config.json alone, naming the part it would drop (test_vlm_bundles exports the others)."""
    folder = tmp_path / f"{family}-vlm"
    folder.mkdir()
    arch, text, vision = {"gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text", "siglip_vision_model"),
                          "llava": ("LlavaForConditionalGeneration", "llama", "clip_vision_model")}[family]
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": family,
        "text_config": {"model_type": text, "hidden_size": 64, "num_hidden_layers": 2},
        "vision_config": {"model_type": vision, "hidden_size": 32, "num_hidden_layers": 1}}))
    r = run_cli(folder, "--target", target, "-o", tmp_path / f"out.{target}")
    assert r.returncode == 2, r.stderr
    assert f"{arch} with a vision tower" in r.stderr and says in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / f"out.{target}").exists()


def test_export_checks_what_it_wrote_against_transformers(tmp_path, monkeypatch):
    """The exported steps run a probe prompt before anything is written; a program that computes other
    logits is an error (exit 6), never a file; --no-check skips it, saying so."""
    folder = hf_llms.save_folder("qwen3", str(tmp_path / "qwen3"))
    out = tmp_path / "q.tpu"
    one = ("--prefill-lengths", "8", "--batch-size", "1", "--platforms", "cpu")
    r = run_cli(folder, "--target", "tpu", *one, "-o", out)
    assert r.returncode == 0 and "checked against transformers on a probe prompt: max error" in r.stdout, r.stderr
    r = run_cli(folder, "--target", "tpu", *one, "--no-check", "-o", out)
    assert r.returncode == 0 and "not checked against transformers: check=False" in r.stdout, r.stderr
    import torchtpu_export as tte
    from torchtpu_export.errors import NumericsError
    from torchtpu_export.llm import host
    real = host.next_token_logits
    monkeypatch.setattr(host, "next_token_logits", lambda *a, **k: real(*a, **k) * 1.1)  # a program off by 10%
    with pytest.raises(NumericsError, match="differ from transformers"):
        tte.export_llm(folder, target="tpu", prefill_lengths=(8,), platforms=("cpu",))
