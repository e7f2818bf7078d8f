"""The block drafter's ops (mkdsl/ops/draft.py).

Both lower (runtime part `draft`). `markov_argmax`: a loop over the block's rows, each DMAing the
aligned block of `w1` rows that holds the previous draft's row (its id staged to SMEM), adding
the bias `w2 . w1[prev]` to the row's logits and taking the argmax, combined across the devices
that split the vocabulary before the next row. `block_attention` keeps one layer's slot caches
whole in VMEM (a drafter's window is small: 2048 slots of one KV head per device for Kimi K3's
DSpark): it DMAs them in, writes the context rows at their slots, attends, and DMAs them back."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.ir import Model

T = "lowerings/draft.jinja"
DRAFT = ("runtime/draft.py.jinja",)
W1_BLOCK = 16  # rows of `w1` per DMA: a whole bf16 HBM tile, so the window starts on a tile
SLOT_BLOCK = 16  # slots per write of a context row (KV_BLOCK in the runtime): a whole bf16 tile of rows


def _caches(model: Model, at: Site):
    return [model.tensor(at.node.arg(name).name) for name in ("k_cache", "v_cache", "slot_pos")]


def _block_check(model: Model, at: Site) -> list[Diagnostic]:
    """Caches: bf16, keys and values of one width, every one `per layer`; positions: the step's."""
    kc, vc, sp = _caches(model, at)
    out = []
    if kc.type.dtype.name != "bf16" or vc.type.dtype.name != "bf16" or kc.type.shape != vc.type.shape:
        out.append(
            Diagnostic(at.node.span, "the kernel keeps block_attention's slot caches as bf16 [kv_heads, W, d] alike")
        )
    elif kc.type.shape[1] % SLOT_BLOCK:
        out.append(
            Diagnostic(
                at.node.span,
                f"the kernel writes slots in aligned blocks of {SLOT_BLOCK}: the caches' {kc.type.shape[1]} slots "
                "must be a multiple of it",
            )
        )
    if not (kc.stacked and vc.stacked and sp.stacked) or not (kc.slots == vc.slots == sp.slots):
        out.append(
            Diagnostic(
                at.node.span,
                "the kernel addresses the slot caches and `slot_pos` by one layer slot: declare them `per layer` alike",
            )
        )
    pos = at.node.arg("positions")
    if pos.kind != "input" or pos.name != model.inputs[1].name:
        out.append(Diagnostic(at.node.span, "the kernel reads the block's anchor from the step's positions only"))
    cpos = at.node.arg("ctx_positions")
    if cpos.kind not in ("input", "tensor") or (cpos.kind == "input" and cpos.name != model.inputs[1].name):
        out.append(
            Diagnostic(at.node.span, "the kernel reads the context positions from a state or the step's positions")
        )
    elif cpos.kind == "tensor" and model.tensor(cpos.name).type.shape[0] != model.dims[0].name:
        rows = model.dims[0].name
        out.append(
            Diagnostic(
                at.node.span, f"the kernel takes one context row per block row: `{cpos.name}` must be i32[{rows}]"
            )
        )
    return out


def _block_scratch(s: PlanContext, at: Site) -> dict:
    kc, _, sp = _caches(s.model, at)
    kvh, size, d = kc.type.shape
    parts = {
        "kc": ((kvh, size, d), "bfloat16", "slot cache keys, one layer", "VMEM"),
        "vc": ((kvh, size, d), "bfloat16", "slot cache values, one layer", "VMEM"),
        "sp": ((sp.stack, size), "int32", "the positions every layer's slots hold", "VMEM"),
        "sem": ((4,), "dma", "slot cache semaphores", "SEM"),
    }
    cpos = at.node.arg("ctx_positions")
    if cpos.kind == "tensor":
        parts["cpos"] = (("batch",), "int32", "the context rows' positions (one per row)", "SMEM")
    return parts


def _block_traffic(s: PlanContext, at: Site) -> Traffic:
    """The layer's slot caches and every layer's slot positions read and written whole."""
    kc, _, sp = _caches(s.model, at)
    kvh, size, d = kc.type.shape
    return Traffic(2 * (2 * kvh * size * d * 2 + sp.stack * size * 4), 6)


def _block_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node, sc = at.node, em.scratch_of(at)
    kc, vc, sp = _caches(em.m, at)
    cpos = node.arg("ctx_positions")
    cpos_ref = "positions_ref"
    if cpos.kind == "tensor":  # a state: copied to SMEM, where scalars are read
        cpos_ref = f"r.{sc.name('cpos')}"
        copy = f"pltpu.make_async_copy(r.{cpos.name}, {cpos_ref}, r.{sc.name('sem')}.at[3])"
        pre += [f"{copy}.start()", f"{copy}.wait()"]
    scale = node.attr["scale"] if node.attr["scale"] is not None else kc.type.shape[2] ** -0.5
    caches = ", ".join(f"r.{t.name}" for t in (kc, vc, sp)) + ", " + ", ".join(f"r.{t.name}_out" for t in (kc, vc, sp))
    scratch = ", ".join(f"r.{sc.name(k)}" for k in ("kc", "vc", "sp", "sem"))
    return dict(
        args=f"r.{ins[0]}, r.{ins[1]}, r.{ins[2]}, r.{ins[3]}, r.{ins[4]}, ({caches}), ({scratch}), {cpos_ref}, "
        f"positions_ref, r.{em.output(at)}, {em.slot_expr(kc.name, 'li')}, batch, heads={node.attr['heads']}, "
        f"kv_heads={node.attr['kv_heads']}, d={kc.type.shape[2]}, scale={float(scale)!r}, window={node.attr['window']!r}"
    )


register_lowering(
    Lowering(
        "block_attention",
        T,
        "block_attention",
        _block_record,
        check=_block_check,
        scratch=_block_scratch,
        scratch_base="ba",
        synchronous=True,
        traffic=_block_traffic,
        runtime=DRAFT,
    )
)


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
