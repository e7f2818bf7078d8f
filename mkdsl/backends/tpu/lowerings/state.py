"""`read_state` (mkdsl/ops/state.py): a state tensor copied from HBM into a VMEM value.

The state's rows are the step's rows ([batch, W], as the host wrote them before the step): one DMA
of the whole array into a staging buffer of its dtype, then its rows stored into the value's
buffer (padded to the row tile; the padding rows are never read into a batch row)."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model


def _state(model: Model, at: Site):
    return model.tensor(at.node.arg("x").name)


def _check(model: Model, at: Site) -> list[Diagnostic]:
    """One row of the state per row of the step: [rows, W], not per layer."""
    t, rows = _state(model, at), model.dims[0].name
    if t.stacked or len(t.type.shape) != 2 or t.type.shape[0] != rows:
        return [
            Diagnostic(
                at.node.span,
                f"the kernel reads a state as a value when it holds one row per step row: `{t.name}` is "
                f"{t.type}{' per layer' if t.stacked else ''}, not [{rows}, width]",
                "declare it `state NAME: f32[" + rows + ", WIDTH]` (not per layer)",
            )
        ]
    return []


def _scratch(s: PlanContext, at: Site) -> dict:
    t = _state(s.model, at)
    return {"stage": (("batch", t.type.shape[1]), t.type.dtype.numpy, f"`{t.name}` staged from HBM", "VMEM")}


def _traffic(s: PlanContext, at: Site) -> Traffic:
    """The state's batch rows, one DMA."""
    t = _state(s.model, at)
    return Traffic(s.batch * t.type.shape[1] * t.type.dtype.bits // 8, 1)


def _record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    return dict(x=ins[0], stage=em.scratch_of(at).name("stage"))


register_lowering(
    Lowering(
        "read_state",
        "lowerings/state.jinja",
        "read_state",
        _record,
        check=_check,
        scratch=_scratch,
        scratch_base="rs",
        synchronous=True,
        traffic=_traffic,
    )
)
