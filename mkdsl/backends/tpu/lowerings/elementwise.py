"""Elementwise ops whose `kernel_expr` calls a runtime helper (runtime part `elementwise`).

They lower exactly as every other `kernel_expr` op (`ELEMENTWISE`), but carry the helper in
the generated module only when a spec uses them."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import ELEMENTWISE, Lowering, register_lowering

HELPERS = ("runtime/elementwise.py.jinja",)

for _op in ("repeat",):
    register_lowering(
        Lowering(_op, ELEMENTWISE.template, ELEMENTWISE.macro, ELEMENTWISE.record, runtime=HELPERS, layer_attrs=True)
    )
