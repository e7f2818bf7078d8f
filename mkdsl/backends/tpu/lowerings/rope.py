"""`rope`: the step's cos/sin tables are built once per distinct head layout (`rope_tables`, in the
kernel's per-step setup) from inverse frequencies computed at compile time; each call rotates
head by head (`rope` in runtime/core.py.jinja). Positions are the step's, or a state the host writes
before the step (a drafter's context positions), copied once into SMEM."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model
from mkdsl.ops.rope import layout


def _source(model: Model, at: Site) -> str | None:
    """Where the positions come from: the step's (None) or a state `i32[B]` (its name)."""
    pos = at.node.arg("positions")
    if pos.kind == "tensor" and model.tensor(pos.name).kind == "state":
        return pos.name
    return None


def _check(model: Model, at: Site) -> list[Diagnostic]:
    """Tables are built per step from the step's positions or from a state the host wrote before
    the step (read once into SMEM: it does not change during the step), not from computed ones."""
    pos, step_pos = at.node.arg("positions"), model.inputs[1].name
    if (pos.kind == "input" and pos.name == step_pos) or _source(model, at) is not None:
        return []
    return [
        Diagnostic(
            at.node.span,
            f"the kernel rotates at the step's positions or a state's, not at `{pos.name}`",
            f"pass `{step_pos}` (the step's second input) to `rope`",
        )
    ]


def _allocate(s: PlanContext, at: Site) -> None:
    name = _source(s.model, at)
    if name is not None:
        s.alloc(f"pos_{name}", ("batch",), "int32", f"`{name}`: rope positions", at.node.span, "SMEM")
        s.alloc(f"pos_{name}_sem", (1,), "dma", f"`{name}` copy semaphore", at.node.span, "SEM")


def _record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    lay = layout(em.value_width(at.graph, node.arg("x")) // node.attr["heads"], node.attr)
    tables = em.shared.setdefault("rope_tables", {})  # (layout, positions' state) -> table name, one per module
    key = (lay, _source(em.m, at))
    if key not in tables:
        tables[key] = f"rope{len(tables)}"
    em.setup_once(_setup)
    return dict(x=ins[0], table=tables[key], heads=node.attr["heads"], shift=lay.shift)


def _setup(em: EmitContext) -> list[str]:
    """This step's cos and sin tables, once per head layout and source of positions."""
    lines = []
    for state in dict.fromkeys(src for _, src in em.shared["rope_tables"] if src is not None):
        copy = f"pltpu.make_async_copy(r.{state}, r.pos_{state}, r.pos_{state}_sem.at[0])"
        lines += [f"{copy}.start()", f"{copy}.wait()"]
    return lines + [
        f"{name}_cos, {name}_sin, {name}_up = rope_tables({'positions_ref' if src is None else f'r.pos_{src}'}, "
        f"rows, batch, d={lay.d}, offset={lay.offset}, rotary={lay.rotary}, shift={lay.shift}, freq={lay.freq!r}, "
        f"concentration={lay.concentration!r})"
        for (lay, src), name in em.shared["rope_tables"].items()
    ]


register_lowering(Lowering("rope", "lowerings/attention.jinja", "rope", _record, check=_check, allocate=_allocate))
