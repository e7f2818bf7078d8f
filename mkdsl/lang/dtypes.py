"""Element types, including quantised weight formats and how they are stored in HBM.

A quantised weight has a *logical* shape `[..., K, N]` (what the math sees) and a *storage*
made of plain arrays (codes and scales) that a loader writes and the kernel reads.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    bits: int
    numpy: str | None  # numpy/ml_dtypes name of the element (of the codes if scaled); None: packed 4-bit
    float: bool = True
    group: int = 0  # inputs (along K) sharing one scale per column (group-scaled formats)
    block: int = 0  # one scale per [block, block] square of [K, N] (block-scaled fp8)
    scale: str = ""  # numpy name of the group scales where the format lets the spec choose (int4)

    @property
    def quantised(self) -> bool:
        """Stored as codes and scales (two arrays), not as one plain array."""
        return self.group > 0 or self.block > 0

    @property
    def fmt(self) -> str:
        """The format's name in a `QTensor` (mkdsl/lang/quant.py): the element, `:block` if block-scaled."""
        return f"{self.name}:block" if self.block else self.name

    @property
    def gguf(self) -> bool:
        """A GGUF block format (llama.cpp's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), kept as the file stores it."""
        return self.name in GGUF

    def k_multiple(self) -> int:
        """What the input dimension K must be a multiple of (packed nibbles: 8 per uint32 word;
        GGUF Q8_0/Q4_0: two blocks' f16 scales per uint32 word; K-quants: whole super-blocks of
        256, Q6_K two of them, whose f16 `d` share one word)."""
        if self.block:
            return 1
        if self.gguf:
            return GGUF[self.name].k_multiple
        return math.lcm(self.group, 8) if self.bits == 4 else self.group

    def __str__(self) -> str:
        if self.block:
            return f"{self.name}(block={self.block})"
        if self.name == "int4" and self.scale == "float32":
            return f"int4(group={self.group}, scale=f32)"
        if self.group and self.name not in FIXED_GROUP and not self.gguf:
            return f"{self.name}(group={self.group})"
        return self.name


BF16 = DType("bf16", 16, "bfloat16")
F32 = DType("f32", 32, "float32")
I32 = DType("i32", 32, "int32", float=False)
FP8_E4M3 = DType("fp8_e4m3", 8, "float8_e4m3fn")
FP8_E5M2 = DType("fp8_e5m2", 8, "float8_e5m2")
MXFP4 = DType("mxfp4", 4, None, group=32)
# NVIDIA's NVFP4: e2m1 codes, one fp8 e4m3 scale per 16 inputs and one f32 scale per tensor
NVFP4 = DType("nvfp4", 4, None, group=16)
FIXED_GROUP = {d.name: d for d in (MXFP4, NVFP4)}  # 4-bit float formats whose group is the format's

PLAIN = {d.name: d for d in (BF16, F32, I32, FP8_E4M3, FP8_E5M2)}
# Dtypes that take parameters: int4 and int8 need `group`, fp8 may take `group` or `block`.
SCALED = ("int4", "int8", "fp8_e4m3", "fp8_e5m2")
INT4_SCALES = {"bf16": "bfloat16", "f32": "float32"}  # `int4(group=G, scale=...)`; bf16 if not given


@dataclass(frozen=True)
class GGUFFormat:
    """A GGUF block format as mkdsl stores it: codes (uint32 words of 8 nibbles, or int8) and
    uint32 words of the blocks' f16 fields (`words_per`: blocks per scale word)."""

    dtype: DType
    nibbles: bool  # 4-bit codes packed 8 per uint32 word; else one int8 code per value
    words_per: int  # blocks whose f16 scale shares one uint32 word (2: Q8_0, Q4_0; 1: Q4_1's d and m)
    k_multiple: int
    high: int = 0  # K-quants: inputs per uint32 word of the codes' bits above the nibble (Q5_K 32, Q6_K 16)
    why: str = ""  # why K must be a multiple of `k_multiple` (the checker's hint)

    @property
    def super_block(self) -> bool:
        """A K-quant: super-blocks of 256 inputs, their scales packed in 4 uint32 words per column."""
        return self.dtype.group == 256


