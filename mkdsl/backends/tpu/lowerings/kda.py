"""Kimi Delta Attention's ops and the recurrent-state family: `short_conv`, `l2norm`, `kda_gate`, `recurrent`.

`short_conv` and `recurrent` stream their recurrent state in and out themselves; all four finish
their DMAs before they return, so every instance shares one scratch set (`synchronous`)."""

from __future__ import annotations

import math

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model

DELTA_SLOTS = 3  # recurrent-state slots in flight
DELTA_SLOT_BYTES = 512 * 1024  # one slot's states at most: 3 read and 3 write slots stay within 3 MiB of VMEM
DELTA_STATES = 8  # states per slot, updated together in one loop trip (one copy of their code per delta rule)
KDA = ("runtime/kda.py.jinja",)  # the runtime part holding ShortConv, l2norm, kda_gate and Recurrent


def _check_conv(model: Model, at: Site) -> list[Diagnostic]:
    st = model.tensor(at.node.arg("conv_state").name)
    if st.type.dtype.name != "f32":
        return [Diagnostic(st.span, f"conv state `{st.name}` is {st.type.dtype}: the kernel keeps conv states in f32")]
    return []


def _conv_scratch(s: PlanContext, at: Site) -> dict:
    _, taps, width = s.model.tensor(at.node.arg("conv_state").name).type.shape
    return {
        "buf": ((taps, "rows", width), "float32", "conv state window", "VMEM"),
        "sem": ((2, taps), "dma", "conv state semaphores", "SEM"),
    }


def _conv_traffic(s: PlanContext, at: Site) -> Traffic:
    """The state window read and written, two DMAs per row and tap."""
    taps = s.model.tensor(at.node.arg("conv_state").name).type.shape[1]
    return Traffic(s.cost(at).state_bytes, 2 * s.batch * taps)


def _conv_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node, sc = at.node, em.scratch_of(at)
    state = node.arg("conv_state").name
    obj = f"{sc.prefix}_{at.graph.name}_{at.index}"
    act = "" if node.attr.get("act", "silu") == "silu" else ", silu=False"
    em.objects.append(
        f"{obj} = ShortConv(r.{state}, r.{state}_out, r.{sc.name('buf')}, r.{sc.name('sem')}, batch, span{act})"
    )
    bias = node.opt_arg("bias")
    return dict(
        obj=obj,
        slot=em.slot_expr(state, em.layer_var),
        x=ins[0],
        w=em.fetched(node.arg("weight").name, pre),
        bias=em.fetched(bias.name, pre) if bias is not None else None,
    )


register_lowering(
    Lowering(
        "short_conv",
        "lowerings/kda.jinja",
        "short_conv",
        _conv_record,
        check=_check_conv,
        scratch=_conv_scratch,
        scratch_base="conv",
        synchronous=True,
        traffic=_conv_traffic,
        runtime=KDA,
    )
)


def _l2norm_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    attr = em.attr_codes(at.node)
    return dict(x=ins[0], heads=at.node.attr["heads"], scale=attr["scale"], eps=attr["eps"])


register_lowering(Lowering("l2norm", "lowerings/kda.jinja", "l2norm", _l2norm_record, runtime=KDA))


def _gate_scratch(s: PlanContext, at: Site) -> dict:
    return {"scale": ((1, at.node.outputs[0].type.shape[1]), "float32", "decay scale per channel", "VMEM")}


def _gate_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    return dict(
        f=ins[0],
        a_log=em.fetched(node.arg("a_log").name, pre),
        dt_bias=em.fetched(node.arg("dt_bias").name, pre),
        scale=em.scratch_of(at).name("scale"),
        heads=node.attr["heads"],
        lower=em.attr_codes(node)["lower"],
    )


register_lowering(
    Lowering(
        "kda_gate",
        "lowerings/kda.jinja",
        "kda_gate",
        _gate_record,
        scratch=_gate_scratch,
        scratch_base="gate",
        synchronous=True,
        runtime=KDA,
    )
)


def decay_form(at: Site) -> str:
    """How the kernel applies the decay: "" (none), "const" (a weight [heads]), "head" (g [B, heads])
    or "key" (one per key channel)."""
    from mkdsl.lang.elaborate import graph_value_type

    g = at.node.opt_arg("g")
    if g is None:
        return ""
    if g.kind == "tensor":
        return "const"
    return "head" if graph_value_type(at.graph, g).shape[1] == at.node.attr["heads"] else "key"


