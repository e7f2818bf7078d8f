"""Quantised weight formats: packing (numpy, for loaders and tests) and decoding (jnp).

Layouts are described in `mkdsl.lang.dtypes.storage`. Decoding is exact where the value is
representable: an mxfp4 value is a power of two times an e2m1 magnitude and an int4 value a
nibble times a bf16 scale, both exact in f32; an nvfp4 value is an e2m1 magnitude times an e4m3
scale (exact), times its tensor's f32 global scale (rounded once). A scaled int8 or fp8 value is its code times an
f32 scale, rounded once to f32 (correctly rounded, as IEEE multiplication is).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from mkdsl.lang.dtypes import GGUF, DType, extra_parts, numpy_dtype
from mkdsl.lazy import jax, jnp

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # largest finite code of each fp8 format


class QTensor(NamedTuple):
    """A quantised weight as the reference sees it: its storage arrays and its format."""

    codes: object  # mxfp4, nvfp4, int4: uint32 [..., K/8, N]; int8, fp8: [..., K, N] of the element
    scales: object  # mxfp4: uint8 [..., K/g, N]; nvfp4: e4m3; int4: bf16 or f32; int8, fp8: f32 (dtypes.storage)
    fmt: str  # "mxfp4" | "nvfp4" | "int4" | "int8" | "fp8_e4m3" | "fp8_e5m2" | "fp8_e4m3:block" | "fp8_e5m2:block"
    group: int  # inputs per scale; for ":block" formats the block's side
    glob: object = None  # nvfp4: f32 [..., 1, 1], the per-tensor global scale; None for the others
    extra: tuple = ()  # K-quants: the storage parts after codes and scales (`high`, Q6_K's `d`)


@functools.cache
def register_pytree() -> None:
    """Let `jax.jit` take QTensors: codes, scales (and glob) are leaves, format and group are static.

    Called by whoever jits over weights (not at import: that would import jax for `check`)."""
    jax.tree_util.register_pytree_node(
        QTensor,
        lambda q: ((q.codes, q.scales, q.glob, q.extra), (q.fmt, q.group)),
        lambda aux, ch: QTensor(ch[0], ch[1], *aux, ch[2], tuple(ch[3])),
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


def _mxfp4(w: QTensor):
    nib = unpack_nibbles(w.codes)
    mag = jnp.asarray(E2M1_VALUES)[nib & 7]
    return jnp.where(nib & 8, -mag, mag), e8m0_to_f32(w.scales)


def _nvfp4(w: QTensor):
    """e2m1 codes times their e4m3 scale: exact in f32 (a 2-bit and a 4-bit significand)."""
    vals, _ = _mxfp4(QTensor(w.codes, jnp.zeros((), jnp.uint8), "mxfp4", 32))
    return vals, w.scales.astype(jnp.float32)


def _int4(w: QTensor):
    nib = unpack_nibbles(w.codes)
    return jnp.where(nib >= 8, nib - 16, nib).astype(jnp.float32), w.scales.astype(jnp.float32)


def _plain_codes(w: QTensor):
    return w.codes.astype(jnp.float32), w.scales.astype(jnp.float32)


def _block(w: QTensor) -> jnp.ndarray:
    """One scale per [b, b] square; edge squares cover what is left of K and N."""
    *_, k, n = w.codes.shape
    b = w.group
    scale = jnp.repeat(jnp.repeat(w.scales.astype(jnp.float32), b, axis=-2), b, axis=-1)[..., :k, :n]
    return w.codes.astype(jnp.float32) * scale


# Per group-scaled format: (values, scales) in f32; the value is values * its group's scale.
GROUP_DECODERS = {
    "mxfp4": _mxfp4,
    "nvfp4": _nvfp4,
    "int4": _int4,
    "int8": _plain_codes,
    "fp8_e4m3": _plain_codes,
    "fp8_e5m2": _plain_codes,
}


def storage_arrays(name: str, w: QTensor) -> dict:
    """A quantised `w` as a generated kernel takes it: `w_codes`, `w_scales` (and nvfp4's `w_global`)."""
    out = {f"{name}_codes": w.codes, f"{name}_scales": w.scales}
    if w.glob is not None:
        out[f"{name}_global"] = w.glob
    for suffix, a in zip(extra_parts(w.fmt), w.extra, strict=True):
        out[f"{name}_{suffix}"] = a
    return out


def from_storage(dtype: DType, arrays: list) -> QTensor:
    """The QTensor of a quantised dtype from its storage arrays, in `dtypes.storage` order."""
    if extra_parts(dtype.name):
        return QTensor(arrays[0], arrays[1], dtype.fmt, dtype.group, None, tuple(arrays[2:]))
    glob = arrays[2] if len(arrays) > 2 else None
    return QTensor(arrays[0], arrays[1], dtype.fmt, dtype.block or dtype.group, glob)


def slot_of(w: QTensor, slot) -> QTensor:
    """One layer's matrix of a stacked quantised weight."""
    glob = None if w.glob is None else w.glob[slot]
    return QTensor(w.codes[slot], w.scales[slot], w.fmt, w.group, glob, tuple(e[slot] for e in w.extra))


def f16_half(words, half: int) -> jnp.ndarray:
    """The f16 in the low (0) or high (1) 16 bits of uint32 words, as f32 (exact)."""
    bits = ((words >> jnp.uint32(16 * half)) & jnp.uint32(0xFFFF)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _gguf(w: QTensor) -> jnp.ndarray:
    """GGUF blocks of 32 inputs, in f32 as llama.cpp decodes them: Q8_0 `d * q`, Q4_0
    `d * (q - 8)`, Q4_1 `d * q + m` (each product exact in f32; Q4_1's sum rounds once)."""
    f = GGUF[w.fmt]
    q = (unpack_nibbles(w.codes) if f.nibbles else w.codes).astype(jnp.float32)
    if w.fmt == "q4_0":
        q = q - 8.0
    if f.words_per == 1:  # Q4_1: d | m << 16 per block
        return q * jnp.repeat(f16_half(w.scales, 0), 32, axis=-2) + jnp.repeat(f16_half(w.scales, 1), 32, axis=-2)
    d = jnp.stack([f16_half(w.scales, 0), f16_half(w.scales, 1)], axis=-2)  # [..., K/64, 2, N]
    *lead, k64, _, n = d.shape
    return q * jnp.repeat(d.reshape(*lead, 2 * k64, n), 32, axis=-2)


def _bytes_of(words, count: int):
    """uint32 words [..., W, N] -> their `count` bytes [..., count, N] as int32, byte 0 first."""
    b = (words[..., :, None, :] >> (jnp.arange(4, dtype=jnp.uint32) * 8)[:, None]) & jnp.uint32(255)
    *lead, w, _, n = b.shape
    return b.reshape(*lead, w * 4, n)[..., :count, :].astype(jnp.int32)


def _k_scale_min(b) -> tuple:
    """Q4_K/Q5_K's 12 bytes [..., 12, N] -> 6-bit scales and mins [..., 8, N] (ggml's
    `get_scale_min_k4`): sub-blocks 0..3 in the low 6 bits of bytes 0..3 and 4..7; 4..7 in the
    nibbles of bytes 8..11, their top 2 bits in the top bits of bytes 0..3 and 4..7."""
    lo, mid, hi = b[..., 0:4, :], b[..., 4:8, :], b[..., 8:12, :]
    sc = jnp.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=-2)
    m = jnp.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-2)
    return sc, m


