"""`mla_attention`: decode attention over a compressed latent cache, with the kv up-projection
`w_kvb` absorbed into queries and outputs and streamed by the op (runtime parts `attention`, `mla`).

Shares the attention ops' numbering (`att<i>_*`) and KV tile tables."""

from __future__ import annotations

from mkdsl.backends.tpu.lowering import (
    EmitContext,
    Lowering,
    PlanContext,
    Site,
    Traffic,
    register_lowering,
)
from mkdsl.backends.tpu.lowerings.attention import KV_SLOTS, kv_setup, kv_tables
from mkdsl.lang.diagnostics import Diagnostic
from mkdsl.lang.dtypes import storage_bytes
from mkdsl.lang.ir import Model

W_SLOTS = 3  # MLA weight tiles in flight
# Latent tiles in VMEM: the one whose values are taken, the next one (its scores), two in flight.
MLA_KV_SLOTS = KV_SLOTS + 1


def _check(model: Model, at: Site) -> list[Diagnostic]:
    cache = model.tensor(at.node.arg("cache").name)
    r = cache.type.shape[2] - at.node.attr["extra"]
    out = []
    if r % 128:
        out.append(Diagnostic(at.node.span, f"mla_attention needs a kv rank that is a multiple of 128, got {r}"))
    w = model.tensor(at.node.arg("w_kvb").name)
    out += _check_w_kvb(w, at.node.attr, r)
    if cache.type.dtype.name != "bf16":
        out.append(
            Diagnostic(
                cache.span, f"latent cache `{cache.name}` is {cache.type.dtype}: the kernel streams bf16 caches only"
            )
        )
    return out


def _block(w) -> int:
    """The scale square's side of a block-scaled fp8 w_kvb, 0 for bf16."""
    return w.type.dtype.block


def _check_w_kvb(w, attr: dict, r: int) -> list[Diagnostic]:
    """bf16, or fp8 with [b, b] scale squares that tile each head's key and value column blocks and
    the kv rank (DeepSeek-V3's kv_b_proj: 128 x 128 squares, 128 + 128 columns per head, rank 512)."""
    d = w.type.dtype
    hint = "declare it bf16 or fp8_e4m3(block=B) / fp8_e5m2(block=B); the reference accepts any dtype"
    if d.name == "bf16":
        return []
    if not (d.name.startswith("fp8") and d.block):
        return [
            Diagnostic(
                w.span, f"`{w.name}` is {d}: mla_attention's kernel reads a bf16 or block-scaled fp8 w_kvb", hint
            )
        ]
    b = d.block
    if attr["nope"] % b or attr["vdim"] % b or r % b or b % 128:
        return [
            Diagnostic(
                w.span,
                f"`{w.name}` is {d}: the kernel needs scale squares that tile the kv rank ({r}) and each head's "
                f"{attr['nope']} key and {attr['vdim']} value columns, in whole 128-lane blocks",
                hint,
            )
        ]
    return []


