"""The collectives the shard pass inserts, run by the `Comm` runtime (parts `comm`, `sharded`)."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering
from mkdsl.ops.collective import GATHER_SPLITS, SUM_PARTIALS, TAKE_MINE

# The runtime's Comm method of each all-reduce algorithm (mkdsl/plan/collectives.py picks one).
METHOD = {"rs_ag": "all_reduce", "oneshot": "all_reduce_oneshot", "hier": "all_reduce_hier"}


def _reduce_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    c = next(c for c in em.plan.collectives if (c.graph, c.value) == (at.graph.name, node.outputs[0].name))
    return dict(
        x=ins[0],
        mask=em.mask(node.attr["axes"]),
        wire="BF16" if c.wire == "bf16" else "F32",
        method=METHOD[c.algorithm],
        inner=f'"{METHOD[c.inner]}"' if c.inner else "",
    )


def _gather_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], mask=em.mask(at.node.attr["axes"]))


def _mine_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], index=em.group_index(at.node.attr["axes"]), ways=at.node.attr["ways"])


T = "lowerings/collective.jinja"
register_lowering(Lowering(SUM_PARTIALS, T, "all_reduce", _reduce_record))
register_lowering(Lowering(GATHER_SPLITS, T, "all_gather", _gather_record))
register_lowering(Lowering(TAKE_MINE, T, "shard_slice", _mine_record))
