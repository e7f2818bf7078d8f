"""`linear` (a matrix streamed through the weight ring) and `embedding` (row blocks by token id)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.dtypes import GGUF, DType, itemsize
from mkdsl.lang.ir import Model, Tensor
from mkdsl.spmd.shard import split_note

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
    memory: str  # VMEM (SMEM would suit scalars, but Mosaic cannot DMA an HBM window into it)
    rdiv: int  # K rows per stored row (8 nibbles per uint32 word; `group` inputs per scale row); 0: one
    # value per matrix (nvfp4's global scale), fetched with every tile
    cdiv: int = 1  # N columns per stored column (block scales)
    label: str = ""  # its own ring array `ring_<label>` (a part whose dtype another part of its tile has)
    whole: bool = False  # the rows of the whole K with every tile (int4 scales no K tile can window legally)

    @property
    def ring(self) -> str:
        """The ring array holding this part: `ring` (bf16), `ring_<dtype>`, `ring_smem_<dtype>`,
        or `ring_<label>`."""
        if self.label:
            return f"ring_{self.label}"
        if self.memory == "SMEM":
            return f"ring_smem_{self.dtype}"
        if self.rdiv == 0:
            return f"ring_{self.suffix}"  # [1, 1] windows go to an array of their own width
        return "ring" if self.dtype == "bfloat16" else f"ring_{self.dtype}"

    @property
    def runtime_rdiv(self) -> int:
        """`rdiv` as the kernel's `QStream.parts` hold it: negative for a part fetched whole along K."""
        return -self.rdiv if self.whole else self.rdiv

    def ring_for(self, n: int, tk: int = 0, k: int = 0) -> str:
        """Block scales (whole rows of squares) get a ring array as wide as their matrix's row of
        squares: Mosaic DMAs an HBM window of a narrow array only into an array of its width. A
        labelled part whose tile has a row count off its 8-row tile (a whole K of 576 is 18 rows
        of GGUF block words) gets a ring array of exactly those rows: Mosaic slices a bank only
        along whole tiles. So does any other part whose rows are not whole tiles of its dtype (28
        bf16 scale rows of one K tile of 3584), and a part fetched whole along K."""
        if self.whole:
            return f"ring_{self.suffix}_{self.dtype}_{k // self.rdiv}"
        rows = tk // self.rdiv if self.rdiv > 1 else 0  # a packed or scale part (plain ones are whole tiles)
        if not self.label and self.cdiv == 1 and rows % (32 // self.itemsize):  # 28 bf16 scale rows at K 3584
            return f"ring_{self.suffix}_{self.dtype}_{rows}"
        if self.label and (tk // self.rdiv) % 8:
            return f"{self.ring}{tk // self.rdiv}"
        return f"ring_scales{n // self.cdiv}" if self.cdiv > 1 else self.ring

    def tile(self, tk: int, tn: int, n: int, transposed: bool = False, k: int = 0) -> tuple[int, int]:
        """Its [rows, cols] in one ring bank (a transposed plain matrix's tile is [tn, tk]). Block
        scales come as whole rows of squares (all `n` columns): a window at a dynamic lane offset
        of a narrow f32 array is not word-aligned in HBM. A `whole` part has the rows of all `k`."""
        if transposed:
            return tn, tk
        if self.rdiv == 0:
            return 1, 1
        if self.whole:
            return k // self.rdiv, tn
        return max(1, tk // self.rdiv), (n if self.cdiv > 1 else tn) // self.cdiv

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


@dataclass(frozen=True)
class StreamFormat:
    """How a matrix of one dtype streams: its tile decoder (`TILE_DOTS` in
    runtime/qlinear.py.jinja, "bf16": the plain `linear`), the K tiles it accepts and its parts."""

    fmt: str
    group: int
    parts: tuple[TilePart, ...]
    k_ok: Callable[[int, int], bool]  # (tk, K) -> a valid K tile (aligned windows of every part)
    tiles: str = ""  # which K tiles suit it, where that is not plain (the checker's hint)


def _aligned(tk: int, k: int, rows: int, tile_rows: int) -> bool:
    """A part window of `rows` rows is whole, or starts and ends on the HBM tile."""
    return tk == k or rows % tile_rows == 0


WHOLE = "_whole"  # the suffix of a format whose scales come whole along K with every tile


def _int4_whole(d: DType) -> StreamFormat:
    """int4 whose scale rows no K tile windows legally (a group of 128 at K = 3584: a bf16 window
    must be 16 rows or all of them, so tk would be a multiple of 2048 dividing 3584). Each tile
    brings the scale rows of its column block for the whole K (a legal superset, K/group rows),
    and the kernel picks its tile's rows in VMEM; tk needs only whole 8-row nibble words and need
    not be a multiple of the group."""
    f32 = d.scale == "float32"
    parts = (TilePart("codes", "uint32", "VMEM", 8), TilePart("scales", d.scale, "VMEM", d.group, whole=True))
    return StreamFormat(
        ("int4_f32" if f32 else "int4") + WHOLE, d.group, parts, lambda tk, k: _aligned(tk, k, tk // 8, 8)
    )


def stream_format(d: DType, whole: bool = False) -> StreamFormat | None:
    """The streaming of a `linear` matrix of dtype `d`, or None (f32, i32 matrices do not stream).
    `whole`: the int4 streaming with scales whole along K (`_int4_whole`), None for other dtypes."""
    g, b = d.group, d.block
    if whole:
        return _int4_whole(d) if d.name == "int4" else None
    if d.name == "bf16":
        return StreamFormat("bf16", 0, (TilePart("", "bfloat16", "VMEM", 1),), lambda tk, k: tk % 16 == 0)
    if d.name.startswith("fp8") and not d.quantised:
        return StreamFormat("cast", 0, (TilePart("", d.numpy, "VMEM", 1),), lambda tk, k: _aligned(tk, k, tk, 32))
    if b:
        parts = (TilePart("codes", d.numpy, "VMEM", 1), TilePart("scales", "float32", "VMEM", b, b))
        return StreamFormat("block", b, parts, lambda tk, k: tk % b == 0 and _aligned(tk, k, tk, 32))
    if d.name == "int4" and d.scale == "float32":
        parts = (TilePart("codes", "uint32", "VMEM", 8), TilePart("scales", "float32", "VMEM", g))
        ok = lambda tk, k: tk % g == 0 and _aligned(tk, k, tk // 8, 8) and _aligned(tk, k, tk // g, 8)  # noqa: E731
        return StreamFormat("int4_f32", g, parts, ok)
    if d.gguf:
        return _gguf_stream(d)
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
    if d.name == "nvfp4":
        return _nvfp4_format()
    if d.group:  # int8, fp8 with group scales
        parts = (TilePart("codes", d.numpy, "VMEM", 1), TilePart("scales", "float32", "VMEM", g))
        return StreamFormat("group", g, parts, lambda tk, k: (g % tk == 0 or tk % g == 0) and _aligned(tk, k, tk, 32))
    return None


def _nvfp4_format() -> StreamFormat:
    """nvfp4: e2m1 words (8 rows of a uint32 tile), e4m3 scales per 16 rows (32 rows of an fp8
    tile: K tiles of 512 unless the whole K) and the matrix's global scale with every tile."""
    parts = (
        TilePart("codes", "uint32", "VMEM", 8),
        TilePart("scales", "float8_e4m3fn", "VMEM", 16),
        TilePart("global", "float32", "VMEM", 0),
    )
    ok = lambda tk, k: tk % 16 == 0 and _aligned(tk, k, tk // 8, 8) and _aligned(tk, k, tk // 16, 32)  # noqa: E731
    return StreamFormat("nvfp4", 16, parts, ok)


def _gguf_stream(d: DType) -> StreamFormat:
    """GGUF blocks (dtypes.GGUF): codes (uint32 nibble words, or int8) and uint32 words of the
    blocks' f16 fields, `32 * words_per` inputs per word row; a K tile keeps every window whole
    or aligned to its HBM tile (8 rows of uint32, 32 of int8)."""
    f = GGUF[d.name]
    if f.super_block:
        return _kquant_stream(d)
    rows = 32 * f.words_per
    codes = TilePart("codes", "uint32", "VMEM", 8) if f.nibbles else TilePart("codes", "int8", "VMEM", 1)
    tile = 8 if f.nibbles else 32
    return StreamFormat(
        d.name,
        rows,
        (codes, TilePart("scales", "uint32", "VMEM", rows, label="gguf_words")),
        lambda tk, k: tk % rows == 0 and _aligned(tk, k, tk // codes.rdiv, tile) and _aligned(tk, k, tk // rows, 8),
    )


def _kquant_stream(d: DType) -> StreamFormat:
    """K-quants (dtypes.storage): nibble words, 4 words of scales per super-block of 256, the
    bits above the nibble (q5_k, q6_k) and q6_k's d words, each its own uint32 ring array. A K
    tile is whole super-blocks (q6_k: pairs) whose windows are whole or 8-row aligned (q6_k's d,
    one word row per 512 inputs: whole K, or tiles of 4096)."""
    f = GGUF[d.name]
    parts = [TilePart("codes", "uint32", "VMEM", 8), TilePart("scales", "uint32", "VMEM", 64, label="gguf_words")]
    if f.high:
        parts.append(TilePart("high", "uint32", "VMEM", f.high, label="gguf_high"))
    if d.name == "q6_k":
        parts.append(TilePart("d", "uint32", "VMEM", 512, label="gguf_d"))
    m = f.k_multiple
    return StreamFormat(
        d.name,
        256,
        tuple(parts),
        lambda tk, k: tk % m == 0 and all(_aligned(tk, k, tk // p.rdiv, 8) for p in parts),
        _kquant_tiles(d.name),
    )


def _kquant_tiles(name: str) -> str:
    """The checker's hint on a K-quant K no tile suits."""
    if name == "q6_k":
        return (
            f"q6_k streams all of K in one tile, at most {TILE_K} inputs: its d words (one per two "
            "super-blocks) start an 8-row HBM tile only every 4096 inputs"
        )
    return f"{name} tiles are 512 inputs or a multiple (their scale words start 8-row HBM tiles), dividing K, or all of K up to {TILE_K}"


def padded_columns(n: int) -> int:
    """Columns of a streamed matrix as the kernel stores it (per device): whole 128-lane tiles.
    The matmul computes the padding columns and stores only the first `n`."""
    return -(-n // 128) * 128


def stream_layout(
    t: Tensor, tile_k: int, tile_n: int, transposed: bool = False
) -> tuple[StreamFormat | None, int | None, int | None]:
    """(format, tk, tn) of a streamed matrix: its dtype's format where a K tile up to `tile_k`
    suits it. Else, for int4 (4-bit codes: half a bf16 tile's bytes per element), K tiles up to
    twice `tile_k` in tiles of at most `tile_k * tile_n` elements (fewer columns): first with
    per-tile scale windows (Qwen2.5-7B's K of 3584 in one tile), then with the scales whole along
    K (`_int4_whole`; its scale rows come with every K tile, so a longer tile moves fewer)."""
    sf = stream_format(t.type.dtype)
    tk, tn = stream_tiles(t, tile_k, tile_n, transposed, sf)
    if tk is not None or transposed or t.type.dtype.name != "int4":
        return sf, tk, tn
    for fmt in (sf, stream_format(t.type.dtype, whole=True)):
        tk, _ = stream_tiles(t, 2 * tile_k, tile_n, False, fmt)
        if tk is not None:
            narrow = max(128, min(tile_n, tile_k * tile_n // tk) // 128 * 128)
            return fmt, *stream_tiles(t, 2 * tile_k, narrow, False, fmt)
    return sf, None, None


def format_of(model: Model, st) -> StreamFormat:
    """The format a planned stream (plan.types.Stream) was cut with."""
    return stream_format(model.tensor(st.tensor).type.dtype, whole=st.fmt.endswith(WHOLE))


def stream_tiles(
    t: Tensor, tile_k: int, tile_n: int, transposed: bool = False, sf: StreamFormat | None = None
) -> tuple[int | None, int | None]:
    """[tk, tn] of a streamed matrix in format `sf` (its dtype's by default; None where no aligned
    tile divides it): tk the whole K if it fits, else the largest valid tile <= tile_k dividing K;
    tn likewise, lane-aligned. A transposed matrix ([N, K] in HBM) has its K along the lanes: tk a
    multiple of 128 or all K."""
    n, k = t.type.shape if transposed else reversed(t.type.shape)
    sf = sf or stream_format(t.type.dtype)
    if sf is None:
        return None, None

    def ok(tk: int) -> bool:
        return sf.k_ok(tk, k) and (not transposed or tk == k or tk % 128 == 0)

    ks = [tk for tk in range(16, min(k, tile_k) + 1, 16) if k % tk == 0 and ok(tk)]
    tk = k if k <= tile_k and ok(k) else max(ks, default=None)
    tn = divisor_tile(padded_columns(n), tile_n, 128)
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
    t = model.tensor(w.name)
    if stream_format(t.type.dtype) is None:
        return [
            Diagnostic(
                t.span,
                f"`{t.name}` is {t.type.dtype}: matrices of `linear` stream as bf16, fp8, int8, int4, mxfp4 or nvfp4 "
                "(or GGUF blocks: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)",
                "declare it in one of those, or use it through an op that takes it",
            )
        ]
    transposed = bool(at.node.attr.get("transposed"))
    if at.node.attr.get("input") == "f32" and (_linear_runtime(model, at) or t.type.dtype.name != "bf16"):
        return [
            Diagnostic(
                at.node.span,
                f'`input="f32"` streams bf16 weights of whole 128-column tiles, untransposed; `{t.name}` is not one',
                "declare the weight bf16, or leave the input rounded to bf16",
            )
        ]
    _, tk, tn = stream_layout(t, TILE_K, tile_n_of(model), transposed)
    k, n = reversed(t.type.shape) if transposed else t.type.shape
    kd, nd = (1, 0) if transposed else (0, 1)
    if t.type.dtype.block and n % t.type.dtype.block and any(t.sharding[-1:]):
        note = split_note(model, t, nd)
        return [Diagnostic(t.span, f"weight `{t.name}` has {n} columns{note}; its scale blocks cannot split evenly")]
    if tk is None or tn is None:
        rows, cols = ("columns", "rows") if transposed else ("rows", "columns")
        what = f"{k} {rows}" + split_note(model, t, kd) if tk is None else f"{n} {cols}" + split_note(model, t, nd)
        need = f"a tile that divides it and suits {t.type.dtype}" if tk is None else "a multiple of 128"
        fmt = stream_format(t.type.dtype)
        hint = (_layout_hint(t.type.dtype, transposed) or (fmt.tiles if fmt else "")) if tk is None else ""
        return [Diagnostic(t.span, f"weight `{t.name}` has {what}; streaming it in tiles needs {need}", hint or None)]
    return []


def _layout_hint(d: DType, transposed: bool) -> str | None:
    """The K layouts that stream, for the formats whose rule is short to say."""
    if d.name == "int4" and not transposed:
        return (
            f"int4 K tiles are whole 8-row words of nibbles: a K of at most {2 * TILE_K}, or one with a "
            f"divisor <= {2 * TILE_K} that is a multiple of 64 (e.g. pad K to a multiple of 64)"
        )
    return None


def _allocate_linear(s: PlanContext, at: Site) -> None:
    """The bf16 copy of the matmul input, once per source buffer (none for an f32 input)."""
    if at.node.arg("weight").kind != "tensor" or at.node.attr.get("input") == "f32":
        return
    src = s.buffer(at.graph, at.node.arg("x"))
    k = s.model.tensor(at.node.arg("weight").name).type.shape[1 if at.node.attr.get("transposed") else 0]
    s.alloc(f"{src}_bf16", ("rows", k), "bfloat16", "matmul input (bf16)", at.node.span)


def _linear_traffic(s: PlanContext, at: Site) -> Traffic:
    """Its stream's whole tiles, one DMA per storage part of each (codes and scales)."""
    st = s.stream_of(at)
    if not st:
        return Traffic()
    parts = format_of(s.model, st).parts
    per_tile = sum(p.itemsize * np.prod(p.tile(st.tk, st.tn, st.n, st.transposed, st.k)) for p in parts)
    return Traffic(int(per_tile) * st.tiles, st.tiles * len(parts))


def _linear_record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node = at.node
    st = em.plan.sequence(em.seq).stream(node.outputs[0].name)
    key = (at.graph.name, node.arg("x").name)
    f32 = node.attr.get("input") == "f32"  # the f32 buffer itself, multiplied at full precision
    cast = key not in em.casts and not f32
    if not f32:
        em.casts.add(key)
    return dict(
        x=ins[0],
        xb=ins[0] if f32 else f"{ins[0]}_bf16",
        cast=cast,
        fn="qlinear" if st.parts else "linear",
        stream=em.stream_const(em.seq, st),
        slot=em.slot_expr(st.tensor, "li"),
        base="base",
    )


def _linear_runtime(model: Model, at: Site) -> tuple[str, ...]:
    """A quantised, fp8 or column-padded matrix needs `qlinear` (and the decoders)."""
    w = at.node.arg("weight")
    sf = stream_format(model.tensor(w.name).type.dtype) if w.kind == "tensor" else None
    t = model.tensor(w.name)
    n = t.type.shape[0 if at.node.attr.get("transposed") else 1]
    if sf is None or (sf.fmt == "bf16" and n % 128 == 0 and not at.node.attr.get("transposed")):
        return ()
    gguf = ("runtime/gguf.py.jinja",) if t.type.dtype.gguf else ()
    layout = stream_layout(t, TILE_K, tile_n_of(model), bool(at.node.attr.get("transposed")))[0]
    wide = ("runtime/scales.py.jinja",) if layout is not None and layout.fmt.endswith(WHOLE) else ()
    return ("runtime/decode.py.jinja", "runtime/qlinear.py.jinja", *gguf, *wide)


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
