"""Real-to-complex and complex-to-real FFTs (the core opset's FFT primitives)."""
from __future__ import annotations

import jax.numpy as jnp

import torch

from .registry import lowers

aten = torch.ops.aten

# torch's fft_norm_mode (none, by_root_n, by_n) as jnp.fft's norm, per direction: jnp's
# "backward" leaves the forward transform unscaled and divides the inverse by n.
_FORWARD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
_INVERSE_NORM = {0: "forward", 1: "ortho", 2: "backward"}


@lowers(aten._fft_r2c.default)
def fft_r2c(ctx, x, dim, normalization, onesided):
    axes = [d % x.ndim for d in dim]
    x = x.astype(jnp.float64 if ctx.out_dtype() == jnp.complex128 else jnp.float32)
    if onesided:
        return jnp.fft.rfftn(x, axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.fftn(x, axes=axes, norm=_FORWARD_NORM[normalization])


@lowers(aten._fft_c2r.default)
def fft_c2r(ctx, x, dim, normalization, last_dim_size):
    axes = [d % x.ndim for d in dim]
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=sizes, axes=axes, norm=_INVERSE_NORM[normalization])


@lowers(aten._fft_c2c.default)
def fft_c2c(ctx, x, dim, normalization, forward):
    axes = [d % x.ndim for d in dim]
    if forward:
        return jnp.fft.fftn(x, axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=axes, norm=_INVERSE_NORM[normalization])
