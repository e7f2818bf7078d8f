"""`linear` (a matrix streamed through the weight ring) and `embedding` (row blocks by token id)."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.diagnostics import Diagnostic
from mkdsl.ir import Model, Tensor
from mkdsl.shard import split_note

TILE_K = 2048  # weight tile rows (a multiple of 16, the bf16 sublane tile)
TILE_N = 512  # weight tile columns (a multiple of 128 lanes)


def divisor_tile(total: int, cap: int, align: int) -> int | None:
    """The largest multiple of `align` that divides `total` and is at most `cap`."""
    if total <= cap and total % align == 0:
        return total
    best = None
    for t in range(align, min(total, cap) + 1, align):
        if total % t == 0:
            best = t
    return best


def stream_tiles(t: Tensor, tile_k: int, tile_n: int) -> tuple[int | None, int | None]:
    """[tk, tn] of a streamed matrix (None where no aligned tile divides it)."""
    k, n = t.type.shape
    return divisor_tile(k, tile_k, 16), divisor_tile(n, tile_n, 128)


def tile_n_of(model: Model) -> int:
    """The `tile_n` hint, or the default where it is absent or invalid (the planner reports that)."""
    h = model.hint("tile_n")
    return h.value if h is not None and h.value > 0 and h.value % 128 == 0 else TILE_N


def _check_linear(model: Model, at: Site) -> list[Diagnostic]:
    w = at.node.arg("weight")
    if w.kind != "tensor":
        return [Diagnostic(at.node.span, "the kernel streams declared weight matrices only: `linear` of two values")]
    cut = next((i for i, n in enumerate(model.step.nodes) if n.op == "layers"), -1)
    if at.graph is model.step and at.index < cut:
        return [Diagnostic(at.node.span, "the kernel streams matrices in the layers and after them, not before")]
    t = model.tensor(w.name)
    if t.type.dtype.name != "bf16":
        return [
            Diagnostic(
                t.span,
                f"`{t.name}` is {t.type.dtype}: only bf16 weights stream through the weight ring so far",
                "declare it bf16, or use it through an op that takes it",
            )
        ]
    tk, tn = stream_tiles(t, TILE_K, tile_n_of(model))
    if tk is None or tn is None:
        k, n = t.type.shape
        what = f"{k} rows" if tk is None else f"{n} columns"
        what += split_note(model, t, 0 if tk is None else 1)
        need = "a multiple of 16" if tk is None else "a multiple of 128"
        return [Diagnostic(t.span, f"weight `{t.name}` has {what}; streaming it in tiles needs {need}")]
    return []


def _allocate_linear(s: PlanContext, at: Site) -> None:
    """The bf16 copy of the matmul input, once per source buffer."""
    if at.node.arg("weight").kind != "tensor":
        return
    src = s.buffer(at.graph, at.node.arg("x"))
    k = s.model.tensor(at.node.arg("weight").name).type.shape[0]
    s.alloc(f"{src}_bf16", ("rows", k), "bfloat16", "matmul input (bf16)", at.node.span)


def _linear_traffic(s: PlanContext, at: Site) -> Traffic:
    """Its stream's whole tiles, one DMA each."""
    st = s.stream_of(at)
    return Traffic(st.k * st.n * 2, st.tiles) if st else Traffic()


def _linear_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    st = em.plan.sequence(em.seq).stream(node.outputs[0].name)
    key = (at.graph.name, node.arg("x").name)
    cast = key not in em.casts
    em.casts.add(key)
    return dict(
        x=ins[0],
        xb=f"{ins[0]}_bf16",
        cast=cast,
        stream=em.stream_const(em.seq, st),
        slot=em.slot_expr(st.tensor, "li"),
        base="base",
    )


register_lowering(
    Lowering(
        "linear",
        "lowerings/linear.jinja",
        "linear",
        _linear_record,
        check=_check_linear,
        allocate=_allocate_linear,
        traffic=_linear_traffic,
    )
)


def _check_embedding(model: Model, at: Site) -> list[Diagnostic]:
    """The kernel DMAs table rows addressed by the step's token ids (scalars in SMEM), from one table."""
    tokens, table = at.node.arg("tokens"), at.node.arg("table")
    if tokens.kind != "input" or tokens.name != model.inputs[0].name:
        what = "the positions" if tokens.kind == "input" else "a computed index"
        return [
            Diagnostic(
                at.node.span,
                f"the kernel looks up rows by the step's token ids only, not by {what}",
                f"pass `{model.inputs[0].name}` (the step's first input) to `embedding`",
            )
        ]
    t = model.tensor(table.name)
    if t.stacked:
        return [
            Diagnostic(
                at.node.span,
                f"the kernel reads one embedding table: `{t.name}` is stacked per layer",
                "declare the table without `per layer`",
            )
        ]
    return []


def _allocate_embedding(s: PlanContext, at: Site) -> None:
    width = s.model.tensor(at.node.arg("table").name).type.shape[1]
    s.alloc("emb_block", ("batch", 16, width), "bfloat16", "embedding row blocks", at.node.span)
    s.alloc("emb_sem", (1,), "dma", "embedding semaphore", at.node.span, "SEM")


def _embedding_traffic(s: PlanContext, at: Site) -> Traffic:
    """A tile-aligned block of 16 rows per token, one DMA each."""
    t = s.model.tensor(at.node.arg("table").name)
    return Traffic(s.batch * 16 * t.type.shape[1] * 2, s.batch)


def _embedding_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    axes = node.attr.get("shard_axes", ())
    rows = em.m.tensor(node.arg("table").name).type.shape[0]
    return dict(
        table=node.arg("table").name,
        block="emb_block",
        offset=f"{em.group_index(axes)} * {rows}" if axes else "0",
    )


register_lowering(
    Lowering(
        "embedding",
        "lowerings/linear.jinja",
        "embedding",
        _embedding_record,
        check=_check_embedding,
        allocate=_allocate_embedding,
        traffic=_embedding_traffic,
    )
)