def key_lo(em: EmitContext, node, key_heads: int) -> str:
    """With replicated key heads (`key_axes`): the key head this device's value heads read."""
    axes = node.attr.get("key_axes")
    if not axes:
        return ""
    ways = math.prod(dict(em.m.mesh)[a] for a in axes)
    return f", key_lo={em.group_index(axes)} * {key_heads} // {ways}"


def slot_states(heads: int, dk: int, dv: int, rows: int) -> int:
    """States a VMEM slot holds: as many (row, value head) states as fit DELTA_SLOT_BYTES, at most
    DELTA_STATES (the loop body updates a slot's states together, one copy of their code each),
    and no more than `rows` (the largest batch) x heads."""
    return max(1, min(DELTA_SLOT_BYTES // (dk * dv * 4), DELTA_STATES, heads * rows))


def slot_layout(heads: int, batch: int, states: int) -> tuple[int, int]:
    """(rows, heads) of a slot at this batch, as the kernel's Recurrent lays it out: all the rows
    (up to `states`; more run as groups of rows) and the most heads that divide `heads` and fit."""
    rows = min(batch, states)
    return rows, max(c for c in range(1, heads + 1) if heads % c == 0 and c * rows <= states)


def _rule_dmas(heads: int, batch: int, states: int) -> int:
    """The DMAs of one step, each way: per slot one for a single row or a single head, else one per row."""
    rows, per = slot_layout(heads, batch, states)
    total = 0
    for r0 in range(0, batch, rows):
        n = min(rows, batch - r0)
        total += (heads // per) * (1 if n == 1 or per == 1 else n)
    return total


def _rule_scratch(s: PlanContext, at: Site) -> dict:
    _, heads, dk, dv = s.model.tensor(at.node.arg("state").name).type.shape
    slots = (DELTA_SLOTS, slot_states(heads, dk, dv, s.model.dims[0].high), dk, dv)
    return {
        "in": (slots, "float32", f"recurrent states read ({DELTA_SLOTS} slots)", "VMEM"),
        "out": (slots, "float32", f"recurrent states written ({DELTA_SLOTS} slots)", "VMEM"),
        "sem": ((2, DELTA_SLOTS), "dma", "recurrent state semaphores", "SEM"),
    }


def _rule_traffic(s: PlanContext, at: Site) -> Traffic:
    """Each row's states read and written, slot by slot (`_rule_dmas` each way)."""
    _, heads, dk, dv = s.model.tensor(at.node.arg("state").name).type.shape
    states = slot_states(heads, dk, dv, s.model.dims[0].high)
    return Traffic(s.cost(at).state_bytes, 2 * _rule_dmas(heads, s.batch, states))


def _rule_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node, sc = at.node, em.scratch_of(at)
    state = node.arg("state").name
    obj = f"{sc.prefix}_{at.graph.name}_{at.index}"
    heads = node.attr["heads"]
    key_heads = node.attr.get("key_heads") or heads
    group = heads if node.attr.get("key_axes") else heads // key_heads
    form = decay_form(at)
    extra = (f", group={group}" if group > 1 else "") + (f", decay={form!r}" if form != "key" else "")
    extra += ", delta=False" if node.attr["rule"] == "outer" else ""
    em.objects.append(
        f"{obj} = Recurrent(r.{state}, r.{state}_out, r.{sc.name('in')}, r.{sc.name('out')}, "
        f"r.{sc.name('sem')}, batch, {heads}{extra}{key_lo(em, node, key_heads)}, span=span)"
    )
    g = node.opt_arg("g")
    g_code = "None" if g is None else em.fetched(g.name, pre) if form == "const" else f"r.{ins[4]}"
    beta = f"r.{ins[5]}" if node.opt_arg("beta") is not None else "None"
    args = ", ".join([*(f"r.{b}" for b in ins[:3]), g_code, beta])
    return dict(obj=obj, slot=em.slot_expr(state, em.layer_var), args=args)


register_lowering(
    Lowering(
        "recurrent",
        "lowerings/kda.jinja",
        "recurrent",
        _rule_record,
        scratch=_rule_scratch,
        scratch_base="rule",
        synchronous=True,
        traffic=_rule_traffic,
        runtime=KDA,
    )
)
