"""A minimal stand-in for PyTorch's pt2e post-training quantization (prepare_pt2e + convert_pt2e).

torch 2.13 no longer ships ``torch.ao.quantization.quantize_pt2e`` (it moved to torchao), but it
still defines the ``quantized_decomposed`` ops that pt2e graphs are made of. ``quantize`` makes
the graph ``convert_pt2e`` makes with XNNPACKQuantizer's static, per-channel symmetric config:
int8 weights read through ``dequantize_per_channel``, and a ``quantize_per_tensor`` ->
``dequantize_per_tensor`` pair (scales from min/max observers over the calibration samples)
after the model's inputs and after every conv, linear, relu, add, pool and mean, as XNNPACKQuantizer
annotates them. Batch norms are first folded into the convolutions before them, as prepare_pt2e does.
"""
import operator

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401 (registers torch.ops.quantized_decomposed)

aten = torch.ops.aten
qd = torch.ops.quantized_decomposed
_WEIGHTED = {aten.conv2d.default: 1, aten.linear.default: 1}
_OUTPUTS = {aten.conv2d.default, aten.linear.default, aten.relu.default, aten.relu_.default, aten.add.Tensor,
            aten.add_.Tensor, aten.max_pool2d.default, aten.adaptive_avg_pool2d.default, aten.hardtanh.default,
            aten.mean.dim}


def _qparams(lo: float, hi: float) -> tuple[float, int]:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max(hi - lo, 1e-8) / 255.0
    return scale, int(min(127, max(-128, round(-128 - lo / scale))))


def quantize(module: torch.nn.Module, sample_args: tuple, calibration: list[tuple]) -> torch.fx.GraphModule:
    from torch.fx.experimental.optimization import fuse
    gm = torch.export.export(fuse(module.eval()), sample_args).module()
    graph = gm.graph
    watched = [n for n in graph.nodes if n.op == "placeholder" or n.target in _OUTPUTS]
    ranges: dict = {}

    class Observer(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n in watched and isinstance(out, torch.Tensor) and out.is_floating_point():
                lo, hi = ranges.get(n, (float("inf"), float("-inf")))
                ranges[n] = (min(lo, out.min().item()), max(hi, out.max().item()))
            return out

    with torch.no_grad():
        for sample in calibration:
            Observer(gm).run(*sample)
    for n in watched:
        if n not in ranges:
            continue
        scale, zp = _qparams(*ranges[n])
        users = list(n.users)
        with graph.inserting_after(n):
            q = graph.call_function(qd.quantize_per_tensor.default, (n, scale, zp, -128, 127, torch.int8))
        with graph.inserting_after(q):
            dq = graph.call_function(qd.dequantize_per_tensor.default, (q, scale, zp, -128, 127, torch.int8))
        for u in users:
            u.replace_input_with(n, dq)
    for n in list(graph.nodes):
        if n.target not in _WEIGHTED:
            continue
        w_node = n.args[_WEIGHTED[n.target]]
        w = operator.attrgetter(w_node.target)(gm) if w_node.op == "get_attr" else None
        if w is None:
            continue
        w = w.detach()
        dims = tuple(range(1, w.dim()))
        scale = (w.abs().amax(dim=dims) / 127).clamp_min(1e-12)
        q = torch.clamp(torch.round(w / scale.reshape((-1,) + (1,) * len(dims))), -127, 127).to(torch.int8)
        base = w_node.target.replace(".", "_")
        for suffix, value in (("_int8", q), ("_scale", scale), ("_zero", torch.zeros_like(scale, dtype=torch.int64))):
            gm.register_buffer(base + suffix, value)
        with graph.inserting_before(n):
            args = [graph.get_attr(base + s) for s in ("_int8", "_scale", "_zero")]
            dq = graph.call_function(qd.dequantize_per_channel.default, (*args, 0, -127, 127, torch.int8))
        n.replace_input_with(w_node, dq)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def count(gm: torch.fx.GraphModule, op) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is op)

