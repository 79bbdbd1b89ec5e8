"""A held-out sweep of transformers causal-LM families that the tests do not name, on both targets.

    python -m benchmarks.families [-o benchmarks/RESULTS-families.md] [--families starcoder2,olmo2]

Each family is built as a new user would: ``AutoConfig.for_model(model_type, <small shapes>)``, seeded random
weights, the local tokenizer of ``examples/hf_llms.py``; then ``tte.export_llm`` to ``tpu`` (its cpu
program, ``TpuProgram.generate``) and to ``litertlm`` (the bundle's own graph driven as LiteRT-LM drives it,
``llm.host_generate``, then LiteRT-LM's engine on the saved bundle), 24 greedy tokens each, against
transformers' ``generate(do_sample=False)``. One process per family (a crash is a row, not the end of the
sweep). A family whose tiny config transformers
itself cannot build or generate from is listed apart, not counted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# model types the tests do not name (tests name llama, qwen2, qwen3, gemma3, phi3, mistral, smollm, the
# mixture-of-experts and hybrid families of examples/hf_llms.py, deepseek_v2/v3, falcon, the refused recurrent
# ones, and bloom, doge, jetmoe and dbrx, which this sweep found failing and tests/llm/test_attention_variants.py names)
HELD_OUT = ["starcoder2", "olmo", "olmo2", "olmo3", "cohere", "cohere2", "glm", "glm4", "stablelm", "gpt_neox",
            "gptj", "gpt2", "opt", "granite", "nemotron", "exaone4", "helium", "arcee", "persimmon", "phi",
            "codegen", "gpt_bigcode", "ministral", "seed_oss", "smollm3", "hunyuan_v1_dense", "hunyuan_v1_moe",
            "dots1", "ernie4_5", "ernie4_5_moe", "apertus", "glm4_moe", "phimoe",
            "gemma", "gemma2", "llama4_text", "bitnet", "flex_olmo"]
# hybrid and recurrent families the tests do not name (``--families`` picks them)
HELD_OUT_HYBRID = ["bamba", "zamba2", "falcon_mamba", "olmo_hybrid", "lfm2_moe"]
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512)
# what a family's tiny config needs besides SMALL for transformers itself to build and run it (its defaults
# are sized for the published model: a rotary dim or head dim above the tiny one, no RoPE base)
OVERRIDES = {"gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8), "helium": dict(head_dim=16),
             "ministral": dict(head_dim=16), "hunyuan_v1_dense": dict(head_dim=16),
             "hunyuan_v1_moe": dict(head_dim=16, num_experts=4, moe_topk=2),
             "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                           n_group=1, topk_group=1, first_k_dense_replace=1),
             "dbrx": dict(d_model=64, n_heads=4, n_layers=2,
                          attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
             "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                           mamba_chunk_size=8),
             "zamba2": dict(mamba_headdim=16, mamba_d_state=16, n_mamba_heads=8, chunk_size=8,
                            layers_block_type=["mamba", "hybrid"], attention_head_dim=16),
             "falcon_mamba": dict(state_size=8, conv_kernel=4, expand=2, time_step_rank=8),
             "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
             "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, num_dense_layers=0)}
STEPS = 24

ONE = r"""
import json, sys, torch
from examples import hf_llms
import torchtpu_export as tte
from torchtpu_export.llm import host_generate
kind, small, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
from transformers import AutoConfig, AutoModelForCausalLM
tok = hf_llms.tokenizer()
res = {"family": kind}
try:
    config = AutoConfig.for_model(kind, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0, **small)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = tok("hello world, this is a tiny language model")["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(ids):].tolist()
except Exception as e:
    res["unbuildable"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    print("RESULT " + json.dumps(res)); sys.exit(0)
for target in ("tpu", "litertlm"):
    try:
        art = tte.export_llm(model, tok, target=target, prefill_lengths=(8, 32), cache_length=96, check=False,
                             **({"platforms": ("cpu",)} if target == "tpu" else {}))
        got = art.generate(ids, steps, stop=()).ids if target == "tpu" else \
            host_generate(art.edge, ids, steps, padded=True)  # chunks padded as LiteRT-LM pads them
        res[target] = "same tokens" if got == want else \
            f"other tokens from step {next(i for i, (a, b) in enumerate(zip(got + [None] * steps, want)) if a != b)}"
        if target == "litertlm" and got == want:  # and LiteRT-LM itself (its text, to the first stop token)
            import tempfile
            path = tempfile.mkdtemp() + "/m.litertlm"
            art.save(path)
            ref = tok.decode(want[:want.index(2)] if 2 in want else want).replace("\x00", "")
            if tte.load(path).generate("hello world, this is a tiny language model", steps).text != ref:
                res[target] = "LiteRT-LM's text differs"
    except Exception as e:
        res[target] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
print("RESULT " + json.dumps(res))
"""


def one(kind: str) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        proc = subprocess.run([sys.executable, "-c", ONE, kind, json.dumps({**SMALL, **OVERRIDES.get(kind, {})}),
                               str(STEPS)], capture_output=True,
                              text=True, cwd=REPO, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return {"family": kind, "tpu": "timed out", "litertlm": "timed out"}
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if found:
        return json.loads(found[-1][len("RESULT "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return {"family": kind, "tpu": f"crashed: {tail}", "litertlm": f"crashed: {tail}"}


def report(rows: list[dict], argv: list[str]) -> str:
    built = [r for r in rows if "unbuildable" not in r]
    both = sum(r.get("tpu") == "same tokens" and r.get("litertlm") == "same tokens" for r in built)
    lines = [f"# Held-out families ({datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores)", "",
             f"`python -m benchmarks.families {' '.join(argv)}`".replace(" `", "`"), "",
             f"{both} of {len(built)} families give transformers' {STEPS} greedy tokens on both targets "
             f"({sum(r.get('tpu') == 'same tokens' for r in built)} on tpu, "
             f"{sum(r.get('litertlm') == 'same tokens' for r in built)} on litertlm); {len(rows) - len(built)} "
             "tiny configs transformers itself cannot build or generate from are listed apart.", "",
             "| family | tpu | litertlm |", "|---|---|---|"]
    for r in built:
        lines.append(f"| {r['family']} | {r.get('tpu', '')} | {r.get('litertlm', '')} |")
    if len(built) < len(rows):
        lines += ["", "Not counted (transformers fails on the tiny config):", ""]
        lines += [f"- {r['family']}: {r['unbuildable']}" for r in rows if "unbuildable" in r]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from benchmarks import publish
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(HELD_OUT))
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args(argv)
    rows = []
    for kind in args.families.split(","):
        rows.append(one(kind))
        print(json.dumps(rows[-1]), flush=True)
    text = report(rows, sys.argv[1:] if argv is None else argv)
    return publish(text, args.output)


if __name__ == "__main__":
    sys.exit(main())
