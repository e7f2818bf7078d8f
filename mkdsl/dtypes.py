"""Element types, including quantised weight formats and how they are stored in HBM.

A quantised weight has a *logical* shape `[..., K, N]` (what the math sees) and a *storage*
made of plain arrays (packed codes and scales) that a loader writes and the kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    bits: int
    numpy: str | None  # name of the numpy/ml_dtypes type, None for packed formats
    float: bool = True
    group: int = 0  # inputs sharing one scale (quantised formats)

    @property
    def quantised(self) -> bool:
        return self.group > 0

    def __str__(self) -> str:
        return f"int4(group={self.group})" if self.name == "int4" else self.name


BF16 = DType("bf16", 16, "bfloat16")
F32 = DType("f32", 32, "float32")
I32 = DType("i32", 32, "int32", float=False)
FP8_E4M3 = DType("fp8_e4m3", 8, "float8_e4m3fn")
FP8_E5M2 = DType("fp8_e5m2", 8, "float8_e5m2")
MXFP4 = DType("mxfp4", 4, None, group=32)

PLAIN = {d.name: d for d in (BF16, F32, I32, FP8_E4M3, FP8_E5M2)}
ALL_NAMES = (*PLAIN, "mxfp4", "int4")


def int4(group: int) -> DType:
    return DType("int4", 4, None, group=group)


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
    way, plus one bf16 scale per `group` inputs.
    """
    if not dtype.quantised:
        return (StoragePart("", tuple(shape), dtype.numpy),)
    *lead, k, n = shape
    codes = StoragePart("codes", (*lead, k // 8, n), "uint32")
    if dtype.name == "mxfp4":
        return (codes, StoragePart("scales", (*lead, k // dtype.group, n), "uint8"))
    return (codes, StoragePart("scales", (*lead, k // dtype.group, n), "bfloat16"))


def storage_bytes(dtype: DType, shape: tuple) -> int:
    total = 0
    for part in storage(dtype, shape):
        total += int(np.prod(part.shape, dtype=np.int64)) * np.dtype(_np(part.dtype)).itemsize
    return total


def _np(name: str):
    import ml_dtypes  # noqa: F401  (registers bfloat16 and fp8 with numpy)

    return getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else np.dtype(name)
