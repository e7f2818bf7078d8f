"""The collectives the shard pass inserts, run by the `Comm` runtime (parts `comm`, `sharded`)."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering
from mkdsl.backends.tpu.lowerings.norm import norm_weight
from mkdsl.lang.ir import Ref
from mkdsl.ops.collective import GATHER_SPLITS, SCALED_SUM, SCATTER_SUMS, SUM_PARTIALS, TAKE_MINE, WEIGH_MINE

# The runtime's Comm method of each all-reduce algorithm (mkdsl/plan/collectives.py picks one).
METHOD = {"rs_ag": "all_reduce", "oneshot": "all_reduce_oneshot", "hier": "all_reduce_hier"}


def _collective(em: EmitContext, at: Site):
    """The plan's collective whose exchanges produce the node's value."""
    value, graph = at.node.outputs[0].name, at.graph.name
    c = next((c for c in em.plan.collectives if c.graph == graph and value in c.values), None)
    assert c is not None, (graph, value)
    return c


def _one_row(em: EmitContext, c):
    """The collective a kernel built for batch 1 runs in c's place (Plan.one_row; c if none)."""
    return next((o for o in em.plan.one_row if o.graph == c.graph and o.value == c.value), c)


def _wire(c) -> str:
    return "BF16" if c.wire == "bf16" else "F32"


def _together(em: EmitContext, at: Site, c) -> dict:
    """The record of a node in a group of collectives ready together: the first member emits the
    `Comm.together` call for the group (and, where a kernel built for batch 1 runs other
    algorithms, Plan.one_row's beside it), the others nothing (their values are its outputs)."""
    if c.value != at.node.outputs[0].name:
        return dict(together=(), joined_to=c.value)
    one = _one_row(em, c)
    wide, small = _members(em, at, c), _members(em, at, one)
    return dict(together=wide, one_row=small if small != wide else (), joined_to="")


def _members(em: EmitContext, at: Site, c) -> tuple[dict, ...]:
    """The `Comm.together` member records of the group c carries."""
    members = []
    for m in c.apart():
        node = next(n for n in at.graph.nodes if n.outputs and n.outputs[0].name == m.value)
        members.append(
            dict(
                kind="gather" if m.exchange == "gather" else m.algorithm,
                x=em.operand(at.graph, node.inputs[0]),
                out=em.operand(at.graph, Ref("value", m.value)),
                mask=em.mask(node.attr["axes"]),
                wire=_wire(m),
                inner=f'"{METHOD[m.inner]}"' if m.inner else "",
            )
        )
    return tuple(members)


def _reduce_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    """The all-reduce of the node's value, or only its copy when the next node's all-reduce
    carries it in the same exchanges (`Collective.fused`)."""
    node = at.node
    value = node.outputs[0].name
    c = _collective(em, at)
    if c.joined:
        return _together(em, at, c)
    fused = [em.operand(at.graph, Ref("value", v)) for v in c.fused]
    one = _one_row(em, c)
    return dict(
        together=(),
        joined_to="",
        x=ins[0],
        mask=em.mask(node.attr["axes"]),
        wire=_wire(c),
        method=METHOD[c.algorithm] if c.value == value else "",
        inner=f'"{METHOD[c.inner]}"' if c.inner else "",
        fused="(" + ", ".join(f"r.{b}" for b in fused) + ",)" if fused else "",
        # a kernel built for batch 1 runs the algorithm picked for 1-row messages (Plan.one_row)
        one_row=dict(method=METHOD[one.algorithm], inner=f'"{METHOD[one.inner]}"' if one.inner else "")
        if (one.algorithm, one.inner) != (c.algorithm, c.inner)
        else None,
    )


def _gather_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    c = _collective(em, at)
    if c.joined:
        return _together(em, at, c)
    return dict(together=(), joined_to="", x=ins[0], mask=em.mask(at.node.attr["axes"]))


def _mine_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], index=em.group_index(at.node.attr["axes"]), ways=at.node.attr["ways"])


def _scatter_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], mask=em.mask(at.node.attr["axes"]), wire=_wire(_collective(em, at)))


def _weigh_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    """A deferred norm's weight multiply: the fetched weight row, this device's slice selected."""
    node = at.node
    w = norm_weight(em, node, pre)
    return dict(x=ins[0], w=w, index=em.group_index(node.attr["axes"]), ways=node.attr["ways"])


def _scaled_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    codes = em.attr_codes(at.node)
    return dict(
        a=ins[0],
        x=ins[1],
        b=ins[2] if len(ins) > 2 else "",
        mask=em.mask(at.node.attr["axes"]),
        n=codes["n"],
        eps=codes["eps"],
        wire=_wire(_collective(em, at)),
    )


T = "lowerings/collective.jinja"
register_lowering(Lowering(SUM_PARTIALS, T, "all_reduce", _reduce_record))
register_lowering(Lowering(GATHER_SPLITS, T, "all_gather", _gather_record))
register_lowering(Lowering(TAKE_MINE, T, "shard_slice", _mine_record))
register_lowering(Lowering(SCATTER_SUMS, T, "reduce_scatter", _scatter_record))
register_lowering(Lowering(WEIGH_MINE, T, "norm_weight_mine", _weigh_record))
register_lowering(Lowering(SCALED_SUM, T, "all_reduce_scaled", _scaled_record))
