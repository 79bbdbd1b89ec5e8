"""Quantization recipes (names, options) and the report every quantized conversion returns.

Recipes per target:
- tpu: ``int8_weight_only`` (int8 per-channel matmul weights, dequantised inside the matmul),
  ``bf16`` (weights and compute in bfloat16; inputs and outputs keep their dtypes);
- litert: ``fp16``, ``dynamic_int8``, ``int8`` (see converters/litert).

``quant_config`` is a recipe name, or a dict ``{"recipe": NAME, ...options}``
(e.g. ``{"recipe": "int8", "calibration": [sample_args, ...], "integer_io": False}``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from .errors import InputError
from .specs import as_numpy

@dataclasses.dataclass
class QuantConfig:
    recipe: str
    options: dict = dataclasses.field(default_factory=dict)


def parse(quant_config, target: str, recipes: tuple | None = None) -> QuantConfig | None:
    """``quant_config`` as a QuantConfig (None means float), its recipe checked against ``recipes``, the
    target's (its record's ``recipes``; a converter called by its target's ``build`` passes none)."""
    if quant_config is None:
        return None
    if isinstance(quant_config, QuantConfig):
        cfg = quant_config
    elif isinstance(quant_config, str):
        cfg = QuantConfig(quant_config)
    elif isinstance(quant_config, dict) and "recipe" in quant_config:
        cfg = QuantConfig(quant_config["recipe"], {k: v for k, v in quant_config.items() if k != "recipe"})
    else:
        raise InputError(f"quant_config must be a recipe name or a dict with 'recipe', not {quant_config!r}")
    if recipes is not None and cfg.recipe not in recipes:
        raise InputError(f"unknown quantization recipe {cfg.recipe!r} for the {target} target",
                         hint=f"choose one of {', '.join(recipes)}" if recipes else
                         f"the {target} target has no quantization recipes")
    return cfg


def per_channel_int8(w: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization with one scale per slice along ``axis``: (int8 values, float32 scales)."""
    if axis == 0 and np.ndim(w) >= 2 and np.asarray(w).nbytes > (64 << 20):
        # a large weight a slice at a time: temporaries of ~16 MB, not of the weight (an LLM's projections)
        w = np.asarray(w)
        step = max(1, (16 << 20) // max(1, w[0].size * 4))
        q, scales = np.empty(w.shape, np.int8), np.empty(w.shape[0], np.float32)
        for r in range(0, w.shape[0], step):
            q[r:r + step], scales[r:r + step] = per_channel_int8(w[r:r + step], 0)
        return q, scales
    w = np.asarray(w, np.float32)
    reduce_axes = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.max(np.abs(w), axis=reduce_axes, keepdims=True) if reduce_axes else np.abs(w)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale.reshape(-1)


@dataclasses.dataclass
class QuantReport:
    """What quantization cost and saved, measured on the sample inputs against the float model."""

    recipe: str
    float_bytes: int
    quant_bytes: int
    max_abs_err: float
    max_rel_err: float
    cosine: float
    top1_agreement: float | None  # fraction of rows whose argmax agrees (for logits-like outputs)

    @property
    def shrink(self) -> float:
        return self.float_bytes / self.quant_bytes if self.quant_bytes else float("inf")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        top1 = f", top-1 agreement {self.top1_agreement:.1%}" if self.top1_agreement is not None else ""
        return (f"quantization {self.recipe}: weights {self.float_bytes / 2**20:.2f} MB -> "
                f"{self.quant_bytes / 2**20:.2f} MB ({self.shrink:.2f}x smaller); error vs float: "
                f"max abs {self.max_abs_err:.3g}, rel to output scale {self.max_rel_err:.3g}, "
                f"cosine {self.cosine:.5f}{top1}")


def measure(recipe: str, float_outputs: Sequence[Any], quant_outputs: Sequence[Any], float_bytes: int,
            quant_bytes: int) -> QuantReport:
    """Compares quantized outputs with float ones (all floating outputs together)."""
    f = [as_numpy(x) for x in float_outputs]
    q = [as_numpy(x) for x in quant_outputs]
    # floating outputs only: integer ones (indices, token ids) are exact or plainly wrong, not "close"
    pairs = [(a.astype(np.float64), b.astype(np.float64)) for a, b in zip(f, q) if a.dtype.kind == "f" and a.size]
    if not pairs:
        return QuantReport(recipe, float_bytes, quant_bytes, 0.0, 0.0, 1.0, None)
    fa = np.concatenate([a.ravel() for a, _ in pairs])
    qa = np.concatenate([b.ravel() for _, b in pairs])
    err = np.abs(fa - qa)
    scale = np.abs(fa).max() or 1.0
    denom = np.linalg.norm(fa) * np.linalg.norm(qa)
    cosine = float(fa @ qa / denom) if denom else 1.0
    first = pairs[0]
    top1 = None
    if first[0].ndim >= 1 and first[0].shape[-1] > 1:
        top1 = float(np.mean(first[0].reshape(-1, first[0].shape[-1]).argmax(-1)
                             == first[1].reshape(-1, first[1].shape[-1]).argmax(-1)))
    return QuantReport(recipe, int(float_bytes), int(quant_bytes), float(err.max()), float(err.max() / scale),
                       cosine, top1)


def report_against_eager(prog, captured: dict, recipe: str, float_bytes: int, quant_bytes: int):
    """The report of a quantized conversion: sizes before and after, and the error of ``prog`` (any
    runnable) against the float model (torch eager) on the first program's sample inputs."""
    import torch
    import torch.utils._pytree as pytree
    name, cap = next(iter(captured.items()))
    leaves = list(cap.sample_inputs)
    for i in sorted(cap.constant_inputs):  # the non-tensor arguments torch.export specialised
        leaves.insert(i, cap.constant_inputs[i])
    args, kwargs = pytree.tree_unflatten(leaves, cap.in_spec)
    with torch.no_grad():
        ref = cap.exported.module()(*args, **kwargs)
    got = prog.run_flat(cap.sample_inputs, signature_name=name if len(captured) > 1 else None)
    return measure(recipe, pytree.tree_leaves(ref), got, float_bytes, quant_bytes)
