"""Random weights and state for a model: for tests, smoke runs and compile checks.

Scaled so activations stay O(1) through any depth: matrices ~ N(0, 1/in), norm weights near
one, embeddings ~ N(0, 1). Quantised weights are rounded from such a matrix.
"""

from __future__ import annotations

import numpy as np

from mkdsl.lang.dtypes import numpy_dtype
from mkdsl.lang.ir import Model, Tensor
from mkdsl.lang.quant import QTensor, quantize, storage_arrays


def concrete_shape(shape: tuple, sizes: dict[str, int]) -> tuple[int, ...]:
    """Replace build-time dims (`B`, `S`, ...) by their sizes."""
    return tuple(sizes[d] if isinstance(d, str) else d for d in shape)


def random_tensor(t: Tensor, sizes: dict[str, int], rng: np.random.Generator):
    shape = concrete_shape(t.full_shape, sizes)
    if t.type.dtype.quantised:
        return quantize(t.type.dtype, rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2]))
    if len(t.type.shape) == 1:
        x = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
    elif t.kind == "state" or t.name.startswith("embed"):
        x = rng.standard_normal(shape, np.float32)
    else:
        x = rng.standard_normal(shape, np.float32) / np.sqrt(shape[-2])
    return x.astype(numpy_dtype(t.type.dtype.numpy))


def random_params(model: Model, sizes: dict[str, int], seed: int) -> tuple[dict, dict]:
    """(weights, state) with every tensor drawn from one seeded generator, in spec order."""
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray | QTensor] = {}
    state: dict[str, np.ndarray] = {}
    for t in model.tensors:
        (weights if t.kind == "weight" else state)[t.name] = random_tensor(t, sizes, rng)
    return weights, state


def kernel_weights(weights: dict) -> dict:
    """Weights as a generated kernel takes them: a quantised `w` becomes `w_codes`, `w_scales`."""
    out = {}
    for name, w in weights.items():
        if isinstance(w, QTensor):
            out.update(storage_arrays(name, w))
        else:
            out[name] = w
    return out
