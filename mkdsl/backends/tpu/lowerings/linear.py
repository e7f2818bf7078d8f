"""`linear` (a matrix streamed through the weight ring) and `embedding` (row blocks by token id)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.diagnostics import Diagnostic
from mkdsl.dtypes import DType, _np
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


@dataclass(frozen=True)
class TilePart:
    """One storage part of a streamed tile: it goes to bank `g % RING_DEPTH` of its ring array."""

    suffix: str  # the storage part ("" for a plain matrix; "codes", "scales")
    dtype: str  # numpy name
    memory: str  # VMEM, or SMEM for scalars the decoder reads one at a time
    rdiv: int  # K rows per stored row (8 nibbles per uint32 word; `group` inputs per scale row)
    cdiv: int = 1  # N columns per stored column (block scales)

    @property
    def ring(self) -> str:
        """The ring array holding this part: `ring` (bf16), `ring_<dtype>`, `ring_smem_<dtype>`."""
        if self.memory == "SMEM":
            return f"ring_smem_{self.dtype}"
        return "ring" if self.dtype == "bfloat16" else f"ring_{self.dtype}"

    def tile(self, tk: int, tn: int) -> tuple[int, int]:
        return max(1, tk // self.rdiv), tn // self.cdiv

    @property
    def itemsize(self) -> int:
        return np.dtype(_np(self.dtype)).itemsize


@dataclass(frozen=True)
class StreamFormat:
    """How a matrix of one dtype streams: its tile decoder (`TILE_DOTS` in
    runtime/qlinear.py.jinja, "bf16": the plain `linear`), the K tiles it accepts and its parts."""

    fmt: str
    group: int
    parts: tuple[TilePart, ...]
    k_ok: Callable[[int, int], bool]  # (tk, K) -> a valid K tile (aligned windows of every part)


def _aligned(tk: int, k: int, rows: int, tile_rows: int) -> bool:
    """A part window of `rows` rows is whole, or starts and ends on the HBM tile."""
    return tk == k or rows % tile_rows == 0


def stream_format(d: DType) -> StreamFormat | None:
    """The streaming of a `linear` matrix of dtype `d`, or None (f32, i32 matrices do not stream)."""
    g, b = d.group, d.block
    if d.name == "bf16":
        return StreamFormat("bf16", 0, (TilePart("", "bfloat16", "VMEM", 1),), lambda tk, k: tk % 16 == 0)
    if d.name.startswith("fp8") and not d.quantised:
        return StreamFormat("cast", 0, (TilePart("", d.numpy, "VMEM", 1),), lambda tk, k: _aligned(tk, k, tk, 32))
    if b:
        parts = (TilePart("codes", d.numpy, "VMEM", 1), TilePart("scales", "float32", "SMEM", b, b))
        return StreamFormat("block", b, parts, lambda tk, k: tk % b == 0 and _aligned(tk, k, tk, 32))
    if d.name == "mxfp4" or d.name == "int4":
        scale = "uint8" if d.name == "mxfp4" else "bfloat16"
        parts = (TilePart("codes", "uint32", "VMEM", 8), TilePart("scales", scale, "VMEM", g))
        tile = 32 if d.name == "mxfp4" else 16
        return StreamFormat(
            d.name,
            g,
            parts,
            lambda tk, k: tk % g == 0 and _aligned(tk, k, tk // 8, 8) and _aligned(tk, k, tk // g, tile),
        )
    if d.group:  # int8, fp8 with group scales
        parts = (TilePart("codes", d.numpy, "VMEM", 1), TilePart("scales", "float32", "VMEM", g))
        return StreamFormat("group", g, parts, lambda tk, k: (g % tk == 0 or tk % g == 0) and _aligned(tk, k, tk, 32))
    return None


def stream_tiles(t: Tensor, tile_k: int, tile_n: int) -> tuple[int | None, int | None]:
    """[tk, tn] of a streamed matrix (None where no aligned tile divides it): tk the whole K if
    it fits, else the largest valid tile <= tile_k dividing K; tn likewise, lane-aligned."""
    k, n = t.type.shape
    sf = stream_format(t.type.dtype)
    if sf is None:
        return None, None
    ks = [tk for tk in range(16, min(k, tile_k) + 1, 16) if k % tk == 0 and sf.k_ok(tk, k)]
    tk = k if k <= tile_k and sf.k_ok(k, k) else max(ks, default=None)
    tn = divisor_tile(n, tile_n, 128)
    if tn is not None and sf.group and sf.fmt == "block" and tn % sf.group:
        tn = None
    return tk, tn


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
    if stream_format(t.type.dtype) is None:
        return [
            Diagnostic(
                t.span,
                f"`{t.name}` is {t.type.dtype}: matrices of `linear` stream as bf16, fp8, int8, int4 or mxfp4",
                "declare it in one of those, or use it through an op that takes it",
            )
        ]
    tk, tn = stream_tiles(t, TILE_K, tile_n_of(model))
    if tk is None or tn is None:
        k, n = t.type.shape
        what = f"{k} rows" if tk is None else f"{n} columns"
        what += split_note(model, t, 0 if tk is None else 1)
        need = f"a tile that divides it and suits {t.type.dtype}" if tk is None else "a multiple of 128"
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
    """Its stream's whole tiles, one DMA per storage part of each (codes and scales)."""
    st = s.stream_of(at)
    if not st:
        return Traffic()
    parts = stream_format(s.model.tensor(st.tensor).type.dtype).parts
    per_tile = sum(p.itemsize * np.prod(p.tile(st.tk, st.tn)) for p in parts)
    return Traffic(int(per_tile) * st.tiles, st.tiles * len(parts))


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
        fn="linear" if st.fmt == "bf16" else "qlinear",
        stream=em.stream_const(em.seq, st),
        slot=em.slot_expr(st.tensor, "li"),
        base="base",
    )


def _linear_runtime(model: Model, at: Site) -> tuple[str, ...]:
    """A quantised or fp8 matrix needs the decoders and `qlinear`."""
    w = at.node.arg("weight")
    sf = stream_format(model.tensor(w.name).type.dtype) if w.kind == "tensor" else None
    return () if sf is None or sf.fmt == "bf16" else ("runtime/decode.py.jinja", "runtime/qlinear.py.jinja")


register_lowering(
    Lowering(
        "linear",
        "lowerings/linear.jinja",
        "linear",
        _linear_record,
        check=_check_linear,
        allocate=_allocate_linear,
        traffic=_linear_traffic,
        runtime_of=_linear_runtime,
    )
)


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
        allocate=_allocate_embedding,
        traffic=_embedding_traffic,
    )
)
