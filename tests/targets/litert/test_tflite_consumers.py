"""Consumers of the .tflite files other than LiteRT's CPU interpreter, on every zoo model:

- OpenVINO's TFLite frontend (Intel's LiteRT dispatch uses it too) reads the file, compiles it for
  its CPU device and gives torch eager's outputs. It reads what the interpreter forgives differently:
  an empty ReshapeOptions is new_shape=[], and two tensors of one name are one tensor (a linear
  layer's weight taken as its bias);
- LiteRT's own GPU-delegate compatibility check (its model analyzer, `inspect --gpu`) finds every op
  of the file compatible with the GPU delegate."""
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import torchtpu_export as tte
import zoo
from torchtpu_export.numerics import compare

ov = pytest.importorskip("openvino", reason="openvino is in the [test] extra")

# model -> factory kwargs (small sizes: the suite runs on 2 cores)
MODELS = {"small_cnn": {}, "resnet18": {"size": 64}, "resnet50": {}, "mobilenet_v2": {"size": 64},
          "gpt": {}, "llama": {}, "qwen3": {}, "bert_encoder": {}, "dlrm": {}, "unet": {}}
RTOL = 1e-5  # OpenVINO's CPU kernels against torch, relative to each output's scale (measured: 1.4e-6 at most)


def test_every_zoo_model_is_listed():
    assert set(MODELS) == set(zoo.ZOO)


@pytest.mark.parametrize("name", list(MODELS))
def test_openvino_runs_the_tflite_like_torch_and_the_gpu_delegate_takes_it(name, tmp_path):
    model, args = zoo.ZOO[name](**MODELS[name])
    with torch.no_grad():
        ref = [r.numpy() for r in pytree.tree_leaves(model(*args))]
    path = tmp_path / f"{name}.tflite"
    tte.convert(model, args).export(path)
    core = ov.Core()
    # float32 as the file says: on CPUs with bf16 units (AVX512-BF16, AMX) OpenVINO's default is bf16
    compiled = core.compile_model(core.read_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    flat = [np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a) for a in pytree.tree_leaves(args)]
    result = compiled(flat)
    outs = [result[o] for o in compiled.outputs]
    assert len(outs) == len(ref), f"{len(outs)} outputs, torch has {len(ref)}"
    # OpenVINO orders outputs as the file's subgraph does, which is the module's flat output order
    agreement = compare([o.astype(r.dtype) if o.dtype != r.dtype and o.dtype.kind == r.dtype.kind else o
                         for o, r in zip(outs, ref)], ref, rtol=RTOL)
    assert agreement.ok, f"{name} on OpenVINO: {agreement}"
    gpu = _gpu_compatible(path)
    assert gpu["compatible"], gpu["problems"]


def test_inspect_gpu(cli, tmp_path):
    model, args = zoo.small_cnn()
    path = tmp_path / "cnn.tflite"
    tte.convert(model, args).export(path)
    r = cli("inspect", path, "--gpu")
    assert r.returncode == 0, r.stderr
    assert "GPU delegate: every op compatible" in r.stdout
    other = tmp_path / "cnn.onnx"
    tte.export(model, args, target="onnx").save(other)
    r = cli("inspect", other, "--gpu")
    assert r.returncode == 2 and "--gpu applies to .tflite files" in r.stderr


def test_tensor_names_are_unique_and_reshapes_state_their_shape(tmp_path):
    from ai_edge_litert import schema_py_generated as fb
    model, args = zoo.gpt()
    path = tmp_path / "gpt.tflite"
    tte.convert(model, args).export(path)
    m = fb.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    codes = [op.builtinCode or op.deprecatedBuiltinCode for op in m.operatorCodes]
    for sg in m.subgraphs:
        names = [t.name for t in sg.tensors]
        assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1][:5]
        for op in sg.operators:
            if codes[op.opcodeIndex] == fb.BuiltinOperator.RESHAPE and op.builtinOptions is not None:
                assert list(op.builtinOptions.newShape) == list(sg.tensors[op.outputs[0]].shape)


def _gpu_compatible(path) -> dict:
    from torchtpu_export import targets
    return targets.get("litert").gpu_check(str(path))


def test_decoder_prefill_and_decode_signatures_are_gpu_compatible(tmp_path):
    # examples/llama.py's file: two signatures, an explicit KV cache updated in the graph
    model, (tokens,) = zoo.llama(seq=12)
    prefill, decode = zoo.Prefill(model), zoo.Decode(model)
    k, v = model.empty_cache(1)
    path = tmp_path / "llama.tflite"
    (tte.signature("prefill", prefill, (tokens,))
     .signature("decode", decode, (tokens[:, -1:], torch.tensor([tokens.shape[1]]), k, v)).convert().export(path))
    gpu = _gpu_compatible(path)
    assert gpu["compatible"], gpu["problems"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gpt2", "bert", "vit", "whisper_encoder"])
def test_hf_transformers_examples_are_gpu_compatible(name, tmp_path):
    pytest.importorskip("transformers")
    import hf_transformers
    model, args = getattr(hf_transformers, name)()
    path = tmp_path / f"{name}.tflite"
    tte.convert(model, args).export(path)
    gpu = _gpu_compatible(path)
    assert gpu["compatible"], gpu["problems"]
