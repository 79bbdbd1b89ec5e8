"""Random ops, drawn from the program's PRNG key (see ``LoweringContext.random_key``).

A program with random ops takes a threefry key after its inputs; each op folds in its own counter,
so two ops never share a stream and each call (a new key) gives new values. JAX's generator is
not torch's: the values differ from eager, the distributions are the same.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .ops_nn import acc_dtype
from .registry import lowers

aten = torch.ops.aten


def _uniform(ctx, shape, dtype=None):
    # half floats: drawn from the half type's own bits, as torch's CPU generator makes them (in
    # [0, 1), never rounded up to 1.0; torch's bfloat16 rand has mean 0.498)
    dtype = dtype or ctx.out_dtype()
    floating = jnp.issubdtype(dtype, jnp.floating)
    return jax.random.uniform(ctx.random_key(), tuple(shape), dtype if floating else jnp.float32)


def _normal(ctx, shape, dtype=None):
    # half floats: a float32 draw rounded to the half type
    dtype = dtype or ctx.out_dtype()
    floating = jnp.issubdtype(dtype, jnp.floating)
    z = jax.random.normal(ctx.random_key(), tuple(shape), acc_dtype(dtype) if floating else jnp.float32)
    return z.astype(dtype) if floating else z


def _math_dtype(ctx):
    """The dtype a transformed draw is computed in: float32 for half floats (as torch's CPU kernels,
    which transform a float draw and round once), else the output's."""
    return acc_dtype(ctx.out_dtype())


@lowers(aten.rand.default, aten.rand.generator)
def rand(ctx, size, *args, **kwargs):
    return _uniform(ctx, size)


@lowers(aten.randn.default, aten.randn.generator)
def randn(ctx, size, *args, **kwargs):
    return _normal(ctx, size)


@lowers(aten.rand_like.default)
def rand_like(ctx, x, **kwargs):
    return _uniform(ctx, x.shape)


@lowers(aten.randn_like.default)
def randn_like(ctx, x, **kwargs):
    return _normal(ctx, x.shape)


def _randint(ctx, shape, low, high):
    dtype = ctx.out_dtype()
    draw = jnp.int64 if jnp.dtype(dtype).itemsize == 8 else jnp.int32
    return jax.random.randint(ctx.random_key(), tuple(shape), low, high, draw).astype(dtype)


@lowers(aten.randint.default, aten.randint.generator)
def randint(ctx, high, size, *args, **kwargs):
    return _randint(ctx, size, 0, high)


@lowers(aten.randint.low, aten.randint.low_generator)
def randint_low(ctx, low, high, size, *args, **kwargs):
    return _randint(ctx, size, low, high)


@lowers(aten.randint_like.default)
def randint_like(ctx, x, high, **kwargs):
    return _randint(ctx, x.shape, 0, high)


@lowers(aten.randint_like.low_dtype)
def randint_like_low(ctx, x, low, high, **kwargs):
    return _randint(ctx, x.shape, low, high)


@lowers(aten.randint_like.Tensor)
def randint_like_tensor(ctx, x, high, **kwargs):
    return _randint(ctx, x.shape, 0, high)


@lowers(aten.randperm.default, aten.randperm.generator)
def randperm(ctx, n, *args, **kwargs):
    return jax.random.permutation(ctx.random_key(), n).astype(ctx.out_dtype())


@lowers(aten.bernoulli.default)
def bernoulli(ctx, p, *, generator=None):
    return (_uniform(ctx, p.shape, jnp.float32) < p.astype(jnp.float32)).astype(ctx.out_dtype())


@lowers(aten.bernoulli.p, aten.bernoulli.Tensor)
def bernoulli_p(ctx, x, p, *, generator=None):
    shape = ctx.out_shape()
    prob = jnp.asarray(p, jnp.float32)
    return (_uniform(ctx, shape, jnp.float32) < prob).astype(ctx.out_dtype())


@lowers(aten.uniform.default)
def uniform(ctx, x, low=0.0, high=1.0, *, generator=None):
    return (_uniform(ctx, x.shape, _math_dtype(ctx)) * (high - low) + low).astype(ctx.out_dtype())


@lowers(aten.normal_functional.default)
def normal_functional(ctx, x, mean=0.0, std=1.0, *, generator=None):
    return (_normal(ctx, x.shape, _math_dtype(ctx)) * std + mean).astype(ctx.out_dtype())


@lowers(aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor)
def normal(ctx, mean, std=1.0, *, generator=None):
    return (_normal(ctx, ctx.out_shape(), _math_dtype(ctx)) * std + mean).astype(ctx.out_dtype())


@lowers(aten.normal.float_float)
def normal_float(ctx, mean, std, size, *args, **kwargs):
    return (_normal(ctx, size, _math_dtype(ctx)) * std + mean).astype(ctx.out_dtype())


@lowers(aten.exponential.default)
def exponential(ctx, x, lambd=1.0, *, generator=None):
    u = _uniform(ctx, x.shape, _math_dtype(ctx))
    return (-jnp.log1p(-u) / lambd).astype(ctx.out_dtype())


@lowers(aten.geometric.default)
def geometric(ctx, x, p, *, generator=None):
    # trials up to and including the first success: ceil(log(1 - u) / log(1 - p)), at least 1
    u = _uniform(ctx, x.shape, jnp.float32)
    k = jnp.ceil(jnp.log1p(-u) / jnp.log1p(-p))
    return jnp.maximum(k, 1).astype(ctx.out_dtype())


@lowers(aten.cauchy.default)
def cauchy(ctx, x, median=0.0, sigma=1.0, *, generator=None):
    u = _uniform(ctx, x.shape, _math_dtype(ctx))
    return (median + sigma * jnp.tan(np.pi * (u - 0.5))).astype(ctx.out_dtype())


@lowers(aten.log_normal.default)
def log_normal(ctx, x, mean=1.0, std=2.0, *, generator=None):
    return jnp.exp(_normal(ctx, x.shape, _math_dtype(ctx)) * std + mean).astype(ctx.out_dtype())


@lowers(aten.multinomial.default)
def multinomial(ctx, probs, num_samples, replacement=False, *, generator=None):
    logits = jnp.log(probs.astype(jnp.float32))
    if replacement:
        batch = logits.shape[:-1]
        out = jax.random.categorical(ctx.random_key(), logits[..., None, :], axis=-1,
                                     shape=batch + (num_samples,))
    else:   # Gumbel top-k: the k largest of log p + Gumbel noise, a draw without replacement
        g = jax.random.gumbel(ctx.random_key(), logits.shape, jnp.float32)
        out = jax.lax.top_k(logits + g, num_samples)[1]
    return out.astype(ctx.out_dtype())


@lowers(aten.native_dropout.default)
def native_dropout(ctx, x, p, train):
    if not train or p == 0:
        return x, jnp.ones(x.shape, jnp.bool_)
    keep = _uniform(ctx, x.shape, jnp.float32) >= p
    return jnp.where(keep, x / (1 - p), 0).astype(x.dtype), keep


@lowers(aten.dropout.default)
def dropout(ctx, x, p, train):
    return native_dropout(ctx, x, p, train)[0]


@lowers(aten.rrelu_with_noise_functional.default)
def rrelu_with_noise(ctx, x, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    if not training:
        slope = (lower + upper) / 2
        return jnp.where(x >= 0, x, x * slope).astype(x.dtype), noise
    a = _uniform(ctx, x.shape, jnp.float32) * (upper - lower) + lower
    slope = jnp.where(x >= 0, 1, a).astype(x.dtype)
    return x * slope, slope.astype(noise.dtype)
