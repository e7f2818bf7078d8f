"""The collectives the shard pass inserts, run by the `Comm` runtime (parts `comm`, `sharded`)."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering
from mkdsl.ops.collective import GATHER_SPLITS, SUM_PARTIALS, TAKE_MINE
from mkdsl.plan.collectives import exchange_rows


def _reduce_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    two = any(c.two_level and (c.graph, c.value) == (at.graph.name, node.outputs[0].name) for c in em.plan.collectives)
    return dict(
        x=ins[0],
        mask=em.mask(node.attr["axes"]),
        wire="BF16" if em.plan.wire == "bf16" else "F32",
        rows=exchange_rows(em.m),
        method="all_reduce_two_level" if two else "all_reduce",
    )


def _gather_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], mask=em.mask(at.node.attr["axes"]))


def _mine_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], index=em.group_index(at.node.attr["axes"]), ways=at.node.attr["ways"])


T = "lowerings/collective.jinja"
register_lowering(Lowering(SUM_PARTIALS, T, "all_reduce", _reduce_record))
register_lowering(Lowering(GATHER_SPLITS, T, "all_gather", _gather_record))
register_lowering(Lowering(TAKE_MINE, T, "shard_slice", _mine_record))
