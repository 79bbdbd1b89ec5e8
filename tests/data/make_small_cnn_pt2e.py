"""Writes small_cnn_pt2e.pt2: zoo.small_cnn quantized by the real pt2e flow (torchao's prepare_pt2e /
convert_pt2e with litert-torch's PT2EQuantizer, static per-channel symmetric config), then exported.

torch 2.13 (ours) no longer ships prepare_pt2e; run this in the litert-torch venv
(`.venv-bench-litert-torch/bin/python tests/data/make_small_cnn_pt2e.py`: torch 2.14.1, torchao 0.18,
litert-torch 0.10). The file loads in torch 2.13 once torch.ao.quantization.fx._decomposed is imported.
"""
import importlib.util
import os

import torch
from litert_torch.quantize.pt2e_quantizer import PT2EQuantizer, get_symmetric_quantization_config
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("zoo", os.path.join(HERE, "..", "..", "examples", "zoo.py"))
zoo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zoo)

model, args = zoo.small_cnn(batch=2)
prepared = prepare_pt2e(torch.export.export(model.eval(), args).module(),
                        PT2EQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True)))
g = torch.Generator().manual_seed(0)
for _ in range(8):
    prepared(torch.randn(args[0].shape, generator=g))
converted = convert_pt2e(prepared, fold_quantize=False)
torch.export.save(torch.export.export(converted, args), os.path.join(HERE, "small_cnn_pt2e.pt2"))
