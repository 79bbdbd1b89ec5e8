"""Spatial sampling: grid_sampler_2d (bilinear / nearest / bicubic) and col2im (fold)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import torch

from .ops_nn import acc_dtype, half_rounding
from .registry import lowers

aten = torch.ops.aten

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord, size, align_corners):
    # [-1, 1] -> [0, size - 1] (align_corners) or [-0.5, size - 0.5]
    scale = (size - 1) / 2 if align_corners else size / 2
    return coord * scale + (size - 1) / 2


def _reflect(coord, twice_low, twice_high):
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    c = jnp.abs(coord - low)
    extra = jnp.fmod(c, span)
    flips = jnp.floor(c / span).astype(jnp.int32)
    return jnp.where(flips % 2 == 0, extra + low, span + low - extra)


def _pad_coordinates(coord, size, padding_mode, align_corners):
    if padding_mode == _BORDER:
        return jnp.clip(coord, 0, size - 1)
    if padding_mode == _REFLECTION:
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        return jnp.clip(coord, 0, size - 1)
    return coord


def _cubic_weights(t):
    a = -0.75
    def near(s):  # |s| <= 1
        return ((a + 2) * s - (a + 3)) * s * s + 1
    def far(s):  # 1 < |s| < 2
        return ((a * s - 5 * a) * s + 8 * a) * s - 4 * a
    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _grid_sampler_2d_half(x, grid, interpolation_mode, padding_mode, align_corners):
    """torch's CPU kernel in float16/bfloat16: vectorised arithmetic in the half type, every operation
    rounded to it (coordinates, weights, each product and sum of the interpolation, in torch's order).
    Computed in float32 here with an explicit rounding after each step, which XLA keeps."""
    r = half_rounding(x.dtype)

    n, c, h, w = x.shape
    xf, grid = x.astype(jnp.float32), grid.astype(jnp.float32)
    batch = jnp.arange(n).reshape((n, 1, 1))

    def unnormalize(v, size):
        if align_corners:
            return r(r(v + 1) * r(jnp.float32((size - 1) / 2)))
        return r(r(r(v + 1) * r(jnp.float32(size / 2))) - 0.5)

    def pad(v, size):
        if padding_mode == _REFLECTION:
            if align_corners:
                if size <= 1:
                    return jnp.zeros_like(v)
                span, low = r(jnp.float32((size - 1) * 2)), None
                a = jnp.abs(v)
            else:
                span, low = r(jnp.float32(size * 2)), -0.5
                a = jnp.abs(r(v - low))
            extra = r(a - r(jnp.trunc(r(a / span)) * span))
            v = jnp.minimum(extra, r(span - extra))
            v = v if low is None else r(v + low)
        if padding_mode in (_BORDER, _REFLECTION):
            v = jnp.clip(v, 0, size - 1)  # (NaN to 0, as torch's clamp order does)
            v = jnp.where(jnp.isnan(v), 0, v)
        return v

    def gather(ix, iy):
        """x[:, :, iy, ix] as (n, oh, ow, c), zero where (ix, iy) is outside the input."""
        inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h)
        xi = jnp.where(inside, ix, 0).astype(jnp.int32)
        yi = jnp.where(inside, iy, 0).astype(jnp.int32)
        return jnp.where(inside[..., None], xf[batch, :, yi, xi], 0)

    gx, gy = grid[..., 0], grid[..., 1]
    if interpolation_mode == _BICUBIC:
        ix, iy = unnormalize(gx, w), unnormalize(gy, h)
        x0, y0 = jnp.floor(ix), jnp.floor(iy)

        def coefficients(t):
            a = -0.75
            def far(v):
                return r(r(r(r(r(r(a * v) - 5 * a) * v) + 8 * a) * v) - 4 * a)
            def near(v):
                return r(r(r(r(r((a + 2) * v) - (a + 3)) * v) * v) + 1)
            return far(r(t + 1)), near(t), near(r(1 - t)), far(r(2 - t))
        cx, cy = coefficients(r(ix - x0)), coefficients(r(iy - y0))
        out = None
        for j in range(4):
            yy = pad(y0 - 1 + j, h)
            row = None
            for i in range(4):
                term = r(cx[i][..., None] * gather(pad(x0 - 1 + i, w), yy))
                row = term if row is None else r(row + term)
            term = r(cy[j][..., None] * row)
            out = term if out is None else r(out + term)
        return jnp.moveaxis(out, -1, 1).astype(x.dtype)
    ix, iy = pad(unnormalize(gx, w), w), pad(unnormalize(gy, h), h)
    if interpolation_mode == _NEAREST:
        return jnp.moveaxis(gather(jnp.round(ix), jnp.round(iy)), -1, 1).astype(x.dtype)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    we, no = r(ix - x0), r(iy - y0)
    ea, so = r(1 - we), r(1 - no)
    out = None
    for (xx, yy), weight in (((x0, y0), r(so * ea)), ((x0 + 1, y0), r(so * we)),
                             ((x0, y0 + 1), r(no * ea)), ((x0 + 1, y0 + 1), r(no * we))):
        term = r(gather(xx, yy) * weight[..., None])
        out = term if out is None else r(out + term)
    return jnp.moveaxis(out, -1, 1).astype(x.dtype)


@lowers(aten.grid_sampler_2d.default)
def grid_sampler_2d(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return _grid_sampler_2d_half(x, grid, interpolation_mode, padding_mode, align_corners)
    acc = acc_dtype(x.dtype)
    xf, grid = x.astype(acc), grid.astype(acc)
    n, c, h, w = x.shape
    batch = jnp.arange(n).reshape((n, 1, 1))

    def tap(ix, iy, weight):
        """weight * x[:, :, iy, ix], zero where (ix, iy) is outside the input."""
        inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h)
        xi = jnp.where(inside, ix, 0).astype(jnp.int32)
        yi = jnp.where(inside, iy, 0).astype(jnp.int32)
        vals = xf[batch, :, yi, xi]  # (n, oh, ow, c)
        return jnp.moveaxis(vals * jnp.where(inside, weight, 0)[..., None], -1, 1)

    gx, gy = grid[..., 0], grid[..., 1]
    if interpolation_mode == _BICUBIC:
        ix, iy = _unnormalize(gx, w, align_corners), _unnormalize(gy, h, align_corners)
        x0, y0 = jnp.floor(ix), jnp.floor(iy)
        wx, wy = _cubic_weights(ix - x0), _cubic_weights(iy - y0)
        out = 0
        for j in range(4):
            yy = _pad_coordinates(y0 - 1 + j, h, padding_mode, align_corners)
            for i in range(4):
                xx = _pad_coordinates(x0 - 1 + i, w, padding_mode, align_corners)
                out = out + tap(xx, yy, wx[i] * wy[j])
        return out.astype(x.dtype)
    ix = _pad_coordinates(_unnormalize(gx, w, align_corners), w, padding_mode, align_corners)
    iy = _pad_coordinates(_unnormalize(gy, h, align_corners), h, padding_mode, align_corners)
    if interpolation_mode == _NEAREST:
        # round half to even, like torch's nearbyint
        return tap(jnp.round(ix), jnp.round(iy), jnp.ones_like(ix)).astype(x.dtype)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    x1, y1 = x0 + 1, y0 + 1
    out = (tap(x0, y0, (x1 - ix) * (y1 - iy)) + tap(x1, y0, (ix - x0) * (y1 - iy))
           + tap(x0, y1, (x1 - ix) * (iy - y0)) + tap(x1, y1, (ix - x0) * (iy - y0)))
    return out.astype(x.dtype)


@lowers(aten.col2im.default)
def col2im(ctx, x, output_size, kernel_size, dilation, padding, stride):
    batched = x.ndim == 3
    if not batched:
        x = x[None]
    (h, w), (kh, kw), (dh, dw), (ph, pw), (sh, sw) = output_size, kernel_size, dilation, padding, stride
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    n, c = x.shape[0], x.shape[1] // (kh * kw)
    acc = acc_dtype(x.dtype)
    cols = x.astype(acc).reshape((n, c, kh, kw, oh, ow))
    out = jnp.zeros((n, c, h + 2 * ph, w + 2 * pw), acc)
    # every kernel tap adds its column block to a strided window of the padded output
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
            colsl = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
            out = out.at[:, :, rows, colsl].add(cols[:, :, i, j])
    out = lax.slice(out, (0, 0, ph, pw), (n, c, ph + h, pw + w)).astype(x.dtype)
    return out if batched else out[0]


@lowers(aten.grid_sampler_3d.default)
def grid_sampler_3d(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    """Trilinear or nearest sampling of (n, c, d, h, w) at grid (n, od, oh, ow, 3) = (x, y, z) points."""
    if interpolation_mode == _BICUBIC:
        raise NotImplementedError("grid_sampler_3d with bicubic interpolation (torch does not support it either)")
    if x.dtype in (jnp.bfloat16, jnp.float16):
        return _grid_sampler_3d_half(x, grid, interpolation_mode, padding_mode, align_corners)
    acc = acc_dtype(x.dtype)
    xf, grid = x.astype(acc), grid.astype(acc)
    n, c, d, h, w = x.shape
    batch = jnp.arange(n).reshape((n, 1, 1, 1))

    def tap(ix, iy, iz, weight):
        inside = (ix >= 0) & (ix < w) & (iy >= 0) & (iy < h) & (iz >= 0) & (iz < d)
        xi, yi, zi = (jnp.where(inside, v, 0).astype(jnp.int32) for v in (ix, iy, iz))
        vals = xf[batch, :, zi, yi, xi]  # (n, od, oh, ow, c)
        return jnp.moveaxis(vals * jnp.where(inside, weight, 0)[..., None], -1, 1)

    ix = _pad_coordinates(_unnormalize(grid[..., 0], w, align_corners), w, padding_mode, align_corners)
    iy = _pad_coordinates(_unnormalize(grid[..., 1], h, align_corners), h, padding_mode, align_corners)
    iz = _pad_coordinates(_unnormalize(grid[..., 2], d, align_corners), d, padding_mode, align_corners)
    if interpolation_mode == _NEAREST:
        return tap(jnp.round(ix), jnp.round(iy), jnp.round(iz), jnp.ones_like(ix)).astype(x.dtype)
    x0, y0, z0 = jnp.floor(ix), jnp.floor(iy), jnp.floor(iz)
    out = 0
    for dz in (0, 1):
        wz = (iz - z0) if dz else (z0 + 1 - iz)
        for dy in (0, 1):
            wy = (iy - y0) if dy else (y0 + 1 - iy)
            for dx in (0, 1):
                wx = (ix - x0) if dx else (x0 + 1 - ix)
                out = out + tap(x0 + dx, y0 + dy, z0 + dz, wx * wy * wz)
    return out.astype(x.dtype)


def _grid_sampler_3d_half(x, grid, interpolation_mode, padding_mode, align_corners):
    """torch's scalar CPU kernel in float16/bfloat16: every operation in the half type, rounded
    (``((coord + 1) * size - 1) / 2``, reflection by fmod, corner weights as products of distances,
    the eight taps added in torch's order); computed in float32 with an explicit rounding per step."""
    r = half_rounding(x.dtype)

    n, c, d, h, w = x.shape
    xf, grid = x.astype(jnp.float32), grid.astype(jnp.float32)
    batch = jnp.arange(n).reshape((n, 1, 1, 1))

    def source_index(v, size):
        v = r(r(r(v + 1) / 2) * (size - 1)) if align_corners else r(r(r(r(v + 1) * size) - 1) / 2)
        if padding_mode == _REFLECTION:
            twice_low, twice_high = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
            if twice_low == twice_high:
                v = jnp.zeros_like(v)
            else:
                low, span = r(jnp.float32(twice_low) / 2), r(jnp.float32(twice_high - twice_low) / 2)
                a = jnp.abs(r(v - low))
                extra = jnp.fmod(a, span)
                flips = jnp.floor(r(a / span)).astype(jnp.int32)
                v = jnp.where(flips % 2 == 0, r(extra + low), r(r(span - extra) + low))
        if padding_mode in (_BORDER, _REFLECTION):
            v = jnp.minimum(jnp.float32(size - 1), jnp.maximum(v, 0))
        return v

    ix, iy, iz = (source_index(grid[..., k], size) for k, size in enumerate((w, h, d)))

    def gather(xx, yy, zz):
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h) & (zz >= 0) & (zz < d)
        xi, yi, zi = (jnp.where(inside, v, 0).astype(jnp.int32) for v in (xx, yy, zz))
        return jnp.where(inside[..., None], xf[batch, :, zi, yi, xi], 0)  # (n, od, oh, ow, c)

    if interpolation_mode == _NEAREST:
        return jnp.moveaxis(gather(jnp.round(ix), jnp.round(iy), jnp.round(iz)), -1, 1).astype(x.dtype)
    x0, y0, z0 = jnp.floor(ix), jnp.floor(iy), jnp.floor(iz)
    near = [r(x0 + 1 - ix), r(y0 + 1 - iy), r(z0 + 1 - iz)]  # distance to the far corner: the near weight
    far = [r(ix - x0), r(iy - y0), r(iz - z0)]
    out = None
    for dz in (0, 1):          # torch's order: tnw, tne, tsw, tse, bnw, bne, bsw, bse
        for dy in (0, 1):
            for dx in (0, 1):
                wx, wy, wz = (far if dx else near)[0], (far if dy else near)[1], (far if dz else near)[2]
                term = r(gather(x0 + dx, y0 + dy, z0 + dz) * r(r(wx * wy) * wz)[..., None])
                out = term if out is None else r(out + term)
    return jnp.moveaxis(out, -1, 1).astype(x.dtype)
