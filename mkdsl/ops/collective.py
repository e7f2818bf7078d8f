"""Collectives: inserted by the shard pass (mkdsl/shard.py), never written in a spec.

In the per-device model a value is either whole on every device or split over mesh axes; these
ops move between the two. Their reference is the identity on the global model, where every
value is whole, so the unfused reference never runs them.
"""

from __future__ import annotations

from mkdsl.ir import TensorType
from mkdsl.ops.registry import REQUIRED, Cost, OpDef, register

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
    )
)
