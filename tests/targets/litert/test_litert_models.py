"""The edge target on models built from code: numerics on both LiteRT APIs, layout, signatures, sizes."""
import pytest
import torch
import torch.utils._pytree as pytree

import torchtpu_export as tte
import zoo
from torchtpu_export.targets.litert.target import describe as describe_tflite
from torchtpu_export.numerics import compare

# model -> (factory kwargs, most TRANSPOSE ops allowed)
MODELS = {
    "resnet18": ({"size": 64}, 1),      # only the NCHW input becomes NHWC
    "mobilenet_v2": ({"size": 64}, 1),
    "unet": ({}, 8),                    # input, output, and the attention block's own permutes
    "gpt": ({}, 8),                     # the heads' view/transpose of q, k, v and the output, per layer
    "llama": ({}, 8),
    "dlrm": ({}, 1),                    # bmm(t, t.transpose(1, 2))
}


def _eager(model, args):
    with torch.no_grad():
        return [r.numpy() for r in pytree.tree_leaves(model(*args))]


@pytest.mark.parametrize("name", list(MODELS))
def test_model_agrees_on_both_litert_apis(name, tmp_path):
    kwargs, max_transposes = MODELS[name]
    model, args = zoo.ZOO[name](**kwargs)
    edge = tte.convert(model, args)
    ref = _eager(model, args)
    got = pytree.tree_leaves(edge(*args))
    agreement = compare(got, ref, rtol=1e-5)
    assert agreement.ok, f"{name} (Interpreter): {agreement}"
    flat = edge.run_flat(pytree.tree_leaves(args), runtime="compiled_model")
    agreement = compare(flat, ref, rtol=1e-5)
    assert agreement.ok, f"{name} (CompiledModel): {agreement}"

    path = tmp_path / f"{name}.tflite"
    edge.export(path)
    desc = describe_tflite(str(path))
    assert desc["transposes"] <= max_transposes, desc["programs"]["serving_default"]["op_histogram"]
    loaded = tte.load(path)
    assert [s.name for s in loaded.inputs()] == [s.name for s in edge.inputs()]
    assert compare(pytree.tree_leaves(loaded(*args)), ref, rtol=1e-5).ok


def test_cnn_ops_are_channels_last_builtins():
    model, args = zoo.mobilenet_v2(size=64)
    desc_hist = _histogram(tte.convert(model, args))
    assert desc_hist["DEPTHWISE_CONV_2D"] == 17
    assert "RELU6" not in desc_hist and "MUL" not in desc_hist  # ReLU6 fused, batch norm folded
    assert desc_hist["FULLY_CONNECTED"] == 1


def _histogram(edge) -> dict:
    import os
    import tempfile
    fd, path = tempfile.mkstemp(suffix=".tflite")
    os.close(fd)
    try:
        edge.export(path)
        return describe_tflite(path)["programs"]["serving_default"]["op_histogram"]
    finally:
        os.unlink(path)


def test_prefill_and_decode_signatures_share_weights():
    model, (tokens,) = zoo.llama()
    prefill, decode = zoo.Prefill(model), zoo.Decode(model)
    k, v = model.empty_cache()
    decode_args = (torch.tensor([[3]]), torch.tensor([tokens.shape[1]]), k, v)
    both = tte.signature("prefill", prefill, (tokens,)).signature("decode", decode, decode_args).convert()
    one = tte.convert(prefill, (tokens,))
    assert both.signatures == ["prefill", "decode"]
    # the second signature adds its graph, not a second copy of the weights
    assert len(both.model_content()) < 1.05 * len(one.model_content())

    ref = _eager(prefill, (tokens,))
    assert compare(pytree.tree_leaves(both(tokens, signature_name="prefill")), ref, rtol=1e-5).ok
    logits, kc, vc = (torch.from_numpy(r) for r in ref)
    step = (torch.tensor([[int(logits[0, -1].argmax())]]), torch.tensor([tokens.shape[1]]), kc, vc)
    ref2 = _eager(decode, step)
    for runtime in ("interpreter", "compiled_model"):
        got = both.run_flat(list(step), "decode", runtime=runtime)
        assert compare(got, ref2, rtol=1e-5).ok, runtime

    with torch.no_grad():
        want = zoo.generate(prefill, decode, tokens, 6, model.max_seq)
    got = zoo.generate(lambda t: both(t, signature_name="prefill"),
                       lambda *a: both(*a, signature_name="decode"), tokens, 6, model.max_seq)
    assert got == want


def test_same_model_gives_identical_bytes():
    model, args = zoo.small_cnn()
    assert tte.convert(model, args).model_content() == tte.convert(model, args).model_content()


def test_tied_embedding_is_stored_once():
    model, args = zoo.gpt()
    content = tte.convert(model, args).model_content()
    params = sum(p.numel() * 4 for p in model.parameters())  # parameters() lists the tied tensor once
    assert len(content) < params * 1.05
