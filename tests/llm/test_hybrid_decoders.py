"""Hybrid and recurrent decoders (Mamba and Mamba-2 mixers, gated delta nets, LFM2's short convolutions,
beside attention layers or alone): each recurrent layer's states, as the model keeps them through
transformers' cache protocol, are program state beside the KV cache (``kv_cache_c_<i>``,
``kv_cache_c_ssm_<i>``). The tpu and litert targets cut prompts into chunks they fill exactly (a padding token
would move the state); a LiteRT-LM bundle's steps find the real tokens of the chunk LiteRT-LM pads and keep
the states after the last of them. Every family gives transformers' greedy tokens from
`TpuProgram.generate` and from LiteRT-LM's engine over 64 steps; the serving engine keeps each slot's state
apart; the TPU compiler takes the program; a family whose layers keep their state another way is refused at
export, naming the layer."""
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from torchtpu_export.errors import InputError
from torchtpu_export.llm import host_generate

pytestmark = pytest.mark.xdist_group("llm_hybrid")  # a group of its own: nothing shared with test_llm_bundles' folders

PROMPT = "hello world, this is a tiny language model"
STEPS = 64
FAMILIES = hf_llms.HYBRID_FAMILIES
# the litert target's .tflite (exact chunks, prefill_1) for one family: the steps through the other converter
LITERT = ("lfm2",)


def _greedy(model, ids, steps=STEPS):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    return want[:want.index(2)] if 2 in want else want


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_families_carry_their_states_and_give_transformers_tokens(family, tmp_path):
    """Each family's folder exported through the CLI to tpu (one slot: the family's tokens; slots below)."""
    from conftest import export_folder
    model, tok = hf_llms.moe(family)
    ids = tok(PROMPT)["input_ids"]
    want = _greedy(model, ids)
    assert len(set(want)) > 2, want  # a reply that tells states kept from states lost
    out = tmp_path / f"{family}.tpu"
    export_folder(model, tok, tmp_path / family, ["--target", "tpu", "--platforms", "cpu", "--batch-size", "1",
                                                  "--prefill-lengths", "8", "--cache-length", "96", "-o", out])
    prog = tte.load(out)
    names = [s.name for s in prog.inputs("decode")]
    assert any(n.startswith("kv_cache_c_") for n in names), names
    assert prog.manifest["llm"]["prefill_lengths"] == [1, 8]  # a remainder of 1..7 tokens goes 1 at a time
    assert prog.generate(ids, STEPS).ids == want
    if family in LITERT:
        edge = tte.export_llm(model, tok, target="litert", prefill_lengths=(8,), cache_length=96)
        assert host_generate(edge, ids, len(want)) == want


@pytest.mark.xdist_group("llm_hybrid_litertlm")  # beside the tpu family tests, on the other worker
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_bundles_give_transformers_tokens_in_litert_lm(family, tmp_path):
    """The .litertlm of every hybrid family, exported from its folder through the CLI: LiteRT-LM carries the
    states (named as it carries caches) and pads a prompt's last chunk with token 0 at position 0; the steps
    count the real tokens and keep each state as it was after the last of them. No prefill_1 is needed; the
    export's self-check runs a padded chunk; the bundle's graph driven as LiteRT-LM drives it, and LiteRT-LM
    itself (one engine, two prompts: a new session starts from zero states, also when its prompt is the start
    token alone and its first step a decode), give transformers' tokens."""
    from conftest import export_folder
    model, tok = hf_llms.moe(family)
    out = tmp_path / f"{family}.litertlm"
    export_folder(model, tok, tmp_path / family, ["--target", "litertlm", "--prefill-lengths", "8", "--cache-length",
                                                  "128", "-o", out])
    bundle = tte.load(out)
    assert [n for n in bundle.signatures if n.startswith("prefill")] == ["prefill_8"]
    for prompt in (PROMPT, PROMPT + " and a few more words"):  # two remainders of the 8-token chunk
        ids = tok(prompt)["input_ids"]
        want = _greedy(model, ids)
        assert host_generate(bundle.edge, ids, len(want), padded=True) == want
        # LiteRT-LM's Python API gives text as C strings: a NUL character (a byte-level token) is left out
        assert bundle.generate(prompt, STEPS).text == tok.decode(want).replace("\x00", ""), prompt
    ids = tok("")["input_ids"]
    if len(ids) == 1:  # the start token alone: LiteRT-LM decodes at position 0, twice on one engine
        want = tok.decode(_greedy(model, ids, 12)).replace("\x00", "")
        assert [bundle.generate("", 12).text for _ in range(2)] == [want, want]


