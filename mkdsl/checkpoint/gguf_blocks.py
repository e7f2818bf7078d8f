"""GGUF block formats read from their bytes (numpy), written from ggml's published block layouts:
each row of a stored `[out, in]` matrix is a run of blocks along `in`, little-endian.

- Q8_0, 34 bytes per 32 inputs: f16 `d`, 32 int8 `q`; value `d * q`.
- Q4_0, 18 bytes: f16 `d`, 16 bytes of nibbles (input j in the low nibble of byte j, input
  j + 16 in its high nibble); value `d * (q - 8)`.
- Q4_1, 20 bytes: f16 `d`, f16 `m`, the nibbles as Q4_0; value `d * q + m`.
- Q4_K, 144 bytes per 256 inputs: f16 `d`, f16 `dmin`, 12 bytes of 6-bit sub-block scales and
  mins (8 sub-blocks of 32), 128 bytes of nibbles (64 inputs per 32 bytes: low nibbles first);
  value `(d * sc) * q - dmin * m`.
- Q5_K, 176 bytes: as Q4_K plus 32 bytes of fifth bits before the nibbles (bit 2i of byte l is
  input l of sub-block 2i, bit 2i+1 of sub-block 2i+1).
- Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (sub-blocks
  of 16), f16 `d`; value `(d * sc) * (q - 32)`.

Every decode multiplies in f32 in ggml's order, so the values are the ones llama.cpp computes.
`split` gives the Q8_0/Q4_x codes and f16 fields without decoding, `split_k` a K-quant's codes and
its super-blocks' other bytes (kept as stored: `dtypes.GGUF`).
"""

from __future__ import annotations

import numpy as np

# type name -> (inputs per block, bytes per block)
SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q5_K": (256, 176)}
SIZES["Q6_K"] = (256, 210)
# Stored type -> the spec dtype that holds it as stored (mkdsl/lang/dtypes.py GGUF).
KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}
# A K-quant's bytes per super-block other than its codes: Q4_K/Q5_K d, dmin and 12 bytes of
# scales and mins; Q6_K 16 int8 scales then d.
HEAD = {"Q4_K": 16, "Q5_K": 16, "Q6_K": 18}


def _blocks(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes as [rows, blocks per row, bytes per block]."""
    per, size = SIZES[kind]
    *rows, cols = shape
    return np.asarray(raw, np.uint8).reshape(int(np.prod(rows, dtype=np.int64)), cols // per, size)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles (inputs 0..15), then the high ones (16..31)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def split(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes [..., in] as stored: int8 for Q8_0, 0..15 for Q4_x; f16 d [..., in/32]; Q4_1's f16 m)."""
    b = _blocks(raw, kind, shape)
    out = shape[:-1]
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].reshape(*out, -1)
    if kind == "Q8_0":
        return b[..., 2:].view(np.int8).reshape(shape), d, None
    start = 4 if kind == "Q4_1" else 2
    codes = _nibbles(b[..., start:]).reshape(shape)
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].reshape(*out, -1) if kind == "Q4_1" else None
    return codes, d, m


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 6-bit scales and 8 mins: sub-blocks 0..3 in the low 6 bits of
    bytes 0..3 (scales) and 4..7 (mins); 4..7 in the nibbles of bytes 8..11 with their top 2 bits
    in the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    s = s.astype(np.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([lo_sc, hi_sc], -1), np.concatenate([lo_m, hi_m], -1)


def _k4(b: np.ndarray, fifth: np.ndarray | None) -> np.ndarray:
    """Q4_K (fifth None) or Q5_K: [n, 144 or 176] -> [n, 256] f32."""
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, m = _k_scales(b[:, 4:16])
    q = _k4_codes(b, fifth).reshape(-1, 8, 32)  # 8 sub-blocks of 32
    scale = (d * sc.astype(np.float32))[..., None]
    mins = (dmin * m.astype(np.float32))[..., None]
    return (scale * q.astype(np.float32) - mins).reshape(-1, 256)


def _q6k(b: np.ndarray) -> np.ndarray:
    """Q6_K: [n, 210] -> [n, 256] f32. Per half of 128 inputs: 64 bytes of low nibbles, 32 of
    high pairs; input 32i + l (i = 0..3) has the low (i < 2) or high nibble of byte l + 32(i % 2)
    and bits 2i, 2i+1 of high byte l."""
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 16)
    d = _f16(b[:, 208:210])[:, None]
    q = _q6k_codes(b).astype(np.int32) - 32
    scale = (d * sc)[..., None]  # sub-blocks of 16
    return (scale * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)


def _q6k_codes(b: np.ndarray) -> np.ndarray:
    """Q6_K's 6-bit codes (0..63, before `- 32`) of [n, 210] blocks, in input order [n, 256]."""
    ql, qh = b[:, 0:128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 32)
    low = np.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = np.stack([(qh >> (2 * i)) & 3 for i in range(4)], axis=2)
    return (low | (high << 4)).reshape(-1, 256)


def _k4_codes(b: np.ndarray, fifth: np.ndarray | None) -> np.ndarray:
    """Q4_K/Q5_K's codes (0..15 or 0..31) of [n, 144 or 176] blocks, in input order [n, 256]."""
    qs = b[:, -128:].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    if fifth is not None:
        q = q | (((fifth[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    return q.reshape(-1, 256)


def split_k(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant tensor as (codes [..., in] uint8 in input order: Q4_K 0..15, Q5_K 0..31 with the
    fifth bit, Q6_K 0..63; its super-blocks' other bytes [..., in/256, HEAD] as stored: Q4_K/Q5_K
    bytes 0..15, Q6_K bytes 192..209)."""
    b = _blocks(raw, kind, shape).reshape(-1, SIZES[kind][1])
    if kind == "Q6_K":
        codes, head = _q6k_codes(b), b[:, 192:210]
    else:
        codes, head = _k4_codes(b, b[:, 16:48] if kind == "Q5_K" else None), b[:, 0:16]
    return codes.reshape(shape), np.ascontiguousarray(head).reshape(*shape[:-1], shape[-1] // 256, HEAD[kind])


def decode(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """A stored block tensor as f32 of `shape` (numpy order, blocks along the last axis)."""
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        codes, d, m = split(raw, kind, shape)
        q = codes.astype(np.float32) - (8.0 if kind == "Q4_0" else 0.0)
        dd = np.repeat(d.astype(np.float32), 32, axis=-1)
        return q * dd + np.repeat(m.astype(np.float32), 32, axis=-1) if m is not None else q * dd
    b = _blocks(raw, kind, shape).reshape(-1, SIZES[kind][1])
    if kind == "Q6_K":
        return _q6k(b).reshape(shape)
    return _k4(b, b[:, 16:48] if kind == "Q5_K" else None).reshape(shape)
