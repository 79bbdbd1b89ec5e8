"""Which ops the LiteRT quantization recipes quantize (``Entry.quantized_by``), and the layer-sized
samples their weight ops are measured on (``Entry.quant_samples``): in a quantized cell the weights
are constants of the program, as a model's are, so the recipe can quantize them."""
import dataclasses
import functools

import torch

from ._entry import TABLE, Constant, S
# the entries marked below (imported first, so that importing this module alone works)
from . import _backward, _composite, _elementwise, _index, _misc, _nn, _reduction, _shape  # noqa: F401,E402


class _Layer:
    """Inputs and weights for layer-sized samples (one seed for every weight op, as first measured)."""

    def __init__(self):
        self.g = torch.Generator().manual_seed(0)

    def f(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def w(self, *shape):
        """A weight as a layer holds it: a constant, scaled like a trained one (1/sqrt(fan-in))."""
        return Constant(self.f(*shape) / shape[-1] ** 0.5)


@functools.cache
def _layer_samples() -> dict:
    x = _Layer()  # drawn in this order from one seed
    return {
        "aten.convolution.default": [
            S(x.f(1, 8, 10, 10), x.w(32, 8, 3, 3), Constant(x.f(32)), [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
              desc="3x3 conv, padding 1"),
            S(x.f(1, 16, 9, 9), x.w(32, 16, 1, 1), None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1,
              desc="1x1 conv, stride 2, no bias")],
        "aten.addmm.default": [S(Constant(x.f(64)), x.f(4, 48), x.w(48, 64), desc="bias + x @ w")],
        "aten.mm.default": [S(x.f(4, 48), x.w(48, 64), desc="x @ w")],
        "aten.bmm.default": [S(x.f(2, 4, 48), x.w(2, 48, 64), desc="batched x @ w")],
        "aten.linear.default": [S(x.f(2, 5, 48), x.w(64, 48), Constant(x.f(64)), desc="3-d input, bias"),
                                S(x.f(3, 48), x.w(64, 48), desc="2-d input, no bias")],
        "aten.embedding.default": [S(x.w(300, 16), torch.randint(0, 300, (2, 7), generator=x.g),
                                     desc="300x16 table")],
    }


# hybrid kernels: FULLY_CONNECTED, CONV_2D, BATCH_MATMUL, EMBEDDING_LOOKUP
WEIGHT_OPS = ("aten.convolution.default", "aten.addmm.default", "aten.mm.default", "aten.bmm.default",
              "aten.linear.default", "aten.embedding.default")
# full integer: those, and the activation ops with int8 kernels (measured on the table's samples)
INT8_ACTIVATION_OPS = (
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.relu.default", "aten.hardtanh.default",
    "aten.sigmoid.default", "aten.tanh.default", "aten._softmax.default", "aten.mean.dim",
    "aten.avg_pool2d.default", "aten._adaptive_avg_pool2d.default", "aten.cat.default",
    "aten.view.default", "aten.permute.default", "aten.upsample_nearest2d.vec", "aten.maximum.default",
    "aten.minimum.default", "aten.leaky_relu.default")

for _name in WEIGHT_OPS:
    TABLE[_name] = dataclasses.replace(TABLE[_name], quantized_by=("dynamic_int8", "int8"),
                                       quant_samples=lambda _gen, name=_name: _layer_samples()[name])
for _name in INT8_ACTIVATION_OPS:
    TABLE[_name] = dataclasses.replace(TABLE[_name], quantized_by=("int8",))
