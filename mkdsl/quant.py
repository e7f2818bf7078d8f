"""Quantised weight formats: packing (numpy, for loaders and tests) and decoding (jnp).

Layouts are described in `mkdsl.dtypes.storage`. Decoding is exact: every mxfp4 value is a
power of two times an e2m1 magnitude, so it is representable in f32 (and in bf16 and e4m3).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from mkdsl.dtypes import DType
from mkdsl.lazy import jax, jnp

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


class QTensor(NamedTuple):
    """A quantised weight as the reference sees it: its storage arrays and its format."""

    codes: object  # uint32 [..., K/8, N]
    scales: object  # mxfp4: uint8 [..., K/32, N]; int4: bf16 [..., K/g, N]
    fmt: str  # "mxfp4" | "int4"
    group: int


@functools.cache
def register_pytree() -> None:
    """Let `jax.jit` take QTensors: codes and scales are leaves, format and group are static.

    Called by whoever jits over weights (not at import: that would import jax for `check`)."""
    jax.tree_util.register_pytree_node(
        QTensor, lambda q: ((q.codes, q.scales), (q.fmt, q.group)), lambda aux, ch: QTensor(*ch, *aux)
    )


def unpack_nibbles(codes) -> jnp.ndarray:
    """uint32 [..., K/8, N] -> int32 nibbles [..., K, N], low nibble = lowest input index."""
    shifts = jnp.arange(8, dtype=jnp.uint32) * 4
    nib = (codes[..., :, None, :] >> shifts[:, None]) & jnp.uint32(0xF)
    *lead, k8, _, n = nib.shape
    return nib.reshape(*lead, k8 * 8, n).astype(jnp.int32)


def e8m0_to_f32(scales) -> jnp.ndarray:
    """E8M0 bytes -> f32 2^(byte-127), built from the exponent bits so that it is exact
    (XLA's exp2 is off by up to ~4e-6 relative away from small exponents); 0xFF is NaN."""
    b = scales.astype(jnp.uint32)
    bits = jnp.where(b == 0, jnp.uint32(0x00400000), b << 23)  # 2^-127 is subnormal
    bits = jnp.where(b == 255, jnp.uint32(0x7FC00000), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize(w: QTensor) -> jnp.ndarray:
    """Decode a quantised weight to f32 of its logical shape [..., K, N]."""
    nib = unpack_nibbles(w.codes)
    if w.fmt == "mxfp4":
        mag = jnp.asarray(E2M1_VALUES)[nib & 7]
        vals = jnp.where(nib & 8, -mag, mag)
        scale = e8m0_to_f32(w.scales)
    else:
        vals = jnp.where(nib >= 8, nib - 16, nib).astype(jnp.float32)
        scale = w.scales.astype(jnp.float32)
    return vals * jnp.repeat(scale, w.group, axis=-2)


def quantize(dtype: DType, w: np.ndarray) -> QTensor:
    """Round an f32 [..., K, N] array to `dtype` (nearest code, per-group scale): numpy."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    g = dtype.group
    blocks = w.reshape(*lead, k // g, g, n)
    amax = np.abs(blocks).max(axis=-2)
    if dtype.name == "mxfp4":
        exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0))
        exp = np.clip(exp, -127, 127)
        scales = (exp + 127).astype(np.uint8)
        unit = np.exp2(exp)[..., None, :]
        mag = np.abs(blocks) / unit
        idx = np.abs(mag[..., None] - E2M1_VALUES).argmin(-1)
        nib = idx | np.where(blocks < 0, 8, 0)
    else:
        scale = np.maximum(amax, 1e-30) / 7.0
        scales = scale.astype(ml_dtypes.bfloat16)
        q = np.clip(np.round(blocks / scales.astype(np.float32)[..., None, :]), -8, 7)
        nib = q.astype(np.int32) & 0xF
    return QTensor(pack_nibbles(nib.reshape(*lead, k, n)), scales, dtype.name, g)


def pack_nibbles(nib: np.ndarray) -> np.ndarray:
    """int [..., K, N] nibbles (0..15) -> uint32 [..., K/8, N], low nibble first."""
    *lead, k, n = nib.shape
    nib = nib.astype(np.uint32).reshape(*lead, k // 8, 8, n)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[:, None]
    return np.bitwise_or.reduce(nib << shifts, axis=-2).astype(np.uint32)
