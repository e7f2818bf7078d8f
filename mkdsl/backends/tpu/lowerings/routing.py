"""`topk`, `group_topk` and `take`: routing steps on [rows, E] scores in VMEM (runtime part
`routing`). Their ids feed `moe_experts`, which stages them to SMEM itself."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model

ROUTING = ("runtime/routing.py.jinja",)
T = "lowerings/routing.jinja"


LANES = 128  # the chosen ids (and group scores) are built in one lane-dense [rows, 128] array


def _check_k(model: Model, at: Site) -> list[Diagnostic]:
    a = at.node.attr
    wide = [f"{name} = {a[name]}" for name in ("k", "groups") if a.get(name, 0) > LANES]
    if wide:
        return [Diagnostic(at.node.span, f"`{at.node.op}` cannot be lowered: {', '.join(wide)} is more than {LANES}")]
    return []


def _topk_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], k=at.node.attr["k"])


def _group_topk_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    a = at.node.attr
    return dict(x=ins[0], k=a["k"], groups=a["groups"], keep=a["topk_groups"])


def _take_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], ids=ins[1])


def _check_take(model: Model, at: Site) -> list[Diagnostic]:
    k = at.node.outputs[0].type.shape[1]
    return [Diagnostic(at.node.span, f"`take` cannot be lowered: {k} ids is more than {LANES}")] if k > LANES else []


register_lowering(Lowering("topk", T, "topk", _topk_record, check=_check_k, runtime=ROUTING))
register_lowering(Lowering("group_topk", T, "group_topk", _group_topk_record, check=_check_k, runtime=ROUTING))
register_lowering(Lowering("take", T, "take", _take_record, check=_check_take, runtime=ROUTING))
