"""The block drafter's ops (`block_attention`, `markov_argmax`, mkdsl/ops/draft.py): no kernel
code yet. Their `check` says so at the call, with what the kernel would need, so `mkdsl check`
and `compile` stop there; the reference runs them (a drafter runs on the host: docs/language.md,
"Drafters"). The macros are never rendered while the checks fail."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, Site, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model

T = "lowerings/draft.jinja"
NEEDS = {
    "block_attention": "the slot caches in VMEM per layer, the context rows written at their slots, and the "
    "block's own rows attended causally beside them",
    "markov_argmax": "a row-by-row argmax whose bias gathers the previous draft's row of `w1`, combined across "
    "the devices that split the vocabulary before the next row",
}


def _not_yet(model: Model, at: Site) -> list[Diagnostic]:
    op = at.node.op
    return [
        Diagnostic(
            at.node.span,
            f"op `{op}` has no TPU lowering yet: it needs {NEEDS[op]}",
            "the reference runs it: a drafter runs on the host (mkdsl/run/spec_drafters.py)",
        )
    ]


def _record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    raise AssertionError(f"`{at.node.op}` is emitted only after its check passes")  # pragma: no cover


for _op in NEEDS:
    register_lowering(Lowering(_op, T, "not_lowered", _record, check=_not_yet))
