"""Elementwise ops whose `kernel_expr` calls a runtime helper (runtime part `elementwise`).

They lower exactly as every other `kernel_expr` op (`ELEMENTWISE`), but carry the helper in
the generated module only when a spec uses them. `to_f32` reads the step's positions from SMEM."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import ELEMENTWISE, EmitContext, Lowering, Site, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model

HELPERS = ("runtime/elementwise.py.jinja",)

for _op in ("repeat",):
    register_lowering(
        Lowering(_op, ELEMENTWISE.template, ELEMENTWISE.macro, ELEMENTWISE.record, runtime=HELPERS, layer_attrs=True)
    )


def _to_f32_check(model: Model, at: Site) -> list[Diagnostic]:
    """The kernel reads per-row integers from SMEM: the step's positions are there."""
    x, step_pos = at.node.arg("x"), model.inputs[1].name
    if x.kind == "input" and x.name == step_pos:
        return []
    return [
        Diagnostic(
            at.node.span,
            f"the kernel converts the step's positions, not `{x.name}`",
            f"pass `{step_pos}` (the step's second input) to `to_f32`",
        )
    ]


def _to_f32_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(expr="row_scalars(positions_ref, rows, batch)")


register_lowering(
    Lowering("to_f32", ELEMENTWISE.template, ELEMENTWISE.macro, _to_f32_record, check=_to_f32_check, runtime=HELPERS)
)
