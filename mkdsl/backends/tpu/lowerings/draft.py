"""The block drafter's ops (mkdsl/ops/draft.py).

`markov_argmax` lowers (runtime part `draft`): a loop over the block's rows, each DMAing the
aligned block of `w1` rows that holds the previous draft's row (its id staged to SMEM), adding
the bias `w2 . w1[prev]` to the row's logits and taking the argmax, combined across the devices
that split the vocabulary before the next row. `block_attention` has no kernel code yet: its
`check` says so at the call, with what the kernel would need, so `mkdsl check` and `compile`
stop there; the reference runs it (a drafter runs on the host: docs/language.md, "Drafters")."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model

T = "lowerings/draft.jinja"
DRAFT = ("runtime/draft.py.jinja",)
W1_BLOCK = 16  # rows of `w1` per DMA: a whole bf16 HBM tile, so the window starts on a tile
NEEDS = {
    "block_attention": "the slot caches in VMEM per layer, the context rows written at their slots, and the "
    "block's own rows attended causally beside them",
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


def _markov_check(model: Model, at: Site) -> list[Diagnostic]:
    """The anchor is read from the step's token ids in SMEM; `w1` rows are DMA'd in bf16 tiles."""
    tokens, w1 = at.node.arg("tokens"), model.tensor(at.node.arg("w1").name)
    out = []
    if tokens.kind != "input" or tokens.name != model.inputs[0].name:
        out.append(
            Diagnostic(
                at.node.span,
                "the kernel reads the anchor from the step's token ids only",
                f"pass `{model.inputs[0].name}` (the step's first input) to `markov_argmax`",
            )
        )
    if w1.type.dtype.name != "bf16" or w1.stacked or w1.type.shape[0] < W1_BLOCK:
        out.append(
            Diagnostic(
                w1.span, f"`{w1.name}` must be one bf16 matrix of at least {W1_BLOCK} rows for the kernel's row DMA"
            )
        )
    return out


def _markov_scratch(s: PlanContext, at: Site) -> dict:
    rank = s.model.tensor(at.node.arg("w1").name).type.shape[1]
    return {
        "block": ((W1_BLOCK, rank), "bfloat16", "the block of w1 rows holding the previous draft's", "VMEM"),
        "stage": ((8, 128), "int32", "the draft id, staged for SMEM", "VMEM"),
        "ids": ((8, 128), "int32", "the draft id, the next row's DMA address", "SMEM"),
        "sem": ((2,), "dma", "w1 row and id staging semaphores", "SEM"),
    }


def _markov_traffic(s: PlanContext, at: Site) -> Traffic:
    """One block of `w1` rows per draft (`w2` is fetched: the planner counts it)."""
    rank = s.model.tensor(at.node.arg("w1").name).type.shape[1]
    return Traffic(s.batch * W1_BLOCK * rank * 2, 2 * s.batch)


def _markov_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node, sc = at.node, em.scratch_of(at)
    axes = node.attr.get("shard_axes", ())
    width = em.value_width(at.graph, node.arg("logits"))
    n = dict(x=ins[0], w1=node.arg("w1").name, w2=em.fetched(node.arg("w2").name, pre))
    n.update({key: sc.name(key) for key in ("block", "stage", "ids", "sem")})
    n["sharded"] = f", offset={em.group_index(axes)} * {width}, comm=comm, mask={em.mask(axes)}" if axes else ""
    return n


register_lowering(
    Lowering(
        "markov_argmax",
        T,
        "markov_argmax",
        _markov_record,
        check=_markov_check,
        scratch=_markov_scratch,
        scratch_base="mk",
        synchronous=True,
        traffic=_markov_traffic,
        runtime=DRAFT,
    )
)
