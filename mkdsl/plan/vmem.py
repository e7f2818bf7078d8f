"""VMEM sizes as Mosaic lays arrays out: the last two dims padded to the dtype's tile.

f32 pads to [8, 128], bf16 to [16, 128], 8-bit types to [32, 128] (`8 * (32 // bits)`
sublanes on TPU7x); 4-bit data occupies a byte per element. A rank-1 array is one row.
"""

from __future__ import annotations

import math

MIB = 1 << 20
VMEM_PER_CORE = 64 * MIB  # TPU7x
DEFAULT_CAP = 58 * MIB  # leaves room for the compiler's internal scratch (~2.7 MiB seen)

_BITS = {
    "float32": 32,
    "int32": 32,
    "uint32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
    "uint8": 8,
}


def padded_bytes(shape: tuple[int, ...], dtype: str) -> int:
    bits = max(_BITS[dtype], 8)
    sublanes = 8 * (32 // bits)
    rows = shape[-2] if len(shape) >= 2 else 1
    cols = shape[-1] if shape else 1
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return lead * _round_up(rows, sublanes) * _round_up(cols, 128) * bits // 8


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"
