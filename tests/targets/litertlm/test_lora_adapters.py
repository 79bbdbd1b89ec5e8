"""LoRA adapters for LiteRT-LM bundles: a rank-4 PEFT adapter (made by peft, random LoRA weights) on the tiny
Llama of ``hf_llms``; the CLI exports the base LoRA-ready with the adapter beside it, and LiteRT-LM's own
engine with the adapter gives the merged model's greedy text (transformers, ``merge_and_unload``), not the
base model's, which it gives without the adapter. ``torchtpu-export adapter`` writes the same file from the
PEFT folder and the bundle; adapters that do not fit are refused before LiteRT-LM maps them."""
import copy
import os

import pytest
import torch

import hf_llms
from conftest import run_cli

pytestmark = pytest.mark.xdist_group("lora")

STEPS = 32
PROMPT = "the quick brown fox"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _peft(model, path, targets=ATTENTION, r=4, seed=1):
    """A PEFT LoRA folder of ``model`` at ``path``, random LoRA weights; returns the merged model."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                                 init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model, tok = hf_llms.build("llama")
    folder = hf_llms.save(model, tok, str(root / "llama"))
    merged = _peft(model, str(root / "peft"))
    out = root / "llama.litertlm"
    r = run_cli(folder, "--target", "litertlm", "--prefill-lengths", "8,32", "--cache-length", "128",
                "--lora", root / "peft", "-o", out)
    assert r.returncode == 0, r.stderr
    return root, model, merged, tok, out, r.stdout


def _greedy(model, tok) -> str:
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)[0, len(ids):].tolist()
    cut = next((i for i, t in enumerate(out) if t == tok.eos_token_id), len(out))
    return tok.decode(out[:cut])


def test_litert_lm_with_the_adapter_gives_the_merged_models_tokens(made):
    root, model, merged, tok, out, said = made
    adapter = root / "llama.lora.tflite"
    assert f"wrote the LoRA adapter {adapter}" in said and "rank 4 as LiteRT-LM's 16, 8 projections" in said
    assert "with it merged" in said  # the export's check ran the steps with the adapter
    assert (root / "llama.nolora.tflite").exists()  # the base model's adapter (zeros), for LiteRT-LM's own users
    import torchtpu_export as tte
    bundle = tte.load(out)
    base, tuned = _greedy(model, tok), _greedy(merged, tok)
    assert base != tuned  # the adapter changes the model
    assert bundle.generate(PROMPT, STEPS).text == base
    assert bundle.generate(PROMPT, STEPS, lora=adapter).text == tuned
    assert bundle.generate(PROMPT, STEPS).text == base  # one session's adapter is not the next one's
    r = run_cli("run", out, "--prompt", PROMPT, "--max-new-tokens", "8", "--lora", adapter)
    assert r.returncode == 0 and "generated in" in r.stdout + r.stderr, r.stderr


def test_the_adapter_command_writes_the_same_file_from_the_bundle(made, tmp_path):
    root, out = made[0], made[4]
    again = tmp_path / "again.lora.tflite"
    r = run_cli("adapter", root / "peft", "--base", out, "-o", again)
    assert r.returncode == 0, r.stderr
    assert again.read_bytes() == (root / "llama.lora.tflite").read_bytes()
    assert os.path.getsize(again) % 4096 == 0  # LiteRT-LM maps whole pages


def test_adapters_that_do_not_fit_are_refused(made, tmp_path):
    root, model, merged, tok, out, _ = made
    garbage = tmp_path / "garbage.tflite"
    garbage.write_bytes(b"\x00" * 64)
    r = run_cli("run", out, "--prompt", PROMPT, "--lora", garbage)
    assert r.returncode == 5 and "not a LoRA adapter file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # an adapter of another base (other projection shapes) is named, before LiteRT-LM fails at its first prefill
    other_model, other_tok = hf_llms.build("qwen3")
    other = hf_llms.save(other_model, other_tok, str(tmp_path / "qwen3"))
    _peft(other_model, str(tmp_path / "peft-qwen3"))
    r = run_cli(other, "--target", "litertlm", "--prefill-lengths", "8", "--cache-length", "64", "--lora",
                tmp_path / "peft-qwen3", "-o", tmp_path / "qwen3.litertlm")
    assert r.returncode == 0, r.stderr
    r = run_cli("run", out, "--prompt", PROMPT, "--lora", tmp_path / "qwen3.lora.tflite")
    assert r.returncode == 5 and "another base" in r.stderr, r.stderr
    # PEFT adapters LiteRT-LM's LoRA cannot carry: MLP projections, a rank past 32
    _peft(model, str(tmp_path / "mlp"), targets=["q_proj", "up_proj"])
    r = run_cli("adapter", tmp_path / "mlp", "--base", out, "-o", tmp_path / "mlp.tflite")
    assert r.returncode == 2 and "attention projection" in r.stderr and "up_proj" in r.stderr, r.stderr
    _peft(model, str(tmp_path / "r64"), r=64)
    r = run_cli("adapter", tmp_path / "r64", "--base", out, "-o", tmp_path / "r64.tflite")
    assert r.returncode == 2 and "ranks up to 32" in r.stderr, r.stderr
    assert not (tmp_path / "mlp.tflite").exists() and not (tmp_path / "r64.tflite").exists()


def test_lora_goes_where_the_runtime_takes_it(made, tmp_path):
    root, model, merged, tok, out, _ = made
    folder = str(root / "llama")
    r = run_cli(folder, "--target", "tpu", "--lora", "16", "-o", tmp_path / "x.tpu")
    assert r.returncode == 2 and "lora= applies to target='litertlm'" in r.stderr, r.stderr
    r = run_cli(folder, "--target", "litertlm", "--lora", "8", "-o", tmp_path / "x.litertlm")
    assert r.returncode == 2 and "rank 16 or 32, not 8" in r.stderr, r.stderr
    plain = tmp_path / "plain.litertlm"
    assert run_cli(folder, "--target", "litertlm", "--prefill-lengths", "8", "--cache-length", "64",
                   "-o", plain).returncode == 0
    r = run_cli("run", plain, "--prompt", PROMPT, "--lora", root / "llama.lora.tflite")
    assert r.returncode == 2 and "takes no LoRA adapter" in r.stderr, r.stderr


def test_adapters_with_nan_or_inf_weights_are_refused(made, tmp_path):
    """A NaN or infinity in a LoRA weight reaches every logit: LiteRT-LM sampled <pad> for ever (red team round 5,
    issue #65). A PEFT folder's is exit 2 (export and the adapter command), an adapter file's exit 5 (run), each
    naming the tensor."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from conftest import run_cli_many
    from torchtpu_export.llm.lora import read_adapter
    root, out = made[0], made[4]
    inf = tmp_path / "peft-inf"
    shutil.copytree(root / "peft", inf)
    weights = load_file(inf / "adapter_model.safetensors")
    key = sorted(k for k in weights if "lora_B" in k)[0]
    weights[key] = weights[key].copy()
    weights[key].flat[3] = np.inf
    save_file(weights, inf / "adapter_model.safetensors")
    huge = tmp_path / "peft-huge-alpha"  # finite weights, A times alpha / r past float32
    shutil.copytree(root / "peft", huge)
    config = json.loads((huge / "adapter_config.json").read_text())
    (huge / "adapter_config.json").write_text(json.dumps(dict(config, lora_alpha=1e300)))
    good = root / "llama.lora.tflite"
    name, (_, offset, _) = sorted(read_adapter(good)["tensors"].items())[0]
    data = bytearray(good.read_bytes())
    data[offset + 8:offset + 12] = np.float32(np.nan).tobytes()
    (tmp_path / "nan.lora.tflite").write_bytes(data)
    (tmp_path / "cut.lora.tflite").write_bytes(data[:offset])  # the flatbuffer, none of the data
    folder = root / "llama"
    export, command, alpha, nan, cut = run_cli_many([
        [folder, "--target", "litertlm", "--prefill-lengths", "8", "--cache-length", "64", "--lora", inf,
         "-o", tmp_path / "x.litertlm"],
        ["adapter", inf, "--base", out, "-o", tmp_path / "a.lora.tflite"],
        ["adapter", huge, "--base", out, "-o", tmp_path / "b.lora.tflite"],
        ["run", out, "--prompt", PROMPT, "--lora", tmp_path / "nan.lora.tflite"],
        ["run", out, "--prompt", PROMPT, "--lora", tmp_path / "cut.lora.tflite"]])
    for r in (export, command):
        assert r.returncode == 2 and key in r.stderr and "NaN or infinite" in r.stderr, r.stderr
    assert alpha.returncode == 2 and "past float32's range" in alpha.stderr, alpha.stderr
    assert nan.returncode == 5 and f"tensor {name!r} holds NaN or infinite values" in nan.stderr, nan.stderr
    assert cut.returncode == 5 and "is not float32 data of its shape inside the file" in cut.stderr, cut.stderr
    assert "b'" not in cut.stderr, cut.stderr  # the tensor's name as text, not a bytes literal
    assert not any(p.name.startswith(("x.", "a.", "b.")) for p in tmp_path.iterdir())
