"""Grouped-query `attention` (runtime part `attention`).

Each attention op keeps its own scratch (`att<i>_*`, numbered across the graphs): its cache
write-backs are still in flight when it returns. All attention ops share the SMEM KV tile tables
(`kv_tables`, allocated once after every op)."""

from __future__ import annotations

import math

from mkdsl.backends.tpu.lowering import EmitContext, Lowering, PlanContext, Site, Traffic, register_lowering
from mkdsl.lang.diagnostics import NOWHERE, Diagnostic
from mkdsl.lang.ir import Model

KV_SLOTS = 3  # KV tiles in flight
ATTENTION = ("runtime/attention.py.jinja",)


def kv_setup(em: EmitContext) -> list[str]:
    """The step's KV tile tables, and no write-back pending yet for any attention op."""
    count = sum(1 for sc in em.plan.scratch if sc.base == "att")
    return [
        "kv_tables(positions_ref, batch, KV_TILE, r.kv_row, r.kv_t0, r.kv_n)",
        f"for i in range({count}):",
        "    r.wb_pending[i] = 0",
    ]


def kv_tables(s: PlanContext, count: int) -> None:
    """The KV tile tables every attention op reads, and one write-back flag per op."""
    s.alloc("kv_row", ("batch * seq_tiles",), "int32", "KV tile table: row", NOWHERE, "SMEM")
    s.alloc("kv_t0", ("batch * seq_tiles",), "int32", "KV tile table: first token", NOWHERE, "SMEM")
    s.alloc("kv_n", (1,), "int32", "KV tile count", NOWHERE, "SMEM")
    s.alloc("wb_pending", (count,), "int32", "KV write-backs in flight", NOWHERE, "SMEM")


def _caches(model: Model, at: Site):
    return model.tensor(at.node.arg("k_cache").name), model.tensor(at.node.arg("v_cache").name)


def _check(model: Model, at: Site) -> list[Diagnostic]:
    kc, vc = _caches(model, at)
    dk, dv = kc.type.shape[3], vc.type.shape[3]
    out = []
    if dk != dv:
        out.append(
            Diagnostic(at.node.span, f"attention with key width {dk} != value width {dv} has no TPU lowering yet")
        )
    for c in (kc, vc):
        if c.type.dtype.name != "bf16":
            out.append(
                Diagnostic(c.span, f"KV cache `{c.name}` is {c.type.dtype}: the kernel streams bf16 caches only")
            )
        if not c.stacked:  # the kernel addresses a cache by its layer slot
            out.append(Diagnostic(c.span, f"KV cache `{c.name}` must be declared `per layer` for the kernel"))
    return out


def loaded_kv_heads(node, kvh: int) -> int:
    """KV heads a device reads: all its cache holds, or the one its query heads share when the KV
    heads are replicated (`kv_axes`, set by the shard pass)."""
    return 1 if node.attr.get("kv_axes") else kvh