def test_slots_keep_their_own_states_and_the_tpu_compiler_takes_the_program():
    """Two requests at once in a 2-slot program: each slot's states are its own (a prompt prefilled on its
    own, inserted into the batch); a slot freed and taken again starts from zeros."""
    from torchtpu_export.engine import Engine
    model, tok = hf_llms.moe("granitemoehybrid")
    prompts = [tok(p)["input_ids"] for p in (PROMPT, "a different prompt, longer than the first one by far", "x")]
    wants = [_greedy(model, ids, 24) for ids in prompts]
    prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=96, batch_size=2,
                          platforms=("tpu", "cpu"))
    engine = Engine(prog)
    assert engine.slots == 2 and engine.exact and not engine.batch_lengths
    requests = [engine.submit(ids, 24, stop=(2,)) for ids in prompts]
    while engine.busy:
        engine.step()
    assert [r.tokens for r in requests] == wants
    stats = prog.compiled_stats("v5e", signature_name="decode_batch")
    assert stats["fits"]


@pytest.mark.parametrize("family,layer", [("recurrent_gemma", "RecurrentGemmaRglru"), ("rwkv", "RwkvSelfAttention"),
                                          ("minimax", "MiniMaxLightningAttention")])
def test_layers_that_keep_their_state_elsewhere_are_refused_naming_the_layer(family, layer):
    """RG-LRU blocks, RWKV and lightning attention keep their state outside transformers' cache protocol:
    refused at export (not a capture error, not a program that gives other tokens)."""
    extra = {"block_types": ["recurrent", "attention"], "lru_width": 64, "attention_window_size": 16} \
        if family == "recurrent_gemma" else {}
    model, tok = hf_llms.moe(family, **extra)
    with pytest.raises(InputError, match=f"{family} model with recurrent layers \\(.*{layer}.*cache protocol"):
        tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=64, platforms=("cpu",))
    with pytest.raises(InputError, match=f"{family} model with recurrent layers \\(.*{layer}"):
        tte.export_llm(model, tok, target="litertlm", prefill_lengths=(8,), cache_length=64)


def test_the_cli_exports_a_hybrid_folder_to_both_targets(tmp_path):
    """A Hugging Face folder of a hybrid model through the CLI: the .tpu carries its states (``inspect``
    says so) and gives transformers' tokens once loaded; so does the .litertlm in LiteRT-LM."""
    from conftest import run_cli_many
    model, tok = hf_llms.moe("falcon_h1")
    folder = tmp_path / "falcon_h1"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    ids = tok(PROMPT)["input_ids"]
    want = _greedy(model, ids, 32)
    out = tmp_path / "m.tpu"
    export, inspect, edge = run_cli_many([
        [folder, "--target", "tpu", "--platforms", "cpu", "--prefill-lengths", "8", "--cache-length", "64", "-o", out],
        ["inspect", out],
        [folder, "--target", "litertlm", "--prefill-lengths", "8", "--cache-length", "64", "-o", tmp_path / "m.litertlm"]])
    assert export.returncode == 0, export.stderr
    assert "recurrent states: 4 tensors" in inspect.stdout and "prefill lengths 1, 8" in inspect.stdout, inspect.stdout
    assert edge.returncode == 0, edge.stderr
    assert tte.load(out).generate(ids, 32).ids == want
    assert tte.load(tmp_path / "m.litertlm").generate(PROMPT, 32).text == tok.decode(want).replace("\x00", "")