def _kquant(w: QTensor) -> jnp.ndarray:
    """K-quant super-blocks of 256 inputs (dtypes.storage) in f32 as llama.cpp decodes them:
    Q4_K/Q5_K `(d * sc) * q - dmin * m` per sub-block of 32, Q6_K `(d * sc) * (q - 32)` per 16."""
    f = GGUF[w.fmt]
    q = unpack_nibbles(w.codes)
    *lead, k, n = q.shape
    s = k // 256
    if f.high:
        bits, per = 32 // f.high, f.high  # bits per input, inputs per word
        h = w.extra[0].reshape(*lead, s, 1, 256 // per, n) >> (jnp.arange(per, dtype=jnp.uint32) * bits)[:, None, None]
        q = q | ((h & jnp.uint32(2**bits - 1)).astype(jnp.int32) << 4).reshape(*lead, k, n)
    words = w.scales.reshape(*lead, s, 4, n)
    if w.fmt == "q6_k":
        sc = _bytes_of(words, 16)
        sc = jnp.where(sc >= 128, sc - 256, sc).astype(jnp.float32)  # int8
        d = jnp.stack([f16_half(w.extra[1], 0), f16_half(w.extra[1], 1)], axis=-2).reshape(*lead, s, 1, n)
        scale = (d * sc)[..., None, :]  # [..., s, 16, 1, N]
        return (scale * (q - 32).astype(jnp.float32).reshape(*lead, s, 16, 16, n)).reshape(*lead, k, n)
    sc, m = _k_scale_min(_bytes_of(words[..., 1:4, :], 12))
    d, dmin = f16_half(words[..., 0:1, :], 0), f16_half(words[..., 0:1, :], 1)
    scale, mins = (d * sc.astype(jnp.float32))[..., None, :], (dmin * m.astype(jnp.float32))[..., None, :]
    return (scale * q.astype(jnp.float32).reshape(*lead, s, 8, 32, n) - mins).reshape(*lead, k, n)


def dequantize(w: QTensor) -> jnp.ndarray:
    """Decode a quantised weight to f32 of its logical shape [..., K, N]."""
    if w.fmt.endswith(":block"):
        return _block(w)
    if w.fmt in GGUF and GGUF[w.fmt].super_block:
        return _kquant(w)
    if w.fmt in GGUF:
        return _gguf(w)
    vals, scale = GROUP_DECODERS[w.fmt](w)
    out = vals * jnp.repeat(scale, w.group, axis=-2)
    return out if w.glob is None else out * jnp.asarray(w.glob, jnp.float32)


def quantize(dtype: DType, w: np.ndarray) -> QTensor:
    """Round an f32 [..., K, N] array to `dtype` (nearest code, per-group or per-block scale): numpy."""
    w = np.asarray(w, np.float32)
    if dtype.block:
        return _quantize_block(dtype, w)
    if dtype.gguf and GGUF[dtype.name].super_block:
        return _quantize_kquant(dtype, w)
    if dtype.gguf:
        return _quantize_gguf(dtype, w)
    *lead, k, n = w.shape
    g = dtype.group
    blocks = w.reshape(*lead, k // g, g, n)
    amax = np.abs(blocks).max(axis=-2)
    if dtype.name == "nvfp4":
        return _quantize_nvfp4(blocks, amax)
    codes, scales = QUANTIZERS[dtype.name](dtype, blocks, amax)
    return QTensor(codes.reshape(*lead, -1, n), scales, dtype.fmt, g)


def _quantize_nvfp4(blocks: np.ndarray, amax: np.ndarray) -> QTensor:
    """NVIDIA's recipe: global = amax(tensor) / (448 * 6), so that each block's e4m3 scale
    amax(block) / 6 / global fits e4m3; the codes are the nearest e2m1 of value / (scale * global)."""
    import ml_dtypes

    *lead, kg, g, n = blocks.shape
    glob = np.maximum(amax.max(axis=(-2, -1), keepdims=True), 1e-30) / (448.0 * 6.0)
    scales = (amax / 6.0 / glob).astype(ml_dtypes.float8_e4m3fn)
    step = np.maximum(scales.astype(np.float32) * glob, 1e-30)[..., None, :]
    mag = np.abs(blocks) / step
    nib = np.abs(mag[..., None] - E2M1_VALUES).argmin(-1) | np.where(blocks < 0, 8, 0)
    codes = pack_nibbles(nib.reshape(*lead, kg * g, n))
    return QTensor(codes, scales, "nvfp4", g, glob.astype(np.float32))


def _q_mxfp4(dtype, blocks, amax):
    exp = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127)
    mag = np.abs(blocks) / np.exp2(exp)[..., None, :]
    nib = np.abs(mag[..., None] - E2M1_VALUES).argmin(-1) | np.where(blocks < 0, 8, 0)
    *lead, kg, g, n = nib.shape
    return pack_nibbles(nib.reshape(*lead, kg * g, n)), (exp + 127).astype(np.uint8)


def _q_int4(dtype, blocks, amax):
    scales = (np.maximum(amax, 1e-30) / 7.0).astype(numpy_dtype(dtype.scale or "bfloat16"))
    q = np.clip(np.round(blocks / scales.astype(np.float32)[..., None, :]), -8, 7)
    *lead, kg, g, n = q.shape
    return pack_nibbles((q.astype(np.int32) & 0xF).reshape(*lead, kg * g, n)), scales


def _q_int8(dtype, blocks, amax):
    scales = (np.maximum(amax, 1e-30) / 127.0).astype(np.float32)
    return np.clip(np.round(blocks / scales[..., None, :]), -127, 127).astype(np.int8), scales


def _q_fp8(dtype, blocks, amax):
    import ml_dtypes

    scales = (np.maximum(amax, 1e-30) / FP8_MAX[dtype.name]).astype(np.float32)
    return (blocks / scales[..., None, :]).astype(getattr(ml_dtypes, dtype.numpy)), scales


QUANTIZERS = {"mxfp4": _q_mxfp4, "int4": _q_int4, "int8": _q_int8, "fp8_e4m3": _q_fp8, "fp8_e5m2": _q_fp8}


def _quantize_block(dtype: DType, w: np.ndarray) -> QTensor:
    """fp8 codes and one f32 scale per [b, b] square (the edge squares zero-padded to find it)."""
    import ml_dtypes

    *lead, k, n = w.shape
    b = dtype.block
    kb, nb = -(-k // b), -(-n // b)
    pad = np.zeros((*lead, kb * b, nb * b), np.float32)
    pad[..., :k, :n] = w
    sq = pad.reshape(*lead, kb, b, nb, b)
    scales = (np.maximum(np.abs(sq).max(axis=(-3, -1)), 1e-30) / FP8_MAX[dtype.name]).astype(np.float32)
    full = np.repeat(np.repeat(scales, b, axis=-2), b, axis=-1)[..., :k, :n]
    return QTensor((w / full).astype(getattr(ml_dtypes, dtype.numpy)), scales, dtype.fmt, b)


def _quantize_gguf(dtype: DType, w: np.ndarray) -> QTensor:
    """Blocks of 32 inputs as llama.cpp's reference quantizers shape them (for tests: any codes
    and f16 fields of the format will do, the decode is what must be exact)."""
    *lead, k, n = w.shape
    b = w.reshape(*lead, k // 32, 32, n)
    lo, hi = b.min(axis=-2), b.max(axis=-2)
    if dtype.name == "q4_1":
        d = ((hi - lo) / 15.0).astype(np.float16)
        m = lo.astype(np.float16)
        inv = np.where(d == 0, 0.0, 1.0 / np.maximum(d.astype(np.float32), 1e-30))
        q = np.clip(np.round((b - m.astype(np.float32)[..., None, :]) * inv[..., None, :]), 0, 15)
        return QTensor(*pack_gguf(dtype.name, q.reshape(*lead, k, n), d, m), dtype.fmt, 32)
    top = {"q8_0": 127.0, "q4_0": 7.0}[dtype.name]
    d = (np.maximum(-lo, hi) / top).astype(np.float16)
    inv = np.where(d == 0, 0.0, 1.0 / np.maximum(d.astype(np.float32), 1e-30))
    q = np.clip(np.round(b * inv[..., None, :]), -top - (dtype.name == "q4_0"), top)
    q = q + 8 if dtype.name == "q4_0" else q
    return QTensor(*pack_gguf(dtype.name, q.reshape(*lead, k, n), d), dtype.fmt, 32)


def _quantize_kquant(dtype: DType, w: np.ndarray) -> QTensor:
    """Super-blocks of 256 inputs shaped as llama.cpp's K-quants (for tests: simple rounding, not
    ggml's search; any codes and fields of the format will do, the decode is what must be exact)."""
    *lead, k, n = w.shape
    s = k // 256
    if dtype.name == "q6_k":
        b = w.reshape(*lead, s, 16, 16, n)
        scale = np.abs(b).max(axis=-2) / 31.0  # [..., s, 16, N]
        d = (scale.max(axis=-2) / 127.0).astype(np.float16)
        sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)[..., None, :]), 0, 127)
        step = np.maximum(d.astype(np.float32)[..., None, :] * sc, 1e-30)[..., None, :]
        q = np.clip(np.round(b / step), -32, 31) + 32
        head = np.concatenate([np.moveaxis(sc.astype(np.int8), -2, -1).view(np.uint8), d[..., None].view(np.uint8)], -1)
        parts = pack_kquant(dtype.name, q.reshape(*lead, k, n), head)
        return QTensor(parts[0], parts[1], dtype.fmt, 256, None, parts[2:])
    top = 2.0 ** (dtype.bits) - 1
    b = w.reshape(*lead, s, 8, 32, n)
    lo = np.minimum(b.min(axis=-2), 0.0)
    scale, mins = (b.max(axis=-2) - lo) / top, -lo  # [..., s, 8, N]
    d, dmin = (scale.max(axis=-2) / 63.0).astype(np.float16), (mins.max(axis=-2) / 63.0).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-30)[..., None, :]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.maximum(dmin.astype(np.float32), 1e-30)[..., None, :]), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32)[..., None, :] * sc, 1e-30)[..., None, :]
    q = np.clip(np.round((b + (dmin.astype(np.float32)[..., None, :] * m)[..., None, :]) / step), 0, top)
    packed = np.concatenate(
        [sc[..., :4, :] | ((sc[..., 4:, :] >> 4) << 6), m[..., :4, :] | ((m[..., 4:, :] >> 4) << 6)], -2
    )
    packed = np.concatenate([packed, (sc[..., 4:, :] & 15) | ((m[..., 4:, :] & 15) << 4)], -2)  # [..., s, 12, N]
    fields = np.stack([d, dmin], -1).view(np.uint8).reshape(*lead, s, n, 4)
    head = np.concatenate([fields, np.moveaxis(packed, -2, -1)], -1)
    parts = pack_kquant(dtype.name, q.reshape(*lead, k, n), head)
    return QTensor(parts[0], parts[1], dtype.fmt, 256, None, parts[2:])


