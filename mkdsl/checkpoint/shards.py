"""A weight placed on a sharded mesh one device's shard at a time, so that the host holds one
shard and one stored tensor rather than the whole stacked weight (DeepSeek-V3's expert
projections are 218 GB each at full size; one device's shard is 1/64 of that).

Each device's shard is built from the pieces (a layer's, an expert's slice) it covers: read,
converted and cut to the shard's columns, then padded as the module's `pad_weights` pads (each
device's block of a `PADDED` axis followed by zeros), which it equals bit for bit. A piece that
several devices share is read again for each; consecutive devices asking for the same shard (a
weight replicated over an axis) get the last one built.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np


def kernel_names(t) -> list[str]:
    """The arrays a generated module takes for spec weight `t` (a quantised `w`: codes, scales;
    nvfp4's global scale too)."""
    from mkdsl.lang.dtypes import storage

    if not t.type.dtype.quantised:
        return [t.name]
    return [f"{t.name}_{p.suffix}" for p in storage(t.type.dtype, tuple(t.type.shape))]


def place_sharded(t, pieces: dict, lead: int, piece: Callable, module, shardings) -> dict:
    """`t`'s kernel arrays on the mesh. `pieces`: piece index (its first `lead` coordinates of
    the weight) -> piece; `piece(p)`: that piece's storage arrays in the spec's dtype."""
    import jax
    import ml_dtypes

    out = {}
    padded_axes = getattr(module, "PADDED", {})
    for part, name in enumerate(kernel_names(t)):
        shape, dtype = module.WEIGHTS[name]
        axes = padded_axes.get(name, ())
        axes = (axes,) if axes and isinstance(axes[0], int) else axes  # one (axis, ...) or one per axis
        pads = {ax % len(shape): (valid, padded) for ax, valid, padded, _ in axes}  # each device's block padded
        dtype = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
        build = functools.partial(_shard, part=part, dtype=dtype, pads=pads, lead=lead, pieces=pieces, piece=piece)
        shard = functools.partial(_last, tuple(shape), build, {})
        out[name] = jax.make_array_from_callback(tuple(shape), shardings[name], shard)
    return out


def _last(shape: tuple, build: Callable, last: dict, index) -> np.ndarray:
    """`build(key)` for one device's `index`, reusing the shard built last if it is the same."""
    key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
    if key not in last:
        last.clear()
        last[key] = build(key)
    return last[key]


def _shard(key, *, part: int, dtype, pads: dict, lead: int, pieces: dict, piece: Callable) -> np.ndarray:
    """One device's shard: `key` its (start, stop, step) per axis in the padded layout."""
    src = []
    for ax, (start, stop, _) in enumerate(key):
        if ax in pads:  # whole blocks of `padded` columns, `valid` of them real
            valid, padded = pads[ax]
            start, stop = start // padded * valid, -(-stop // padded) * valid
        src.append(range(start, stop))
    local = np.empty([len(r) for r in src], dtype)
    cut = tuple(slice(r.start, r.stop) for r in src[lead:])
    for idx in itertools.product(*src[:lead]):
        here = tuple(i - r.start for i, r in zip(idx, src, strict=False))
        p = pieces[idx]
        # a one-part piece: only this block is read (by offset where it can be); else cut here
        local[here] = piece(p, cut)[0] if part == 0 and len(p.names) == 1 and p.pair is None else piece(p)[part][cut]
    for ax, (valid, padded) in pads.items():
        blocks = np.moveaxis(local, ax, -1).reshape(*np.moveaxis(local, ax, -1).shape[:-1], -1, valid)
        blocks = np.pad(blocks, [(0, 0)] * (blocks.ndim - 1) + [(0, padded - valid)])
        local = np.moveaxis(blocks.reshape(*blocks.shape[:-2], -1), -1, ax)
    return local