def _scratch(s: PlanContext, at: Site) -> dict:
    width = s.model.tensor(at.node.arg("cache").name).type.shape[2]
    a = at.node.attr
    heads, nope, extra, vdim = a["heads"], a["nope"], a["extra"], a["vdim"]
    r = width - extra
    chunks = -(-width // 128)  # stored in 128-lane chunks: strided row loads need 128-wide arrays
    hp = -(-heads // 8) * 8  # each row's heads start on a sublane tile
    w = s.model.tensor(at.node.arg("w_kvb").name)
    code, scales, b = "bfloat16", {}, _block(w)
    if b:  # fp8 codes, decoded in VMEM; the layer's scale squares as SMEM scalars
        code = w.type.dtype.numpy
        squares = (r // b, w.type.shape[1] // b)
        scales = {
            "wscale": (squares, "float32", "kv up-projection scale squares", "SMEM"),
            "ws_sem": ((1,), "dma", "kv up-projection scales semaphore", "SEM"),
        }
    return {
        "ql": ((chunks, f"{hp} * rows", 128), "float32", "absorbed queries, row-major (heads padded to 8)", "VMEM"),
        "ol": ((r // 128, f"{hp} * rows", 128), "float32", "latent outputs (softmax accumulator), row-major", "VMEM"),
        "wtiles": ((W_SLOTS, r, max(nope, vdim)), code, f"kv up-projection tiles ({W_SLOTS} in flight)", "VMEM"),
        "w_sem": ((W_SLOTS,), "dma", "kv up-projection semaphores", "SEM"),
        **scales,
        "tiles": (
            (MLA_KV_SLOTS, s.kv_tile, width),
            "bfloat16",
            f"latent cache tiles ({MLA_KV_SLOTS} x {s.kv_tile} tokens)",
            "VMEM",
        ),
        "m": ((f"{hp} * rows", 128), "float32", "online softmax max (lane-replicated), row-major", "VMEM"),
        "l": ((f"{hp} * rows", 128), "float32", "online softmax sum (per-lane parts), row-major", "VMEM"),
        "s": ((heads, s.kv_tile), "float32", "the next latent tile's scores", "VMEM"),
        "new": (("rows", width), "float32", "this token's latent cache entry", "VMEM"),
        "wb": (("batch", 16, width), "bfloat16", "new-token blocks, read and written back", "VMEM"),
        "kv_sem": ((MLA_KV_SLOTS,), "dma", "latent cache semaphores", "SEM"),
        "wb_sem": ((2,), "dma", "new-token block semaphores (write-back, read)", "SEM"),
    }


def _traffic(s: PlanContext, at: Site) -> Traffic:
    """`w_kvb` once (W_UK and W_UV), whole latent tiles and the new token's block (read, written)."""
    w = s.model.tensor(at.node.arg("w_kvb").name)
    width = s.model.tensor(at.node.arg("cache").name).type.shape[2]
    kv_tiles = -(-(s.context + 1) // s.kv_tile)
    moved = storage_bytes(w.type.dtype, w.type.shape) + s.batch * (kv_tiles * s.kv_tile + 2 * 16) * width * 2
    return Traffic(moved, 2 * at.node.attr["heads"] + s.batch * (kv_tiles + 2) + (1 if _block(w) else 0))


def _record(em: EmitContext, at: Site, ins: list[str], pre: list[str]) -> dict:
    node, sc = at.node, em.scratch_of(at)
    i = sc.index
    cache = em.m.tensor(node.arg("cache").name)
    a = node.attr
    scale = a["scale"] if a["scale"] is not None else (a["nope"] + a["extra"]) ** -0.5
    names = {key: sc.name(key) for key in sc.parts}
    w = em.m.tensor(node.arg("w_kvb").name)
    block = _block(w)
    kvb = {"w_kvb": f"{w.name}_codes", "w_scales": f"{w.name}_scales"} if block else {"w_kvb": w.name}
    names.update(cache=cache.name, cache_out=f"{cache.name}_out", **kvb)
    obj = f"attention{i}"
    em.setup_once(kv_setup)
    em.drained.append(
        dict(
            obj=obj,
            ctor=(
                f"LatentAttention(r, positions_ref, {i}, rows=rows, batch=batch, span=span, heads={a['heads']}, nope={a['nope']}, "
                f"extra={a['extra']}, vdim={a['vdim']}, kv_tile=KV_TILE, kv_slots={MLA_KV_SLOTS}, scale={float(scale)!r}, "
                f"names={names!r}{f', block={block}' if block else ''})"
            ),
        )
    )
    w = em.m.tensor(node.arg("w_kvb").name)
    w_slot = em.slot_expr(w.name, "li") if w.stacked else "None"  # w_kvb's own layer slice
    return dict(obj=obj, slot=em.slot_expr(cache.name, "li"), w_slot=w_slot, q=ins[0], c=ins[1], e=ins[2])


register_lowering(
    Lowering(
        "mla_attention",
        "lowerings/mla.jinja",
        "mla_attention",
        _record,
        check=_check,
        scratch=_scratch,
        scratch_base="att",
        after_all=kv_tables,
        traffic=_traffic,
        runtime=("runtime/attention.py.jinja", "runtime/decode.py.jinja", "runtime/mla.py.jinja"),
    )
)