# llama.cpp's ggml block formats (32 inputs per block along a row): Q8_0 `d * q` (q int8), Q4_0
# `d * (q - 8)`, Q4_1 `d * q + m` (q a nibble), d and m f16.
GGUF = {
    "q8_0": GGUFFormat(DType("q8_0", 8, "int8", float=False, group=32), False, 2, 64),
    "q4_0": GGUFFormat(DType("q4_0", 4, None, float=False, group=32), True, 2, 64),
    "q4_1": GGUFFormat(DType("q4_1", 4, None, float=False, group=32), True, 1, 32),
}
# The K-quants: super-blocks of 256 inputs in 8 (Q4_K, Q5_K) or 16 (Q6_K) sub-blocks. Q4_K
# `(d * sc) * q - dmin * m` with 6-bit sub-block scales sc and mins m packed in 12 bytes, q a
# nibble; Q5_K the same with a fifth bit on q; Q6_K `(d * sc) * (q - 32)`, q 6 bits, sc int8.
_SB = "K-quant super-blocks are 256 inputs"
GGUF |= {
    "q4_k": GGUFFormat(DType("q4_k", 4, None, float=False, group=256), True, 8, 256, 0, _SB),
    "q5_k": GGUFFormat(DType("q5_k", 5, None, float=False, group=256), True, 8, 256, 32, _SB),
    "q6_k": GGUFFormat(
        DType("q6_k", 6, None, float=False, group=256),
        True,
        8,
        512,
        16,
        _SB + ", and q6_k keeps the f16 d of two in one word",
    ),
}
ALL_NAMES = (*PLAIN, *FIXED_GROUP, "int4", "int8", *GGUF)


def int4(group: int, scale: str = "bfloat16") -> DType:
    return DType("int4", 4, None, group=group, scale=scale)


def int8(group: int) -> DType:
    return DType("int8", 8, "int8", float=False, group=group)


def fp8(name: str, group: int = 0, block: int = 0) -> DType:
    """`fp8_e4m3(group=G)` (one f32 scale per G inputs of a column; G = K: per channel) or
    `fp8_e4m3(block=B)` (one f32 scale per B x B block, as DeepSeek-V3 ships its weights)."""
    return DType(name, 8, PLAIN[name].numpy, group=group, block=block)


@dataclass(frozen=True)
class StoragePart:
    """One plain array of a tensor's HBM storage: suffix, shape and numpy dtype name."""

    suffix: str
    shape: tuple
    dtype: str


