"""Quantised tensors a checkpoint stores as two, its codes and their scales (`"codes" * "scales"`
in a mapping): the kinds of pairs the loader reads, by their stored types, each read into one
element per value and a scale grid (`steps.Grid`), and how elements become the spec's storage.

Exact by construction: codes and scales are only moved and re-packed, never re-quantised.
Decoding into a plain dtype (a spec weight held in bf16) multiplies in f32 as the format's own
reference does: exact for MXFP4 (an e2m1 value times a power of two, short of overflow), one f32
rounding for fp8 times an f32 scale, which the mapping must accept with `round`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mkdsl.checkpoint import gguf_blocks
from mkdsl.checkpoint.steps import Grid
from mkdsl.lang.dtypes import DType
from mkdsl.lang.quant import E2M1_VALUES, QTensor, dequantize, pack_kquant, pack_nibbles


@dataclass(frozen=True)
class PairKind:
    """One stored kind: its name, the stored types of codes and scales, its grid from the stored
    shapes (and the spec's block, 0 if none), the elements from the stored codes, the values in
    f32, the spec format (`DType.fmt`) it holds exactly, the plain dtypes its values fit exactly."""

    name: str
    grid: Callable[[tuple, tuple, int], Grid | str]
    unpack: Callable[[np.ndarray], np.ndarray]
    decode: Callable[[np.ndarray, np.ndarray, Grid], np.ndarray]
    formats: frozenset[str]
    exact: frozenset[str]
    glob: bool = False  # a third stored tensor, the per-tensor f32 global scale (NVFP4); quantised targets only
    scales_like_codes: bool = False  # the second tensor is read in the first's shape


def _expand(scales: np.ndarray, grid: Grid) -> np.ndarray:
    """One scale per element."""
    for axis, g in enumerate(grid.groups):
        if g > 1:
            scales = np.repeat(scales, g, axis=axis)
    return scales[tuple(slice(0, n) for n in grid.shape)]


def _block_grid(codes: tuple, scales: tuple, block: int) -> Grid | str:
    """fp8 codes [..., n, k] and one f32 scale per [b, b] square, `[..., ceil(n/b), ceil(k/b)]`
    (DeepSeek-V3's `weight_scale_inv`). The block is the spec's, or else read off the shapes."""
    if len(codes) < 2 or len(scales) != len(codes) or scales[:-2] != codes[:-2]:
        return f"codes {list(codes)} and scales {list(scales)} are not a block-scaled matrix"
    b = block or max(-(-n // max(s, 1)) for n, s in zip(codes[-2:], scales[-2:], strict=True))
    want = codes[:-2] + tuple(-(-n // b) for n in codes[-2:])
    if scales != want or b & (b - 1):
        return f"scales {list(scales)} are not one per {b}x{b} block of codes {list(codes)} (expected {list(want)})"
    return Grid(codes, (1,) * (len(codes) - 2) + (b, b))


def _fp8_decode(codes: np.ndarray, scales: np.ndarray, grid: Grid) -> np.ndarray:
    return codes.astype(np.float32) * _expand(scales.astype(np.float32), grid)


def _mx_grid(codes: tuple, scales: tuple, block: int) -> Grid | str:
    """OpenAI's MXFP4: codes uint8 [..., n, k/32, 16], two e2m1 codes a byte; one E8M0 scale byte
    per 32 inputs, [..., n, k/32]."""
    if len(codes) < 3 or codes[-1] != 16 or scales != codes[:-1]:
        return f"codes {list(codes)} and scales {list(scales)} are not MXFP4 blocks ([..., n, k/32, 16] and [..., n, k/32])"
    return Grid(codes[:-2] + (codes[-2] * 32,), (1,) * (len(codes) - 2) + (32,))


def _mx_unpack(codes: np.ndarray) -> np.ndarray:
    """Byte b of block g holds input 32g + 2b in its low nibble and 32g + 2b + 1 in its high one."""
    nib = np.stack([codes & 15, codes >> 4], axis=-1)
    return nib.reshape(*codes.shape[:-2], codes.shape[-2] * 32)


def _mx_decode(nib: np.ndarray, scales: np.ndarray, grid: Grid) -> np.ndarray:
    """e2m1 (bit 3 the sign) times 2^(byte - 127), as mkdsl/lang/quant.py decodes mxfp4."""
    mag = E2M1_VALUES[nib & 7]
    power = np.ldexp(np.float32(1), _expand(scales, grid).astype(np.int32) - 127).astype(np.float32)
    return np.where(nib & 8, -mag, mag) * power


def _nv_grid(codes: tuple, scales: tuple, block: int) -> Grid | str:
    """NVIDIA ModelOpt's NVFP4: codes uint8 [..., n, k/2], two e2m1 codes a byte (the even input in
    the low nibble); one e4m3 scale per 16 inputs, [..., n, k/16]."""
    if len(codes) < 2 or scales[:-1] != codes[:-1] or scales[-1] * 8 != codes[-1]:
        return f"codes {list(codes)} and scales {list(scales)} are not NVFP4 ([..., n, k/2] and [..., n, k/16])"
    return Grid(codes[:-1] + (codes[-1] * 2,), (1,) * (len(codes) - 1) + (16,))


def _nv_unpack(codes: np.ndarray) -> np.ndarray:
    return np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def _nv_decode(nib: np.ndarray, scales: np.ndarray, grid: Grid) -> np.ndarray:
    raise AssertionError("NVFP4 decodes only into nvfp4 (its global scale is a third tensor)")


def _packed_grid(codes: tuple, scales: tuple, block: int) -> Grid | str:
    """MXFP4 as compressed-tensors packs it (Kimi K3's `weight_packed` / `weight_scale`): codes
    uint8 [..., n, k/2], two e2m1 codes a byte; one E8M0 scale byte per 32 inputs, [..., n, k/32]."""
    if len(codes) < 2 or scales[:-1] != codes[:-1] or codes[-1] * 2 != scales[-1] * 32:
        return f"codes {list(codes)} and scales {list(scales)} are not packed MXFP4 ([..., n, k/2] and [..., n, k/32])"
    return Grid(codes[:-1] + (codes[-1] * 2,), (1,) * (len(codes) - 1) + (32,))


def _packed_unpack(codes: np.ndarray) -> np.ndarray:
    """Byte j holds input 2j in its low nibble and 2j + 1 in its high one."""
    return np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def _product_grid(codes: tuple, scales: tuple, block: int) -> Grid | str:
    """Two stored tensors of the same size whose product is the weight (Kimi K3's residual norm
    gain times its projection, `[H]` and `[1, H]`): the second read in the first's shape."""
    if int(np.prod(codes)) != int(np.prod(scales)):
        return f"tensors {list(codes)} and {list(scales)} do not have the same size"
    return Grid(codes, (1,) * len(codes))


_FP8 = {"name": "fp8 codes with block scales", "grid": _block_grid, "unpack": lambda x: x}
_MX = {"formats": frozenset({"mxfp4"}), "exact": frozenset({"float32", "bfloat16"})}
_PRODUCT = {
    "name": "a product of two tensors",
    "grid": _product_grid,
    "unpack": lambda x: x,
    "decode": lambda a, b, grid: a.astype(np.float32) * b.astype(np.float32),
    "formats": frozenset(),
    "exact": frozenset({"float32"}),  # a product of two bf16 (or f16) values fits f32's 24 bits
    "scales_like_codes": True,
}
# (stored codes type, stored scales type) -> the kinds stored so, the first whose grid fits
PAIRS: dict[tuple[str, str], tuple[PairKind, ...]] = {
    ("F8_E4M3", "F32"): (
        PairKind(**_FP8, decode=_fp8_decode, formats=frozenset({"fp8_e4m3:block"}), exact=frozenset()),
    ),
    ("F8_E5M2", "F32"): (
        PairKind(**_FP8, decode=_fp8_decode, formats=frozenset({"fp8_e5m2:block"}), exact=frozenset()),
    ),
    ("U8", "U8"): (
        PairKind("MXFP4 blocks", _mx_grid, _mx_unpack, _mx_decode, **_MX),
        PairKind("packed MXFP4", _packed_grid, _packed_unpack, _mx_decode, **_MX),
    ),
    ("U8", "F8_E4M3"): (
        PairKind("NVFP4", _nv_grid, _nv_unpack, _nv_decode, frozenset({"nvfp4"}), frozenset(), glob=True),
    ),
    ("BF16", "BF16"): (PairKind(**_PRODUCT),),
    ("F32", "F32"): (PairKind(**_PRODUCT),),
}


def pair_kind(codes, scales, block: int) -> tuple[PairKind | None, Grid | str]:
    """The kind of a stored pair (`formats.Stored` infos) and its grid, or (None, why not)."""
    kinds = PAIRS.get((codes.dtype, scales.dtype), ())
    whys = []
    for kind in kinds:
        grid = kind.grid(codes.shape, scales.shape, block)
        if not isinstance(grid, str):
            return kind, grid
        whys.append(grid)
    return (kinds[0] if kinds else None), " (nor ".join(whys) + ")" * (len(whys) - 1) or "not a pair the loader reads"


def _gguf_grid(per: int) -> Callable[[tuple, tuple, int], Grid | str]:
    def grid(codes: tuple, scales: tuple, block: int) -> Grid | str:
        """One stored block tensor ([..., out, in], blocks of `per` along `in`): `codes` is its shape."""
        if len(codes) < 2 or codes[-1] % per:
            return f"a block tensor {list(codes)} with rows of whole {per}-input blocks"
        return Grid(codes, (1,) * (len(codes) - 1) + (per,))

    return grid


def _gguf_split(kind: str) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The stored bytes [..., out, row bytes] -> (codes [..., out, in], one uint32 word per block:
    its f16 d in the low half, Q4_1's f16 m in the high half; a K-quant's super-block bytes other
    than its codes as one opaque numpy void per super-block, so that mapping steps move them whole)."""

    def split(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        per, size = gguf_blocks.SIZES[kind]
        shape = (*raw.shape[:-1], raw.shape[-1] // size * per)
        if kind in gguf_blocks.HEAD:
            codes, head = gguf_blocks.split_k(raw, kind, shape)
            return codes, head.view(np.dtype((np.void, gguf_blocks.HEAD[kind])))[..., 0]
        codes, d, m = gguf_blocks.split(raw, kind, shape)
        words = d.view(np.uint16).astype(np.uint32)
        if m is not None:
            words |= m.view(np.uint16).astype(np.uint32) << 16
        return codes, words

    return split


def _head_bytes(head: np.ndarray) -> np.ndarray:
    """A K-quant's super-block voids [..., S, N] -> their bytes [..., S, N, HEAD]."""
    return np.ascontiguousarray(head).view(np.uint8).reshape(*head.shape, head.dtype.itemsize)


def _kquant_decode(kind: str):
    def decode(codes: np.ndarray, head: np.ndarray, grid: Grid) -> np.ndarray:
        """f32 values through the spec's storage and the reference decoder (the super-blocks'
        axis moved to K, the second to last, and back)."""
        axis = grid.groups.index(256)
        fmt = gguf_blocks.KEPT[kind]
        parts = pack_kquant(fmt, np.moveaxis(codes, axis, -2), _head_bytes(np.moveaxis(head, axis, -2)))
        w = dequantize(QTensor(parts[0], parts[1], fmt, 256, None, parts[2:]))
        return np.moveaxis(np.asarray(w), -2, axis)

    return decode


def _gguf_decode(kind: str):
    if kind in gguf_blocks.HEAD:
        return _kquant_decode(kind)

    def decode(codes: np.ndarray, words: np.ndarray, grid: Grid) -> np.ndarray:
        d = _expand((words & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32), grid)
        q = codes.astype(np.float32) - (8.0 if kind == "Q4_0" else 0.0)
        if kind != "Q4_1":
            return q * d
        return q * d + _expand((words >> 16).astype(np.uint16).view(np.float16).astype(np.float32), grid)

    return decode


# A GGUF block tensor kept as stored (one stored tensor, no `*`): stored type -> kind; the loader
# reads its bytes (`read_blocks`) and `unpack` gives both codes and block words.
BLOCKS: dict[str, PairKind] = {
    stored: PairKind(
        f"GGUF {stored} blocks",
        _gguf_grid(gguf_blocks.SIZES[stored][0]),
        _gguf_split(stored),
        _gguf_decode(stored),
        frozenset({fmt}),
        frozenset(),
    )
    for stored, fmt in gguf_blocks.KEPT.items()
}


def _pair_words(words: np.ndarray) -> np.ndarray:
    """Q8_0/Q4_0: the d of blocks 2i and 2i+1 of a column in one word (low, high)."""
    return words[..., 0::2, :] | (words[..., 1::2, :] << 16)


def target_groups(dtype: DType, ndim: int) -> tuple[int, ...]:
    """The scale grid of a spec quantised dtype over its logical [..., K, N] shape."""
    lead = (1,) * (ndim - 2)
    return lead + ((dtype.block, dtype.block) if dtype.block else (dtype.group, 1))


# Spec dtype name -> (elements [..., K, N], scales) in its storage (mkdsl/lang/dtypes.py `storage`).
STORAGE: dict[str, Callable] = {
    "mxfp4": lambda e, s: (pack_nibbles(e), s.astype(np.uint8)),
    "nvfp4": lambda e, s: (pack_nibbles(e), s),
    "fp8_e4m3": lambda e, s: (e, s.astype(np.float32)),
    "fp8_e5m2": lambda e, s: (e, s.astype(np.float32)),
    "q8_0": lambda e, s: (e.astype(np.int8), _pair_words(s.astype(np.uint32))),
    "q4_0": lambda e, s: (pack_nibbles(e), _pair_words(s.astype(np.uint32))),
    "q4_1": lambda e, s: (pack_nibbles(e), s.astype(np.uint32)),
    "q4_k": lambda e, s: pack_kquant("q4_k", e, _head_bytes(s)),
    "q5_k": lambda e, s: pack_kquant("q5_k", e, _head_bytes(s)),
    "q6_k": lambda e, s: pack_kquant("q6_k", e, _head_bytes(s)),
}
