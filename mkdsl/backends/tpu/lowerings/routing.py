"""`topk`, `group_topk` and `take`: routing steps on [rows, E] scores in VMEM (runtime part
`routing`). Their ids feed `moe_experts`, which stages them to SMEM itself."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering

ROUTING = ("runtime/routing.py.jinja",)
T = "lowerings/routing.jinja"


def _topk_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], k=at.node.attr["k"])


def _group_topk_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    a = at.node.attr
    return dict(x=ins[0], k=a["k"], groups=a["groups"], keep=a["topk_groups"])


def _take_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], ids=ins[1])


register_lowering(Lowering("topk", T, "topk", _topk_record, runtime=ROUTING))
register_lowering(Lowering("group_topk", T, "group_topk", _group_topk_record, runtime=ROUTING))
register_lowering(Lowering("take", T, "take", _take_record, runtime=ROUTING))
