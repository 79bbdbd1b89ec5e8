"""LLMs to LiteRT-LM bundles: every architecture, built by transformers from a small config with seeded
random weights and a tokenizer made here, converted by the CLI from its model folder, run by LiteRT-LM's
own engine; greedy text equals transformers' ``generate(do_sample=False)`` on the same weights, for a raw
prompt, the chat template and a prompt longer than one prefill chunk. The same wrapper's programs on the
tpu and litert targets give the same tokens through the host loop."""
import json
import os

import numpy as np
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from conftest import run_cli
from torchtpu_export import llm

pytestmark = pytest.mark.xdist_group("llm")  # one worker: the folders and bundles are shared

STEPS = 64
SHORT = "the quick brown fox"
LONG = "hello world, this is a tiny language model and tokens are made locally from a small corpus of text"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("llms")
    return {arch: hf_llms.save_folder(arch, str(root / arch), chat_template=hf_llms.FAMILY_TEMPLATES.get(arch))
            for arch in hf_llms.MODELS}


def _reference(folder, prompt: str, chat: bool) -> str:
    """transformers' greedy continuation, up to (not including) a stop token, as text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
    else:
        ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)[0, len(ids):].tolist()
    stops = {model.config.eos_token_id, tok.eos_token_id}
    cut = next((i for i, t in enumerate(out) if t in stops), len(out))
    return tok.decode(out[:cut]), len(ids)


@pytest.mark.parametrize("arch", list(hf_llms.MODELS))
def test_bundle_runs_in_litert_lm_and_equals_transformers(arch, folders, tmp_path):
    out = tmp_path / f"{arch}.litertlm"
    r = run_cli(folders[arch], "--target", "litertlm", "--prefill-lengths", "8,32", "--cache-length", "160",
                "-o", out)
    assert r.returncode == 0, r.stderr
    assert "signatures prefill_8, prefill_32, decode" in r.stdout
    # the family's template style: its probe chats give transformers' ids in LiteRT-LM's conversation API
    assert "probe conversations rendered by LiteRT-LM's conversation API give transformers'" in r.stdout, r.stdout
    bundle = tte.load(out)
    assert bundle.signatures == ["prefill_8", "prefill_32", "decode"]
    io = {s.name: s for s in bundle.inputs("decode")}
    assert (io["tokens"].shape, io["input_pos"].shape, io["mask"].shape) == ((1, 1), (1,), (1, 1, 1, 160))
    assert [s.name for s in bundle.outputs("decode")][0] == "logits"
    for prompt, chat in ((SHORT, False), (SHORT, True), (LONG, False)):
        want, n_prompt = _reference(folders[arch], prompt, chat)
        if prompt is LONG:
            assert n_prompt > 32  # more than one prefill chunk
        got = bundle.generate(prompt, STEPS, chat=chat).text
        assert got == want, (arch, prompt, chat)


def test_cli_run_prompt_prints_the_text(folders, tmp_path):
    out = tmp_path / "qwen3.litertlm"
    assert run_cli(folders["qwen3"], "--target", "litertlm", "--prefill-lengths", "16", "--cache-length", "96",
                   "-o", out).returncode == 0
    want, _ = _reference(folders["qwen3"], SHORT, False)
    r = run_cli("run", out, "--prompt", SHORT, "--max-new-tokens", STEPS, "-q")
    assert r.returncode == 0, r.stderr
    from torchtpu_export.untrusted import printable
    assert r.stdout.rstrip("\n") == printable(want, newlines=True)
    r = run_cli("inspect", out)
    assert r.returncode == 0, r.stderr
    assert "section TFLiteModel" in r.stdout and "section HF_Tokenizer_Zlib" in r.stdout
    assert "llm metadata: max_num_tokens 96" in r.stdout and "DYNAMIC_UPDATE_SLICE" in r.stdout


@pytest.mark.parametrize("target", ["tpu", "litert"])
def test_the_same_wrapper_serves_other_targets(target):
    model, tok = hf_llms.build("llama")
    ids = tok(LONG)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    options = {"platforms": ("cpu",)} if target == "tpu" else {}
    prog = tte.export_llm(model, tok, target=target, prefill_lengths=(8, 16), cache_length=96, **options)
    want_sigs = ["decode", "prefill_16", "prefill_8"]
    if target == "tpu":  # served batched by default: 8 slots (decode_batch, prefill_batch_<N>) beside decode, and
        # a batch of 4 for a light load (decode_batch_4)
        want_sigs += ["decode_batch", "decode_batch_4", "prefill_batch_16", "prefill_batch_8"]
        assert next(s for s in prog.inputs("decode_batch") if s.name == "tokens").shape[0] == 8
    assert sorted(prog.signatures) == sorted(want_sigs)
    got = llm.host_generate(prog, ids, 16, stop_ids=[2])
    assert got == want[:len(got)] and len(got) >= 8


def test_cache_writes_are_one_block_from_the_first_position():
    """A padded prefill chunk writes its block from input_pos[0]: padding lands after the real tokens."""
    model, tok = hf_llms.build("qwen3")
    edge = tte.export_llm(model, tok, target="litert", prefill_lengths=(8,), cache_length=32)
    layout = llm.CacheLayout.of(model.config, 32)
    feed = {k: v.numpy() for k, v in llm.step_inputs(layout, 8).items()}
    feed["input_pos"] = np.arange(5, 13, dtype=np.int32)
    feed["tokens"] = np.array([[5, 6, 7, 0, 0, 0, 0, 0]], np.int32)
    feed["kv_cache_k_0"] = np.full(feed["kv_cache_k_0"].shape, 7.0, np.float32)
    out = edge(signature_name="prefill_8", **feed)
    k = out["kv_cache_k_0"][0, 0, :, 0]
    assert np.all(k[:5] == 7.0) and np.all(k[13:] == 7.0) and np.all(k[5:13] != 7.0)


def test_chat_template_takes_content_parts():
    from jinja2 import Template
    t = llm.parts_template(hf_llms.CHAT_TEMPLATE)
    as_parts = Template(t).render(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                                  add_generation_prompt=True)
    as_text = Template(hf_llms.CHAT_TEMPLATE).render(messages=[{"role": "user", "content": "ab"}],
                                                     add_generation_prompt=True)
    assert as_parts == as_text == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


# ---- bad input: one message, exit 2, nothing written -------------------------------------------

def _copy_without(src, dst, *drop):
    import shutil
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in drop])
    return str(dst)


def _fails(tmp_path, *args, code=2, says=""):
    out = tmp_path / "out.litertlm"
    r = run_cli(*args, "-o", out)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stderr.startswith("error:"), r.stderr
    assert says in r.stderr, r.stderr
    assert not out.exists()
    return r.stderr


def test_missing_tokenizer(folders, tmp_path):
    d = _copy_without(folders["llama"], tmp_path / "m", "tokenizer.json")
    _fails(tmp_path, d, "--target", "litertlm", says="has no tokenizer.json")


def test_missing_weights_and_pickles_never_loaded(folders, tmp_path):
    d = _copy_without(folders["llama"], tmp_path / "m", "model.safetensors")
    open(os.path.join(d, "pytorch_model.bin"), "wb").write(b"\x80\x04not loaded")
    _fails(tmp_path, d, "--target", "litertlm", says="pickles, never loaded")


def test_unknown_and_non_causal_architectures(folders, tmp_path):
    d = _copy_without(folders["llama"], tmp_path / "m", "config.json")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "no_such_architecture"}, f)
    _fails(tmp_path, d, "--target", "litertlm", says="transformers does not know this architecture")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "bert", "vocab_size": 64}, f)
    _fails(tmp_path, d, "--target", "litertlm", says="do not match")
    with open(os.path.join(d, "config.json"), "w") as f:  # an encoder-decoder: not a causal LM transformers builds
        json.dump({"model_type": "t5", "vocab_size": 64}, f)
    _fails(tmp_path, d, "--target", "litertlm", says="not a causal LM architecture")


def test_prefill_longer_than_the_cache(folders, tmp_path):
    _fails(tmp_path, folders["qwen3"], "--target", "litertlm", "--prefill-lengths", "64",
           "--cache-length", "32", says="above the cache length")
    _fails(tmp_path, folders["qwen3"], "--target", "litertlm", "--cache-length", "4096",
           says="max_position_embeddings")


def test_not_a_folder_and_damaged_bundles(folders, tmp_path):
    _fails(tmp_path, tmp_path / "nowhere", "--target", "litertlm", says="neither a Hugging Face model folder")
    bad = tmp_path / "bad.litertlm"
    bad.write_bytes(b"LITERTLM" + b"\x01\x00\x00\x00" * 4 + (10 ** 12).to_bytes(8, "little") + b"\0" * 64)
    r = run_cli("inspect", bad)
    assert r.returncode == 5 and "outside the file" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- quantization for LLMs -----------------------------------------------------------------------

@pytest.mark.parametrize("block", [32, 64])
def test_int4_blockwise_linear_is_the_dequantized_matmul(block):
    """LiteRT's blockwise int4 kernel on our file computes x @ dequant(W): the only error beyond the
    weights' rounding is the runtime's dynamic quantization of the activations."""
    from converters.litert.quantize import blockwise_int4
    torch.manual_seed(0)
    m = torch.nn.Linear(256, 64).eval()
    x = torch.randn(3, 256)
    edge = tte.convert(m, (x,), quant_config={"recipe": "int4_blockwise", "block_size": block})
    q, s = blockwise_int4(m.weight.detach().numpy(), block)
    assert s.shape == (64, 256 // block) and s.dtype == np.float16 and q.min() >= -8 and q.max() <= 7
    w = (q.astype(np.float32).reshape(64, -1, block) * s.astype(np.float32)[..., None]).reshape(64, 256)
    want = x.numpy() @ w.T + m.bias.detach().numpy()
    got = edge(x)
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    assert edge.quant_report.quant_bytes < edge.quant_report.float_bytes / 5  # 4 bits + a scale per block
    from torchtpu_export.targets.litert.artifact import validate
    model = validate(edge.model_content())
    sub = model.Subgraphs(0)
    types = {sub.Tensors(j).Type() for j in range(sub.TensorsLength())}
    from ai_edge_litert import schema_py_generated as fb
    assert fb.TensorType.INT4 in types


def test_quantized_bundles_run_in_litert_lm(folders, tmp_path):
    for recipe in ("dynamic_int8", "int4_blockwise"):
        out = tmp_path / f"{recipe}.litertlm"
        r = run_cli(folders["qwen3"], "--target", "litertlm", "--prefill-lengths", "16", "--cache-length", "96",
                    "--quantize", recipe, "-o", out)
        assert r.returncode == 0, r.stderr
        bundle = tte.load(out)
        text = bundle.generate(SHORT, 16).text
        ids = bundle.engine().tokenize(SHORT)
        from transformers import AutoTokenizer
        want = AutoTokenizer.from_pretrained(folders["qwen3"]).decode(llm.host_generate(bundle.edge, ids, 16, [2]))
        assert text == want, recipe  # the engine runs the quantized graph our interpreter runs


def test_blockwise_scales_out_of_range_are_refused():
    from ai_edge_litert import schema_py_generated as fb
    from torchtpu_export.errors import ArtifactError
    from torchtpu_export.targets.litert.artifact import validate
    import flatbuffers
    m = torch.nn.Linear(64, 32).eval()
    content = tte.convert(m, (torch.randn(1, 64),), quant_config="int4_blockwise").model_content()
    model = fb.ModelT.InitFromPackedBuf(bytearray(content), 0)
    for t in model.subgraphs[0].tensors:
        if t.quantization is not None and t.quantization.details is not None:
            t.quantization.details.scales = 10_000
    b = flatbuffers.Builder(0)
    b.Finish(model.Pack(b), b"TFL3")
    with pytest.raises(ArtifactError, match="blockwise quantization naming tensors 10000"):
        validate(bytes(b.Output()))
