"""`rope`: the step's cos/sin tables are built once per distinct head layout (`rope_tables`, in the
kernel's per-step setup) from inverse frequencies computed at compile time; each call rotates
head by head (`rope` in runtime/core.py.jinja)."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model
from mkdsl.ops.rope import layout


def _check(model: Model, at: Site) -> list[Diagnostic]:
    """The tables are built from the step's positions (SMEM): other positions would rotate wrongly."""
    pos, step_pos = at.node.arg("positions"), model.inputs[1].name
    if pos.kind == "input" and pos.name == step_pos:
        return []
    return [
        Diagnostic(
            at.node.span,
            f"the kernel rotates at the step's positions only, not at `{pos.name}`",
            f"pass `{step_pos}` (the step's second input) to `rope`",
        )
    ]


def _record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    lay = layout(em.value_width(at.graph, node.arg("x")) // node.attr["heads"], node.attr)
    tables = em.shared.setdefault("rope_tables", {})  # layout -> table name, one per module
    if lay not in tables:
        tables[lay] = f"rope{len(tables)}"
    em.setup_once(_setup)
    return dict(x=ins[0], table=tables[lay], heads=node.attr["heads"], shift=lay.shift)


def _setup(em: EmitContext) -> list[str]:
    """This step's cos and sin tables, once per head layout."""
    return [
        f"{name}_cos, {name}_sin, {name}_up = rope_tables(positions_ref, rows, batch, d={lay.d}, "
        f"offset={lay.offset}, rotary={lay.rotary}, shift={lay.shift}, freq={lay.freq!r}, "
        f"concentration={lay.concentration!r})"
        for lay, name in em.shared["rope_tables"].items()
    ]


register_lowering(Lowering("rope", "lowerings/attention.jinja", "rope", _record, check=_check))
