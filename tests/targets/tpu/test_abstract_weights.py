"""Export with abstract weights: a decoder built under ``tte.abstract_weights()`` (parameters on the meta
device, nothing allocated) exports to the tpu target, compiles and is inspected without values, refuses
to run, and runs once a Hugging Face checkpoint's values are bound, giving transformers' greedy tokens."""
import numpy as np
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from torchtpu_export.describe import describe
from torchtpu_export.errors import InputError

pytestmark = pytest.mark.xdist_group("llm")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model, tok = hf_llms.build("qwen3")
    folder = str(tmp_path_factory.mktemp("ckpt"))
    model.save_pretrained(folder)  # safetensors, the tied lm_head stored once
    with tte.abstract_weights():
        abstract = type(model)(model.config).eval()
    assert all(p.is_meta for p in abstract.parameters())
    return model, tok, abstract, folder


@pytest.mark.parametrize("recipe", [None, "int8_weight_only"])
def test_abstract_export_compiles_and_runs_once_bound(qwen3, recipe, tmp_path):
    model, tok, abstract, folder = qwen3
    prog = tte.export_llm(abstract, tok, target="tpu", prefill_lengths=(8, 32), cache_length=96, batch_size=1,
                          quant_config=recipe, platforms=("tpu", "cpu"))
    assert prog.abstract_weights and prog.quant_report is None
    path = tmp_path / "abstract.tpu"
    prog.save(path)
    loaded = tte.load(path)
    desc = describe(str(path))
    assert desc["entries"]["weights.safetensors"] < 1024  # no values stored: programs and manifest only
    # the RoPE frequencies, buffers computed from the config, keep their values
    assert desc["weights"]["abstract"] == len(loaded.abstract_weights) < desc["weights"]["count"]
    stats = loaded.compiled_stats("v5e", signature_name="decode")  # libtpu compiles against shapes alone
    assert stats["hbm_bytes"]["aliased"] > 0 and stats["fits"]
    with pytest.raises(InputError, match="abstract"):
        loaded.generate([1, 2, 3], 4)
    bound = loaded.bind_weights(folder)
    assert not bound.abstract_weights
    ids = tok("hello world, this is a tiny language model")["input_ids"]
    if recipe is None:
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert bound.generate(ids, 24).ids == want
    else:  # the same program as exporting the real model with the recipe
        ref = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8, 32), cache_length=96, batch_size=1,
                             quant_config=recipe, platforms=("cpu",))
        assert bound.generate(ids, 24) == ref.generate(ids, 24)
    bound.save(tmp_path / "bound.tpu")
    assert not tte.load(tmp_path / "bound.tpu").abstract_weights


def test_abstract_weights_bad_uses_say_so(qwen3, tmp_path):
    model, tok, abstract, folder = qwen3
    with tte.abstract_weights():
        linear = torch.nn.Linear(4, 4)
    for target in ("litert", "onnx"):
        with pytest.raises(InputError, match="has no values"):
            tte.export(linear, (torch.zeros(1, 4),), target=target)
    prog = tte.export_llm(abstract, tok, target="tpu", prefill_lengths=(8,), cache_length=32, platforms=("cpu",))
    state = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}
    with pytest.raises(InputError, match="not in the checkpoint"):
        prog.bind_weights(state)
    state = dict(model.state_dict())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(InputError, match="the program takes"):
        prog.bind_weights(state)
    with pytest.raises(InputError, match="does not exist"):
        prog.bind_weights(tmp_path / "nowhere.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(tte.ArtifactError, match="not a valid safetensors"):
        prog.bind_weights(tmp_path / "bad.safetensors")
    with pytest.raises(InputError, match="already have values"):
        prog.bind_weights(model.state_dict()).bind_weights(model.state_dict())


def test_cli_exports_a_config_only_folder(qwen3, cli, tmp_path):
    model, tok, abstract, folder = qwen3
    config_only = tmp_path / "config_only"
    model.config.save_pretrained(config_only)  # config.json, no weights
    tok.save_pretrained(config_only)
    out = tmp_path / "q.tpu"
    r = cli(config_only, "--target", "tpu", "--abstract-weights", "--prefill-lengths", "8", "--cache-length", "32",
            "-o", out)
    assert r.returncode == 0, r.stderr
    r = cli("inspect", out)
    assert r.returncode == 0 and "abstract" in r.stdout, r.stdout + r.stderr
    r = cli(config_only, "--target", "litertlm", "--abstract-weights", "--prefill-lengths", "8", "--cache-length", "32",
            "-o", tmp_path / "q.litertlm")
    assert r.returncode == 2 and "has no values" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "q.litertlm").exists()
    r = cli(config_only, "--target", "tpu", "-o", tmp_path / "r.tpu")  # without the flag the weights are needed
    assert r.returncode == 2 and "no .safetensors weights" in r.stderr


def test_a_float32_checkpoint_binds_to_a_bf16_program_cast_as_read(qwen3, tmp_path):
    """bf16 serving from a float32 checkpoint: the weights stay memory-mapped and are cast as each is read
    (one at a time, or a process's own slices), never held cast all at once; the bound program runs like
    the same model exported with its values."""
    from torchtpu_export.safetensors_io import CastOnRead
    model, tok, abstract, folder = qwen3
    prog = tte.export_llm(abstract, tok, target="tpu", prefill_lengths=(8,), cache_length=48, quant_config="bf16",
                          platforms=("cpu",))
    bound = prog.bind_weights(folder)
    lazy = [n for n, w in bound.artifact.weights.items() if isinstance(w, CastOnRead)]
    assert lazy and all(bound.artifact.weights[n].dtype.name == "bfloat16" for n in lazy)
    w = bound.artifact.weights[lazy[0]]
    np.testing.assert_array_equal(w[:1], np.asarray(w)[:1])  # a slice casts alone, as the whole does
    ids = tok("hello world, this is a tiny language model")["input_ids"]
    ref = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=48, quant_config="bf16",
                         platforms=("cpu",))
    assert bound.generate(ids, 12) == ref.generate(ids, 12)
    bound.save(tmp_path / "bound.tpu")  # written one weight at a time
    assert tte.load(tmp_path / "bound.tpu").generate(ids, 12) == ref.generate(ids, 12)
