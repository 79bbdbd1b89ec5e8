"""LLM generation on the tpu target with the KV cache on the device: the programs export_llm makes
donate their caches (recorded in the manifest, so the TPU compiler aliases them in place), generate()
samples on the device and moves only token ids, and greedy tokens equal transformers'."""
import numpy as np
import pytest
import torch

import hf_llms
import torchtpu_export as tte

pytestmark = pytest.mark.xdist_group("llm")

PROMPT = "hello world, this is a tiny language model and tokens are made locally from a small corpus"


@pytest.fixture(scope="module")
def exported():
    out = {}
    for arch in ("llama", "qwen3"):
        model, tok = hf_llms.build(arch)
        prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8, 32), cache_length=96,
                              platforms=("tpu", "cpu"))
        out[arch] = (model, tok, prog)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_with_the_cache_on_the_device(arch, exported, tmp_path):
    import jax
    model, tok, prog = exported[arch]
    ids = tok(PROMPT)["input_ids"]
    assert len(ids) > 8
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    path = tmp_path / f"{arch}.tpu"
    prog.save(path)
    loaded = tte.load(path)
    # any implicit host<->device transfer (a cache going through numpy) raises; the loop's own are explicit
    with jax.transfer_guard("disallow"):
        got = loaded.generate(ids, 40, stop=[2]).ids
    assert got == want[:len(got)] and (len(got) == 40 or want[len(got)] == 2)


def test_sampling_is_seeded_and_stays_in_the_top_k(exported):
    model, tok, prog = exported["llama"]
    ids = tok("the quick brown fox")["input_ids"]
    a = prog.generate(ids, 12, temperature=1.0, top_k=5, seed=3)
    b = prog.generate(ids, 12, temperature=1.0, top_k=5, seed=3)
    assert a == b and len(a.ids) == 12
    # top_k=1 at any temperature is greedy
    assert prog.generate(ids, 12, temperature=2.0, top_k=1) == prog.generate(ids, 12)


def test_donation_is_recorded_and_bad_requests_say_so(exported):
    model, tok, prog = exported["qwen3"]
    spec = prog.manifest["programs"]["decode"]
    names = [s["name"] for s in spec["inputs"]]
    assert [names[i] for i in spec["donate"]] == [n for n in names if n.startswith("kv_cache_")]
    from torchtpu_export.errors import InputError
    with pytest.raises(InputError, match="do not fit the cache"):
        prog.generate([1] * 90, 20)
    with pytest.raises(InputError, match="top_p"):
        prog.generate([1, 2], 2, top_p=1.5)


@pytest.mark.parametrize("topology", ["v5e", "v6e"])
def test_the_tpu_compiler_aliases_the_cache(exported, topology):
    """The decode program compiled by libtpu for one v5e / v6e chip updates its cache in place: the
    compiler's memory analysis reports aliased bytes of at least the whole cache."""
    model, tok, prog = exported["llama"]
    spec = prog.manifest["programs"]["decode"]
    cache_bytes = sum(int(np.prod(spec["inputs"][i]["shape"])) * 4 for i in spec["donate"])
    stats = prog.compiled_stats(topology, signature_name="decode")
    assert stats["hbm_bytes"]["aliased"] >= cache_bytes > 0


def test_bf16_serving_keeps_the_cache_in_bf16_and_halves_the_compiled_memory(exported):
    """quant_config="bf16" on the tpu target: weights, activations and the KV cache in bfloat16. The engine
    serves it on two slots, its greedy predictions agree with float's, and libtpu's decode step holds half
    the argument bytes, the bf16 cache still aliased in place."""
    model, tok, prog = exported["llama"]
    bf16 = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8, 32), cache_length=96, batch_size=2,
                          quant_config="bf16", platforms=("tpu", "cpu"))
    caches = [i for i in bf16.inputs("decode_batch") if i.name.startswith("kv_cache_")]
    assert caches and {i.dtype for i in caches} == {"bfloat16"} and caches[0].shape[0] == 2
    from torchtpu_export.engine import Engine
    from torchtpu_export.llm import next_token_logits
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0].tolist()
        want = model(torch.tensor([seq])).logits[0, len(ids) - 1:-1].argmax(-1).numpy()
    got = next_token_logits(bf16, seq, len(ids) - 1)[:len(want)].astype(np.float32).argmax(-1)
    assert np.mean(got == want) >= 0.9
    engine = Engine(bf16)
    a, b = engine.submit(ids, 12), engine.submit(ids[:9], 12)
    while engine.step():
        pass
    assert a.result() == bf16.generate(ids, 12, stop=()).ids and len(b.result()) == 12
    f32, half = (p.compiled_stats("v5e", signature_name="decode") for p in (prog, bf16))
    spec = bf16.manifest["programs"]["decode"]
    cache_bytes = sum(int(np.prod(spec["inputs"][i]["shape"])) * 2 for i in spec["donate"])
    assert half["hbm_bytes"]["aliased"] >= cache_bytes > 0
    # weights and caches (the arguments) halve; a tiny model's total is mostly the compiler's scratch
    assert half["hbm_bytes"]["arguments"] <= 0.55 * f32["hbm_bytes"]["arguments"]


