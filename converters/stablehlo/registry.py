"""The table of JAX lowerings, keyed by ATen overload (and optionally platform).

A lowering is ``rule(ctx, *args, **kwargs)``: the node's arguments with every
fx.Node replaced by its JAX value. It returns a JAX array, or a tuple for ops
with several results. Platform-specific rules sit beside the default rule::

    @lowers(aten.gelu.default)
    def gelu(ctx, x, approximate="none"): ...

    @lowers(aten.scaled_dot_product_attention.default, platform="tpu")
    def sdpa_tpu(ctx, q, k, v, ...): ...
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .. import OpRules  # noqa: E402

LOWERINGS: OpRules = OpRules()  # op (or its name) -> {platform or None: rule}


class Ragged:
    """A value whose leading dim depends on the data (nonzero, boolean-mask indexing).

    ``values`` is padded to the largest possible row count and ``count`` says how many rows
    are real. Such a value can only be a program output: the program returns both and the
    runtime trims the padding.
    """

    def __init__(self, values, count):
        self.values, self.count = values, count

PLATFORMS = ("tpu", "cpu", "cuda", "rocm")  # jax.export's platform names


def lowers(*ops, platform: str | None = None):
    """Registers ``rule`` as the lowering of ``ops`` (on ``platform``, or on every platform)."""
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r} for a lowering of {ops}; choose from {PLATFORMS}")
    if not ops:
        raise ValueError("lowers() names no op")

    def register(rule):
        for op in ops:
            LOWERINGS.setdefault(op, {})[platform] = rule
        return rule
    return register


def lookup(op, platform: str) -> Callable | None:
    rules = LOWERINGS.get(op)
    if not rules:
        return None
    return rules.get(platform) or rules.get(None)


_TORCH_TO_JAX = {
    torch.float32: jnp.float32, torch.float64: jnp.float64, torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16, torch.int8: jnp.int8, torch.int16: jnp.int16, torch.int32: jnp.int32,
    torch.int64: jnp.int64, torch.uint8: jnp.uint8, torch.uint16: jnp.uint16, torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64, torch.bool: jnp.bool_, torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
_NARROW = {jnp.float64: jnp.float32, jnp.int64: jnp.int32, jnp.uint64: jnp.uint32, jnp.complex128: jnp.complex64}


def jax_dtype(dtype: torch.dtype, narrow_64bit: bool = False):
    jd = _TORCH_TO_JAX.get(dtype)
    if jd is None:
        raise TypeError(f"dtype {dtype} has no JAX equivalent")
    return _NARROW.get(jd, jd) if narrow_64bit else jd


def _meta(x):
    if isinstance(x, torch.fx.Node):
        return x.meta.get("val")
    return x


class LoweringContext:
    """What a rule may ask about the node it lowers: output metadata, dtypes, platform."""

    def __init__(self, platform: str, *, narrow_64bit: bool = False, kernels: str = "auto",
                 float_dtype=None, sharded: bool = False, kernel_topologies: tuple[str, ...] = (),
                 mesh_axes: dict | None = None, expert_axis: str | None = None, kernels_off: tuple[str, ...] = ()):
        self.platform = platform
        # TPU topologies whose compiler must accept a Pallas kernel before it is used (libtpu)
        self.kernel_topologies = tuple(kernel_topologies)
        self.narrow_64bit = narrow_64bit
        self.float_dtype = float_dtype  # e.g. bfloat16: the program computes all floats in it
        self.sharded = sharded or bool(mesh_axes)  # the program is partitioned over a device mesh
        self.mesh_axes = dict(mesh_axes or {})  # its axes ({"data": 1, "model": 8}): kernels run per shard
        self.mesh = None
        if mesh_axes:
            from jax.sharding import AbstractMesh
            self.mesh = AbstractMesh(tuple(mesh_axes.values()), tuple(mesh_axes))
        self.expert_axis = expert_axis  # the mesh axis experts are split over (the sharding plan's)
        self.kernels = kernels
        # kernels left out of this lowering (kernels="auto": the program accessed fewer bytes without them)
        self.kernels_off = frozenset(kernels_off)
        self.node: torch.fx.Node | None = None
        self.kernel_log: list[dict] = []  # per hot node: kernel chosen, or why not
        # placeholder name -> (int8 values, scales, channel axis) for weights stored quantized
        self.quantized_weights: dict[str, tuple] = {}
        self._key = None
        self._draws = 0

    def shard_mesh(self):
        """The mesh a per-shard computation (``jax.shard_map``) maps over: the one the program is traced
        under where it is set (``jax.set_mesh``: the same axes, with its devices' kind), else the
        export's abstract mesh."""
        from jax.sharding import get_abstract_mesh
        current = get_abstract_mesh()
        same = not current.empty and tuple(current.axis_names) == tuple(self.mesh.axis_names) \
            and tuple(current.axis_sizes) == tuple(self.mesh.axis_sizes)
        return current if same else self.mesh

    def start_random(self, key_data) -> None:
        """The program's PRNG key (``uint32[2]``, an input of the program) for this trace."""
        import jax
        self._key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
        self._draws = 0

    def random_key(self):
        """A key of its own for the random op being lowered: the program's key folded with a counter."""
        import jax
        if self._key is None:
            raise RuntimeError("random_key() outside a program that takes a PRNG key")
        self._draws += 1
        return jax.random.fold_in(self._key, self._draws)

    def dtype(self, dtype: torch.dtype):
        """The JAX dtype this program computes with for a torch dtype."""
        if self.float_dtype is not None and dtype.is_floating_point:
            return self.float_dtype
        return jax_dtype(dtype, self.narrow_64bit)

    def io_dtype(self, dtype: torch.dtype):
        """The dtype a program input or output keeps at the boundary."""
        return jax_dtype(dtype, self.narrow_64bit)

    @property
    def out(self):
        """The node's output as a FakeTensor (or a tuple of them)."""
        return self.node.meta.get("val")

    def out_dtype(self, index: int | None = None):
        val = self.out if index is None else self.out[index]
        return self.dtype(val.dtype)

    def out_shape(self, index: int | None = None) -> tuple:
        val = self.out if index is None else self.out[index]
        return tuple(val.shape)

    def used_outputs(self) -> set[int]:
        """Which results of a multi-output node are read (through getitem) by the rest of the graph."""
        import operator
        return {u.args[1] for u in self.node.users if u.target is operator.getitem}

    def arg_meta(self, i: int):
        """The i-th argument of the node as torch sees it (FakeTensor, number, ...)."""
        return _meta(self.node.args[i]) if i < len(self.node.args) else None

    def promoted_dtype(self, kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT):
        """torch's computation dtype for an elementwise op over the node's tensor and number arguments."""
        vals = [_meta(a) for a in self.node.args]
        vals = [v for v in vals if isinstance(v, (torch.Tensor, bool, int, float, complex))]
        compute, _ = elementwise_dtypes(*vals, type_promotion_kind=kind)
        return self.dtype(compute)

    def cast(self, x, dtype):
        return x.astype(dtype) if jnp.result_type(x) != np.dtype(dtype) else x
