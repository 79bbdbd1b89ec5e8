"""Mixture-of-experts decoders on both targets: transformers' expert dispatch (its `grouped_mm` experts, an
op of its own, `transformers::grouped_mm_fallback`) is lowered as one ragged matmul on tpu
(`jax.lax.ragged_dot`) and as a gather of each routed row's expert weights and a batched matmul on litert;
top-k softmax routing, normalized or not, shared experts (qwen2_moe), gpt-oss's attention sinks, router
and expert biases and clamped SwiGLU. Every family gives transformers' greedy
tokens from `TpuProgram.generate` and from LiteRT-LM's engine; the tpu program compiles with libtpu; a
family not exported right yet is refused at export, naming why."""
import pytest
import torch

import hf_llms
import torchtpu_export as tte
from torchtpu_export.errors import InputError
from torchtpu_export.llm import host_generate

pytestmark = pytest.mark.xdist_group("llm_moe")  # a group of its own: nothing shared with test_llm_bundles' folders

PROMPT = "hello world, this is a tiny language model"
STEPS = 64
FAMILIES = hf_llms.MOE_FAMILIES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_gives_transformers_tokens_on_both_targets(family, tmp_path):
    """Each family's folder exported through the CLI to both targets (the self-check passes): the .tpu's
    generate, the bundle's graph driven as LiteRT-LM drives it, and LiteRT-LM itself give transformers'
    tokens."""
    from conftest import export_folder
    model, tok = hf_llms.moe(family)
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    want = want[:want.index(2)] if 2 in want else want
    common = ["--prefill-lengths", "8,32", "--cache-length", "96"]
    platforms = "tpu,cpu" if family == "qwen3_moe" else "cpu"  # the TPU compiler takes the ragged matmul
    export_folder(model, tok, tmp_path / family,  # one slot: the family's tokens (batches: test_serving)
                  ["--target", "tpu", "--platforms", platforms, "--batch-size", "1", *common, "-o", tmp_path / "m.tpu"],
                  ["--target", "litertlm", *common, "-o", tmp_path / "m.litertlm"])
    prog = tte.load(tmp_path / "m.tpu")
    ops = prog.manifest["programs"]["decode"]["op_histogram"]
    assert ops.get("transformers.grouped_mm_fallback.default") == 4, ops  # two projections per MoE layer
    assert prog.generate(ids, STEPS).ids == want
    if family == "qwen3_moe":
        assert prog.compiled_stats("v5e", signature_name="decode")["fits"]
    bundle = tte.load(tmp_path / "m.litertlm")
    assert host_generate(bundle.edge, ids, len(want)) == want  # the bundle's own graph, driven as LiteRT-LM does
    # LiteRT-LM's engine, its own loop and sampler (its text streamed: a NUL character is left out)
    assert bundle.generate(PROMPT, STEPS).text == tok.decode(want).replace("\x00", "")


def test_a_family_not_exported_right_yet_is_refused(monkeypatch):
    from torchtpu_export.llm import source
    monkeypatch.setitem(source.NOT_YET, "mixtral", "its experts are not exported right yet")
    model, tok = hf_llms.moe("mixtral")
    with pytest.raises(InputError, match="mixtral model: its experts are not exported right yet"):
        tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=64)


@pytest.mark.parametrize("recipe", ["dynamic_int8", "int4_blockwise"])
def test_quantized_recipes_store_the_experts_in_int8(recipe, tmp_path):
    """Both weight recipes quantize the experts (int8, one scale per expert and output column; LiteRT's int4
    kernels are FULLY_CONNECTED's): the decode step gathers its experts' int8 values (no float copy of the
    table), the bundle is under half the float one, and it still follows the float model, in LiteRT-LM too."""
    import numpy as np
    from ai_edge_litert import schema_py_generated as schema

    from torchtpu_export import llm
    model, tok = hf_llms.moe("qwen3_moe", moe_intermediate_size=128)
    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        seq = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0].tolist()
    sizes = {}
    for q in (None, recipe):
        bundle = tte.export_llm(model, tok, target="litertlm", prefill_lengths=(8,), cache_length=64, quant_config=q)
        bundle.save(tmp_path / f"{q}.litertlm")
        sizes[q] = (tmp_path / f"{q}.litertlm").stat().st_size
    assert sizes[recipe] < 0.5 * sizes[None], sizes
    m = schema.ModelT.InitFromPackedBuf(bytes(bundle.edge.model_content()), 0)
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    decode = next(g for g in m.subgraphs if g.name == b"decode")
    gathered = [decode.tensors[op.inputs[0]] for op in decode.operators
                if names[m.operatorCodes[op.opcodeIndex].builtinCode] == "GATHER"
                and len(decode.tensors[op.inputs[0]].shape) == 3 and decode.tensors[op.inputs[0]].shape[1] > 1]
    assert len(gathered) == 4 and all(t.type == schema.TensorType.INT8 for t in gathered)  # 2 layers x 2 projections
    assert not any(names[m.operatorCodes[op.opcodeIndex].builtinCode] == "DEQUANTIZE"
                   and len(decode.tensors[op.inputs[0]].shape) == 3 for op in decode.operators)
    got = llm.next_token_logits(bundle.edge, seq, len(ids) - 1)[:-1]
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0, len(ids) - 1:-1].numpy()
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.75
    text = tte.load(tmp_path / f"{recipe}.litertlm").generate(PROMPT, 8).text
    assert isinstance(text, str)