def storage(dtype: DType, shape: tuple) -> tuple[StoragePart, ...]:
    """How a tensor of logical `shape` is laid out in HBM.

    mxfp4: e2m1 codes, 8 per uint32 along the input (second-to-last) axis, low nibble first,
    plus one E8M0 exponent byte per 32 inputs. int4: two's-complement nibbles packed the same
    way, plus one bf16 (or f32) scale per `group` inputs. nvfp4: e2m1 codes packed as mxfp4's, one
    fp8 e4m3 scale per 16 inputs and one f32 `global` scale per matrix (`[..., 1, 1]`: each layer's
    matrix its own). int8 and fp8 with `group`: one code per
    element, plus one f32 scale per `group` inputs of a column. fp8 with `block`: one code per
    element, plus one f32 scale per [block, block] square, `[ceil(K/block), ceil(N/block)]`.
    """
    if not dtype.quantised:
        return (StoragePart("", tuple(shape), dtype.numpy),)
    *lead, k, n = shape
    if dtype.gguf:
        return _gguf_storage(GGUF[dtype.name], lead, k, n)
    if dtype.block:
        b = dtype.block
        return (
            StoragePart("codes", (*lead, k, n), dtype.numpy),
            StoragePart("scales", (*lead, -(-k // b), -(-n // b)), "float32"),
        )
    if dtype.bits == 8:
        return (
            StoragePart("codes", (*lead, k, n), dtype.numpy),
            StoragePart("scales", (*lead, k // dtype.group, n), "float32"),
        )
    codes = StoragePart("codes", (*lead, k // 8, n), "uint32")
    if dtype.name == "mxfp4":
        return (codes, StoragePart("scales", (*lead, k // dtype.group, n), "uint8"))
    if dtype.name == "nvfp4":
        scales = StoragePart("scales", (*lead, k // dtype.group, n), "float8_e4m3fn")
        return (codes, scales, StoragePart("global", (*lead, 1, 1), "float32"))
    return (codes, StoragePart("scales", (*lead, k // dtype.group, n), dtype.scale or "bfloat16"))


def _gguf_storage(f: GGUFFormat, lead: list, k: int, n: int) -> tuple[StoragePart, ...]:
    """GGUF blocks, moved into mkdsl's [K, N] layout without changing a bit of them: codes as
    int4's words (unsigned nibbles) or int8; the f16 fields as uint32 words: Q4_1 `d | m << 16`
    per block, Q8_0/Q4_0 `d(2i) | d(2i+1) << 16` for blocks 2i, 2i+1 of a column (so as many
    bytes as the file holds: 8.5, 4.5 and 5 bits per weight). K-quants: `_kquant_storage`."""
    if f.super_block:
        return _kquant_storage(f, lead, k, n)
    codes = (
        StoragePart("codes", (*lead, k // 8, n), "uint32") if f.nibbles else StoragePart("codes", (*lead, k, n), "int8")
    )
    return (codes, StoragePart("scales", (*lead, k // (32 * f.words_per), n), "uint32"))


def _kquant_storage(f: GGUFFormat, lead: list, k: int, n: int) -> tuple[StoragePart, ...]:
    """A K-quant's super-blocks (256 inputs of a column) as the file's bytes, re-arranged along K:
    `codes`, the low nibbles as `q4_1`'s; `scales`, 4 uint32 words per super-block: Q4_K/Q5_K
    `d | dmin << 16` then the 12 bytes of packed 6-bit scales and mins as stored, Q6_K the 16
    int8 sub-block scales as stored; Q5_K/Q6_K `high`, the bits above the nibble (1 or 2 per
    input; word j of a super-block holds inputs j, j + W, j + 2W, ... with W its words, lowest
    bits first); Q6_K `d`, the f16 d of super-blocks 2i and 2i + 1 in one word. So 4.5, 5.5
    and 6.5625 bits per weight, as the file holds."""
    parts = [StoragePart("codes", (*lead, k // 8, n), "uint32"), StoragePart("scales", (*lead, k // 64, n), "uint32")]
    if f.high:
        parts.append(StoragePart("high", (*lead, k // f.high, n), "uint32"))
    if f.dtype.name == "q6_k":
        parts.append(StoragePart("d", (*lead, k // 512, n), "uint32"))
    return tuple(parts)


def extra_parts(name: str) -> tuple[str, ...]:
    """The storage parts of dtype `name` after its codes and scales that `QTensor.extra` holds
    (K-quants: `high`, Q6_K's `d`); none for other formats."""
    f = GGUF.get(name)
    if f is None or not f.super_block:
        return ()
    return ("high",) * bool(f.high) + ("d",) * (name == "q6_k")


# Bytes per element of the storage dtypes, so sizing a plan (`mkdsl check`) needs no ml_dtypes
# import (0.7 s in ml_dtypes 0.7); anything else asks numpy through ml_dtypes.
ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float32": 4, "uint32": 4, "uint8": 1, "int8": 1}


def itemsize(name: str) -> int:
    return ITEMSIZE[name] if name in ITEMSIZE else numpy_dtype(name).itemsize


def storage_bytes(dtype: DType, shape: tuple) -> int:
    """Bytes of a tensor's HBM storage."""
    return _storage_bytes(dtype, tuple(shape))


@functools.cache  # the planner asks ~10^5 times a compile, for a few hundred tensors
def _storage_bytes(dtype: DType, shape: tuple) -> int:
    return sum(math.prod(part.shape) * itemsize(part.dtype) for part in storage(dtype, shape))


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a storage dtype name (bfloat16 and the fp8 kinds from ml_dtypes, imported
    only here: it costs 0.7 s at import in ml_dtypes 0.7, which `mkdsl check` does not pay)."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
