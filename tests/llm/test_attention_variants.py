"""Attention variants whose caches are not one head_dim and num_key_value_heads for every layer: the cache
layout is what the model itself writes (``llm.step.probe_layout``), so DeepSeek's multi-head latent
attention keeps its compressed latent cache (the latent and the rotary key, not decompressed heads) and
Falcon's multi-query attention its one head; both targets, exported from the folder through the CLI, give
transformers' greedy tokens (the .tpu by generate, the bundle in LiteRT-LM's engine)."""
import pytest
import torch

import hf_llms
import torchtpu_export as tte

pytestmark = pytest.mark.xdist_group("llm_attention")  # a group of its own: nothing shared with test_llm_bundles' folders

PROMPT = "hello world, this is a tiny language model"
STEPS = 64
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
MLA = dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
           first_k_dense_replace=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12, num_key_value_heads=4, n_group=1, topk_group=1)
FAMILIES = {  # name -> (model_type, config, the cache shapes (heads, dim) of layer 0's key and value)
    "deepseek_v3": ("deepseek_v3", MLA, ((1, 16), (1, 8))),
    "deepseek_v2": ("deepseek_v2", MLA, ((1, 16), (1, 8))),
    "falcon_mqa": ("falcon", dict(multi_query=True), ((1, 16), (1, 16))),
}


def _model(family):
    from transformers import AutoConfig, AutoModelForCausalLM
    kind, extra, _ = FAMILIES[family]
    tok = hf_llms.tokenizer()
    config = AutoConfig.for_model(kind, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **SMALL, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval(), tok


def _greedy(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    out = out[0, len(ids):].tolist()
    return out[:out.index(2)] if 2 in out else out


def _cli_both(model, tok, folder, out, *options):
    """``model`` saved as a Hugging Face folder and exported from it through the CLI to ``out``.tpu (its cpu
    program, one slot) and ``out``.litertlm; each export's self-check passes."""
    from conftest import export_folder
    export_folder(model, tok, folder,
                  ["--target", "tpu", "--platforms", "cpu", "--batch-size", "1", *options, "-o", f"{out}.tpu"],
                  ["--target", "litertlm", *options, "-o", f"{out}.litertlm"])
    return tte.load(f"{out}.tpu"), tte.load(f"{out}.litertlm")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cache_layout_is_the_models_and_both_targets_give_transformers_tokens(family, tmp_path):
    model, tok = _model(family)
    ids = tok(PROMPT)["input_ids"]
    want = _greedy(model, ids)
    prog, bundle = _cli_both(model, tok, tmp_path / family, tmp_path / "m", "--prefill-lengths", "8,32",
                             "--cache-length", "96")
    spec = {s.name: list(s.shape) for s in prog.inputs("decode")}
    k, v = FAMILIES[family][2]
    assert spec["kv_cache_k_0"] == [1, k[0], 96, k[1]] and spec["kv_cache_v_0"] == [1, v[0], 96, v[1]], spec
    assert prog.generate(ids, STEPS).ids == want
    got = bundle.generate(PROMPT, STEPS)
    assert got.text == tok.decode(want), family  # LiteRT-LM's engine, its own loop and sampler


# families whose modules a step traces in another form of the same computation (llm.adapt), beyond SMALL
ADAPTED = {
    "bloom": dict(num_key_value_heads=2),  # ALiBi built from the step's 4-D mask
    "doge": dict(num_key_value_heads=2, intermediate_size=128),  # a mask per query head
    "jetmoe": dict(num_key_value_heads=2, intermediate_size=128),  # experts' group sizes as a Python list
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),  # a loop over experts hit
}


@pytest.mark.parametrize("family", list(ADAPTED))
def test_adapted_families_give_transformers_tokens_on_both_targets(family, tmp_path):
    """ALiBi (BLOOM), a mask per query head (Doge), and expert loops whose group sizes are data (JetMoE's
    mixture of attention heads and experts, DBRX's experts, stepped as one grouped matmul each): exported from
    the folder through the CLI (the self-check passes), the .tpu's generate and the bundle in LiteRT-LM give
    transformers' tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tok = hf_llms.tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **{**SMALL, **ADAPTED[family]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = tok(PROMPT)["input_ids"]
    want = _greedy(model, ids)
    prog, bundle = _cli_both(model, tok, tmp_path / family, tmp_path / "m", "--prefill-lengths", "8",
                             "--cache-length", "96")
    assert prog.generate(ids, STEPS).ids == want
    got = bundle.generate(PROMPT, STEPS)
    assert got.text == tok.decode(want).replace("\x00", ""), family  # LiteRT-LM's text: no NUL (C strings)
