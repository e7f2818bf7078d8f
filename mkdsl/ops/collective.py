"""Collectives: inserted by the shard pass (mkdsl/spmd/shard.py), never written in a spec.

In the per-device model a value is either whole on every device or split over mesh axes; these
ops move between the two. Their reference is the identity on the global model, where every
value is whole, so the unfused reference never runs them.
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.prefill import device_index
from mkdsl.ops.registry import REQUIRED, Cost, OpDef, nbytes, numel, register

# The conversions the shard pass inserts: partial sums to whole, split to whole, whole to split.
SUM_PARTIALS, GATHER_SPLITS, TAKE_MINE = "all_reduce", "all_gather", "shard_slice"


def _same(args, attrs):
    return (args[0].type,)


def _gathered(args, attrs):
    x = args[0].type
    return (TensorType(x.dtype, (*x.shape[:-1], x.shape[-1] * attrs["ways"])),)


def _mine(args, attrs):
    x = args[0].type
    return (TensorType(x.dtype, (*x.shape[:-1], x.shape[-1] // attrs["ways"])),)


# ---- per-device prefill (mkdsl/run/prefill_spmd.py): the exchange over the mesh, as the kernel's


def _all_reduce_spmd(rows, arrays, attrs):
    return (jax.lax.psum(arrays[0], tuple(attrs["axes"])),)


def _all_gather_spmd(rows, arrays, attrs):
    return (jax.lax.all_gather(arrays[0], tuple(attrs["axes"]), axis=arrays[0].ndim - 1, tiled=True),)


def _shard_slice_spmd(rows, arrays, attrs):
    x = arrays[0]
    n = x.shape[-1] // attrs["ways"]
    return (jax.lax.dynamic_slice_in_dim(x, device_index(attrs["axes"]) * n, n, axis=x.ndim - 1),)


register(
    OpDef(
        SUM_PARTIALS,
        ("x",),
        _same,
        lambda x, axes: (x,),
        lambda ins, outs, a: Cost(),
        attrs={"axes": REQUIRED},
        doc="Sum of the devices' partial values over mesh `axes` (after row-parallel projections).",
        internal=True,
        exchange="sum",
        spmd_prefill=_all_reduce_spmd,
    )
)

register(
    OpDef(
        GATHER_SPLITS,
        ("x",),
        _gathered,
        lambda x, axes, ways: (x,),
        lambda ins, outs, a: Cost(),
        attrs={"axes": REQUIRED, "ways": REQUIRED},
        doc="The devices' column slices over mesh `axes`, concatenated in mesh order.",
        internal=True,
        exchange="gather",
        spmd_prefill=_all_gather_spmd,
    )
)

register(
    OpDef(
        TAKE_MINE,
        ("x",),
        _mine,
        lambda x, axes, ways: (x,),
        lambda ins, outs, a: Cost(),
        attrs={"axes": REQUIRED, "ways": REQUIRED},
        doc="This device's column slice of a value every device holds whole (before a row-parallel projection).",
        internal=True,
        spmd_prefill=_shard_slice_spmd,
    )
)


# ---- deferred RMS norm (mkdsl/spmd/defer_norm.py): an all-reduced value's norm moved past the
# row-parallel projection it feeds, so its all-reduce becomes a reduce-scatter and the norm's row
# scale rides in the projection's own all-reduce.
SCATTER_SUMS, WEIGH_MINE, SCALED_SUM = "reduce_scatter", "norm_weight_mine", "all_reduce_scaled"


def _weigh_mine(x, w, axes, ways, offset):
    """x times this device's slice of (offset + w); the identity split on the global model."""
    return (x.astype(jnp.float32) * (offset + w.astype(jnp.float32)),)


def _scaled_sum(a, x, *b, axes, n, eps):
    """a · rsqrt(rowsum(x²) / n + eps) (+ b): on the global model (one device) nothing to sum."""
    x = x.astype(jnp.float32)
    out = a * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / n + eps)
    return (out + b[0] if b else out,)


def _reduce_scatter_spmd(rows, arrays, attrs):
    return _shard_slice_spmd(rows, (jax.lax.psum(arrays[0], tuple(attrs["axes"])),), attrs)


def _norm_weight_mine_spmd(rows, arrays, attrs):
    x, w = arrays
    n = x.shape[-1]
    mine = jax.lax.dynamic_slice_in_dim(jnp.asarray(w, jnp.float32), device_index(attrs["axes"]) * n, n)
    return (x.astype(jnp.float32) * (attrs["offset"] + mine),)


def _all_reduce_scaled_spmd(rows, arrays, attrs):
    """Σa · rsqrt(Σ rowsum(x²) / n + eps) + Σb (mkdsl/spmd/defer_norm.py)."""
    axes = tuple(attrs["axes"])
    a, x, *b = (jnp.asarray(v, jnp.float32) for v in arrays)
    squares = jax.lax.psum(jnp.sum(x * x, axis=-1, keepdims=True), axes)
    out = jax.lax.psum(a, axes) * jax.lax.rsqrt(squares / attrs["n"] + attrs["eps"])
    return (out + jax.lax.psum(b[0], axes) if b else out,)


register(
    OpDef(
        SCATTER_SUMS,
        ("x",),
        _mine,
        lambda x, axes, ways: (x,),
        lambda ins, outs, a: Cost(),
        attrs={"axes": REQUIRED, "ways": REQUIRED},
        doc="This device's column slice of the sum of the devices' partial values over mesh `axes`.",
        internal=True,
        exchange="scatter",
        spmd_prefill=_reduce_scatter_spmd,
    )
)

register(
    OpDef(
        WEIGH_MINE,
        ("x", "weight"),
        lambda args, attrs: (TensorType(F32, args[0].type.shape),),
        _weigh_mine,
        lambda ins, outs, a: Cost(weight_bytes=nbytes(ins[1]), flops=numel(outs[0])),
        attrs={"axes": REQUIRED, "ways": REQUIRED, "offset": 0.0},
        doc="x times this device's column slice (over mesh `axes`) of an RMS norm's (offset + weight).",
        internal=True,
        spmd_prefill=_norm_weight_mine_spmd,
    )
)

register(
    OpDef(
        SCALED_SUM,
        ("a", "x", "b"),
        _same,
        _scaled_sum,
        lambda ins, outs, a: Cost(),
        attrs={"axes": REQUIRED, "n": REQUIRED, "eps": REQUIRED},
        doc="Σa · rsqrt(Σ rowsum(x²) / n + eps) + Σb over mesh `axes`: the all-reduce of a projection "
        "of an RMS-normalised split value x, the norm's row scale applied after the sum.",
        internal=True,
        exchange="scaled",
        spmd_prefill=_all_reduce_scaled_spmd,
        optional=1,
    )
)