def _scratch(s: PlanContext, at: Site) -> dict:
    kc, vc = _caches(s.model, at)
    _, kvh, _, dk = kc.type.shape
    dv = vc.type.shape[3]
    heads = at.node.attr["heads"]
    parts = {}
    for name, rows, d in (("q2d", heads, dk), ("k2d", kvh, dk), ("v2d", kvh, dv), ("o2d", heads, dv)):
        parts[name] = ((-(-d // 128), f"{rows} * rows", 128), "float32", f"attention {name[0]}, head-major", "VMEM")
    if at.node.attr.get("kv_axes"):
        parts["rd_sem"] = ((1,), "dma", "replicated KV: new-token block read semaphore", "SEM")
    for name, d in (("ktiles", dk), ("vtiles", dv)):
        parts[name] = (
            (KV_SLOTS, loaded_kv_heads(at.node, kvh), s.kv_tile, d),
            "bfloat16",
            f"KV tiles in flight ({KV_SLOTS} x {s.kv_tile} tokens)",
            "VMEM",
        )
    reach = mask_reach(at.node)
    if reach is not None:  # this op's own KV tile tables: the tiles its window or chunk reaches
        n = f"batch * {(reach - 1) // s.kv_tile + 2 + global_tiles(at.node, s.kv_tile)}"
        parts["kv_row"] = ((n,), "int32", "masked KV tile table: row", "SMEM")
        parts["kv_t0"] = ((n,), "int32", "masked KV tile table: first token", "SMEM")
        parts["kv_n"] = ((1,), "int32", "masked KV tile count", "SMEM")
    if at.node.opt_arg("sinks") is not None:
        parts["sink"] = ((heads, 1), "float32", "sink logits, one row per head", "VMEM")
    return parts | {
        "m": ((heads, 1), "float32", "online softmax max", "VMEM"),
        "l": ((heads, 1), "float32", "online softmax sum", "VMEM"),
        "acc": ((heads, dv), "float32", "online softmax accumulator", "VMEM"),
        "wb": ((2, "batch", kvh, 16, dk), "bfloat16", "new-token blocks written back", "VMEM"),
        "kv_sem": ((2, KV_SLOTS), "dma", "KV tile semaphores", "SEM"),
        "wb_sem": ((1,), "dma", "write-back semaphore", "SEM"),
    }


def mask_reach(node) -> int | None:
    """The most keys a query sees under the op's window and chunk (None: all before it)."""
    bounds = [b for b in (node.attr["window"], node.attr.get("chunk")) if b is not None]
    return min(bounds) if bounds else None


def global_tiles(node, kv_tile: int) -> int:
    """KV tiles holding the op's global tokens (0 without them)."""
    g = node.attr.get("global_tokens")
    return 0 if g is None else -(-g // kv_tile)


def kv_tile_count(context: int, kv_tile: int, window: int | None, chunk: int | None = None, global_tokens=None) -> int:
    """KV tiles a row at position `context` reads: from the tile of its first seen key (window,
    chunk) to its own (the kernel's `kv_tables`), and the global tokens' tiles before that;
    tiles wholly before it are neither fetched nor counted."""
    first = 0
    if window is not None:
        first = max(context - window + 1, first)
    if chunk is not None:
        first = max(context - context % chunk, first)
    head = 0 if global_tokens is None or first == 0 else min(-(-global_tokens // kv_tile), first // kv_tile)
    return context // kv_tile + 1 - first // kv_tile + head


def _traffic(s: PlanContext, at: Site) -> Traffic:
    """Whole KV tiles the window reaches, and the new token's aligned block written back."""
    kc, vc = _caches(s.model, at)
    _, kvh, _, dk = kc.type.shape
    dv = vc.type.shape[3]
    a = at.node.attr
    kv_tiles = kv_tile_count(s.context, s.kv_tile, a["window"], a.get("chunk"), a.get("global_tokens"))
    read = s.batch * kv_tiles * s.kv_tile * loaded_kv_heads(at.node, kvh) * (dk + dv) * 2
    written = s.batch * kvh * 16 * (dk + dv) * 2
    if at.node.attr.get("kv_axes"):  # the new token's block of every KV head is read, patched, written
        return Traffic(read + 2 * written, s.batch * (2 * kv_tiles + 4))
    return Traffic(read + written, s.batch * (2 * kv_tiles + 2))


def _replicated(em: EmitContext, node, kvh: int) -> str:
    """With replicated KV heads: this device reads KV head `group index * kvh // ways`."""
    axes = node.attr.get("kv_axes")
    if not axes:
        return ""
    ways = math.prod(dict(em.m.mesh)[a] for a in axes)
    return f", kv_load=1, kv_lo={em.group_index(axes)} * {kvh} // {ways}"


def _chunk(node) -> str:
    """The constructor's `chunk` and `global_tokens` arguments, only where the op has them (kernels
    without are unchanged); global tokens only matter past a window or chunk."""
    out = "" if node.attr.get("chunk") is None else f", chunk={node.attr['chunk']!r}"
    if node.attr.get("global_tokens") is not None and mask_reach(node) is not None:
        out += f", global_tokens={node.attr['global_tokens']!r}"
    return out


def _record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node, sc = at.node, em.scratch_of(at)
    i = sc.index
    kc, vc = _caches(em.m, at)
    _, kvh, _, dk = kc.type.shape
    dv = vc.type.shape[3]
    scale = node.attr["scale"] if node.attr["scale"] is not None else dk**-0.5
    names = {key: sc.name(key) for key in sc.parts}
    names.update(k_cache=kc.name, v_cache=vc.name, k_cache_out=f"{kc.name}_out", v_cache_out=f"{vc.name}_out")
    obj = f"attention{i}"
    em.setup_once(kv_setup)
    em.drained.append(
        dict(
            obj=obj,
            ctor=(
                f"Attention(r, positions_ref, {i}, rows=rows, batch=batch, span=span, heads={node.attr['heads']}, kv_heads={kvh}, "
                f"dk={dk}, dv={dv}, kv_tile=KV_TILE, kv_slots=KV_SLOTS, scale={float(scale)!r}, names={names!r}, "
                f"window={node.attr['window']!r}{_chunk(node)}{_replicated(em, node, kvh)})"
            ),
        )
    )
    sinks = node.opt_arg("sinks")
    sink_code = em.fetched(sinks.name, pre) if sinks is not None else None
    return dict(obj=obj, slot=em.slot_expr(kc.name, "li"), q=ins[0], k=ins[1], v=ins[2], sinks=sink_code)


register_lowering(
    Lowering(
        "attention",
        "lowerings/attention.jinja",
        "attention",
        _record,
        check=_check,
        scratch=_scratch,
        scratch_base="att",
        after_all=kv_tables,
        traffic=_traffic,
        runtime=ATTENTION,
    )
)