def test_one_generate_for_every_llm_artifact(exported, tmp_path):
    """A .tpu from export_llm takes the prompt as text or ids, gives text and ids; `run --prompt` prints the
    reply; an artifact that holds no LLM says so."""
    from conftest import run_cli
    model, tok, prog = exported["qwen3"]
    ids = tok(PROMPT)["input_ids"]
    by_ids = prog.generate(ids, 10, stop=())
    by_text = prog.generate(PROMPT, 10, stop=())
    assert by_text.ids == by_ids.ids and len(by_ids.ids) == 10 and by_ids.finish_reason == "length"
    assert by_text.text == tok.decode(by_ids.ids, skip_special_tokens=True) == str(by_text)
    path = tmp_path / "qwen3.tpu"
    prog.save(path)
    r = run_cli("run", path, "--prompt", PROMPT, "--max-new-tokens", "10")
    assert r.returncode == 0, r.stderr
    from torchtpu_export.untrusted import printable  # the reply is printed with terminal controls escaped
    assert printable(prog.generate(PROMPT, 10).text, newlines=True) in r.stdout
    assert "generated in" in r.stderr + r.stdout
    plain = tte.export(torch.nn.Linear(4, 4), (torch.randn(1, 4),), target="tpu", platforms=("cpu",))
    plain.save(tmp_path / "linear.tpu")
    r = run_cli("run", tmp_path / "linear.tpu", "--prompt", "hi")
    assert r.returncode == 2 and "holds no LLM" in r.stderr and "Traceback" not in r.stderr, r.stderr
    from torchtpu_export.errors import InputError
    with pytest.raises(InputError, match="token ids"):
        prog.generate([1, -3], 4)


def test_generate_follows_a_response_format(exported):
    """Constrained decoding on the tpu target: the grammar's mask applied in the decode step on the device."""
    import json
    import re
    model, tok, prog = exported["qwen3"]
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 5},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["word", "n"], "additionalProperties": False}
    reply = prog.generate("hello", 60, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    value = json.loads(reply.text)
    assert set(value) == {"word", "n"} and 0 <= value["n"] <= 99 and reply.finish_reason == "stop"
    reply = prog.generate("hello", 20, temperature=1.0, seed=4, response_format={"type": "regex", "pattern": "[a-c]{4}"})
    assert re.fullmatch("[a-c]{4}", reply.text), reply
    from torchtpu_export.errors import InputError
    with pytest.raises(InputError, match="response_format must be"):
        prog.generate("hello", 4, response_format={"type": "yaml"})


@pytest.mark.parametrize("arch", list(hf_llms.MODELS))
def test_every_dense_family_gives_transformers_tokens_over_64_steps(arch, tmp_path):
    """Each dense family of examples/hf_llms.py, its folder exported through the CLI to the tpu target (its
    cpu program, one slot: the family's tokens; batches: test_serving): TpuProgram.generate's greedy tokens
    equal transformers' over 64 steps, the prompt longer than the shorter prefill chunk."""
    from conftest import run_cli_many
    model, tok = hf_llms.build(arch)
    tok.chat_template = hf_llms.FAMILY_TEMPLATES.get(arch, tok.chat_template)  # the family's template style
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   return_dict=True)["input_ids"]
    wants = []
    for ids in (tok(PROMPT)["input_ids"], chat):
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, pad_token_id=0)
        want = want[0, len(ids):].tolist()
        wants.append(want[:want.index(2)] if 2 in want else want)
    out = tmp_path / f"{arch}.tpu"
    model.save_pretrained(tmp_path / arch)
    tok.save_pretrained(tmp_path / arch)
    r, = run_cli_many([[tmp_path / arch, "--target", "tpu", "--platforms", "cpu", "--batch-size", "1",
                        "--prefill-lengths", "8,32", "--cache-length", "192", "-o", out]])
    assert r.returncode == 0 and "checked against transformers on a probe prompt" in r.stdout, r.stderr
    assert "probe conversations rendered by the server's text workers give transformers'" in r.stdout, r.stdout
    program = tte.load(out)
    assert program.generate(tok(PROMPT)["input_ids"], 64).ids == wants[0]
    assert program.generate(PROMPT, 64, chat=True).ids == wants[1]  # run --chat's way: the template, the text worker