def pack_kquant(fmt: str, q: np.ndarray, head: np.ndarray) -> tuple[np.ndarray, ...]:
    """Codes [..., K, N] (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) and each super-block's other bytes
    as the file stores them ([..., K/256, N, 16 or 18] uint8, `gguf_blocks.HEAD`) into the
    format's storage parts (dtypes.storage: codes, scales, then `high`, Q6_K's `d`), bit for bit."""
    f = GGUF[fmt]
    *lead, k, n = q.shape
    s = k // 256
    q = np.asarray(q).astype(np.uint32)
    head = np.ascontiguousarray(head, np.uint8)
    out = [pack_nibbles(q & 15)]
    words = head[..., 0:16].copy().view("<u4")  # [..., s, N, 4]
    out.append(np.moveaxis(words, -1, -2).reshape(*lead, 4 * s, n).astype(np.uint32))
    if f.high:
        bits, per = 32 // f.high, f.high
        hb = (q >> 4).reshape(*lead, s, per, 256 // per, n) << (np.arange(per, dtype=np.uint32) * bits)[:, None, None]
        out.append(np.bitwise_or.reduce(hb, axis=-3).reshape(*lead, k // per, n).astype(np.uint32))
    if fmt == "q6_k":
        d = head[..., 16:18].copy().view("<u2")[..., 0].astype(np.uint32)  # [..., s, N]
        out.append(d[..., 0::2, :] | (d[..., 1::2, :] << 16))
    return tuple(out)


def pack_gguf(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Codes [..., K, N] (Q8_0: -128..127; Q4_x: 0..15) and the blocks' f16 d (and Q4_1's m),
    [..., K/32, N], into the format's storage (mkdsl/lang/dtypes.py `storage`), bit for bit."""
    f = GGUF[fmt]
    codes = pack_nibbles(q.astype(np.int32)) if f.nibbles else q.astype(np.int8)
    bits = np.asarray(d, np.float16).view(np.uint16).astype(np.uint32)
    if f.words_per == 1:
        return codes, bits | (np.asarray(m, np.float16).view(np.uint16).astype(np.uint32) << 16)
    return codes, bits[..., 0::2, :] | (bits[..., 1::2, :] << 16)


def pack_nibbles(nib: np.ndarray) -> np.ndarray:
    """int [..., K, N] nibbles (0..15) -> uint32 [..., K/8, N], low nibble first."""
    *lead, k, n = nib.shape
    nib = nib.astype(np.uint32).reshape(*lead, k // 8, 8, n)
    shifts = (np.arange(8, dtype=np.uint32) * 4)[:, None]
    return np.bitwise_or.reduce(nib << shifts, axis=-2).astype(np.uint32)
