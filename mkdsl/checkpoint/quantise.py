"""A plain stored tensor read into a quantised spec weight: a dequantised save of a quantised
model (a bf16 Hugging Face save of gpt-oss or DeepSeek-V3), which a mapping names as an
alternative source (`... or "name" | steps`).

Exact where the values allow it: scales that are powers of two (mxfp4's E8M0 scales always are;
for fp8 blocks the smallest power of two that holds the block's largest value) give back every
value that was a code times such a scale, bit for bit (a bf16 save of MXFP4 weights always is).
Otherwise the values are rounded to nearest codes with the format's own scale rule
(`mkdsl.lang.quant.quantize`: DeepSeek's amax / 448 per block), which the mapping must accept
with `round`; without it the load stops, naming the tensor.
"""

from __future__ import annotations

import numpy as np

from mkdsl.lang.dtypes import DType
from mkdsl.lang.quant import E2M1_VALUES, FP8_MAX, QTensor, quantize


def exact_codes(dtype: DType, x: np.ndarray) -> QTensor | None:
    """`x` ([..., K, N], f32) in `dtype`'s storage if every value is a code times a power-of-two
    scale of its group or block, else None."""
    x = np.asarray(x, np.float32)
    if dtype.name == "mxfp4":
        q = quantize(dtype, x)  # its scales are powers of two, its codes the nearest
        *lead, k, n = x.shape
        groups = x.reshape(*lead, k // dtype.group, dtype.group, n)
        power = np.exp2(q.scales.astype(np.float32) - 127)[..., None, :]
        return q if np.isin(np.abs(groups / power), E2M1_VALUES).all() else None
    if dtype.block:
        return _exact_block(dtype, x)
    return None


def _exact_block(dtype: DType, x: np.ndarray) -> QTensor | None:
    import ml_dtypes

    *lead, k, n = x.shape
    b = dtype.block
    kb, nb = -(-k // b), -(-n // b)
    pad = np.zeros((*lead, kb * b, nb * b), np.float32)
    pad[..., :k, :n] = x
    amax = np.abs(pad.reshape(*lead, kb, b, nb, b)).max(axis=(-3, -1))
    scales = np.exp2(np.ceil(np.log2(np.maximum(amax, 2.0**-126) / FP8_MAX[dtype.name]))).astype(np.float32)
    full = np.repeat(np.repeat(scales, b, axis=-2), b, axis=-1)[..., :k, :n]
    scaled = x / full  # exact: a power of two
    codes = scaled.astype(getattr(ml_dtypes, dtype.numpy))
    return QTensor(codes, scales, dtype.fmt, b) if np.array_equal(codes.astype(np.float32), scaled) else None


def quantise(dtype: DType, x: np.ndarray, rounds: bool, name: str) -> tuple[tuple, bool]:
    """((codes, scales) in `dtype`'s storage, whether it rounded). Raises ValueError naming
    `name` if the values are not exact codes and the mapping does not say `round`."""
    q = exact_codes(dtype, x)
    if q is not None:
        return _storage(q), False
    if not rounds:
        raise ValueError(
            f"tensor `{name}` holds values that {dtype} cannot hold exactly (not codes times power-of-two "
            "scales: not a dequantised save of such weights); add `| round` to that source to accept rounding"
        )
    return _storage(quantize(dtype, x)), True


def _storage(q: QTensor) -> tuple:
    return (q.codes, q.scales)


def grid_values(dtype: DType, x: np.ndarray) -> np.ndarray:
    """`x` rounded to the nearest values `exact_codes` reads back exactly: codes times power-of-two
    scales (what a bf16 save of such weights holds; `verify --against transformers` gives its
    random model these weights)."""
    import ml_dtypes

    x = np.asarray(x, np.float32)
    if dtype.name == "mxfp4":
        q = quantize(dtype, x)
        *lead, k, n = x.shape
        groups = x.reshape(*lead, k // dtype.group, dtype.group, n)
        power = np.exp2(q.scales.astype(np.float32) - 127)[..., None, :]
        mag = np.abs(groups) / power
        nearest = E2M1_VALUES[np.abs(mag[..., None] - E2M1_VALUES).argmin(-1)]
        return (np.sign(groups) * nearest * power).reshape(x.shape)
    *lead, k, n = x.shape
    b = dtype.block
    kb, nb = -(-k // b), -(-n // b)
    pad = np.zeros((*lead, kb * b, nb * b), np.float32)
    pad[..., :k, :n] = x
    amax = np.abs(pad.reshape(*lead, kb, b, nb, b)).max(axis=(-3, -1))
    scales = np.exp2(np.ceil(np.log2(np.maximum(amax, 2.0**-126) / FP8_MAX[dtype.name]))).astype(np.float32)
    full = np.repeat(np.repeat(scales, b, axis=-2), b, axis=-1)[..., :k, :n]
    return (x / full).astype(getattr(ml_dtypes, dtype.numpy)).astype(np.float32) * full
