"""Multi-head latent attention (MLA): column slicing and decode attention over a latent cache.

The cache holds each token's latent `[c_kv | k_extra]` (R + extra values, 512 + 64 = 576 in
Kimi K3), not per-head keys and values: weight absorption moves the key up-projection onto the
query (q_lat = q_nope·W_UKᵀ) and the value up-projection after the softmax (y = o_lat·W_UV).
This is our design choice: 576 bf16 values are 1152 bytes per token per layer, where an
expanded cache of 96 heads × (192 key + 128 value) would be 61440 bytes. Decode reads the
whole cache every step, so the cache bytes set the step's HBM floor at long contexts; the
price is R-wide dot products per head instead of 192/128-wide ones.
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jnp
from mkdsl.ops.attention import mxu_operand, softmax_parts
from mkdsl.ops.linear import weight_f32
from mkdsl.ops.registry import (
    REQUIRED,
    Cost,
    OpDef,
    OpError,
    expect_dtype,
    expect_float,
    expect_rank,
    nbytes,
    register,
)


def _slice_infer(args, attrs):
    (x,) = args
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    start, size = attrs["start"], attrs["size"]
    if not isinstance(start, int) or start < 0:
        raise OpError(f"start must be a non-negative integer, got {start}", "start")
    if not isinstance(size, int) or size < 1:
        raise OpError(f"size must be a positive integer, got {size}", "size")
    n = x.type.shape[1]
    if isinstance(n, int) and start + size > n:
        raise OpError(f"columns {start}..{start + size - 1} are out of range: `{x.name}` has {n} columns", "size")
    return (TensorType(F32, (x.type.shape[0], size)),)


register(
    OpDef(
        "slice",
        ("x",),
        _slice_infer,
        lambda x, start, size: (x[:, start : start + size].astype(jnp.float32),),
        lambda ins, outs, a: Cost(),
        attrs={"start": REQUIRED, "size": REQUIRED},
        doc="Columns start..start+size-1 of each row, as f32.",
        kernel_expr="{x}[:, {start} : {start} + {size}]",
        shard="whole",
    )
)


def _concat_infer(args, attrs):
    a, b = args
    for i, x in enumerate(args):
        expect_rank(x, 2, i, "the inputs")
        expect_float(x, i)
    if a.type.shape[0] != b.type.shape[0]:
        raise OpError(f"`{a.name}` {a.type} and `{b.name}` {b.type} have different row counts", 1)
    na, nb = a.type.shape[1], b.type.shape[1]
    return (TensorType(F32, (a.type.shape[0], na + nb if isinstance(na, int) and isinstance(nb, int) else na)),)


register(
    OpDef(
        "concat",
        ("a", "b"),
        _concat_infer,
        lambda a, b: (jnp.concatenate([a.astype(jnp.float32), b.astype(jnp.float32)], axis=1),),
        lambda ins, outs, a: Cost(),
        doc="The columns of a, then those of b, in each row, as f32 (MTP heads join two normed inputs).",
        kernel_expr="jnp.concatenate([{a}, {b}], axis=1)",
        shard="whole",
    )
)


def _compact_infer(args, attrs):
    (x,) = args
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    block, keep = attrs["block"], attrs["keep"]
    if not isinstance(block, int) or block < 1:
        raise OpError(f"block must be a positive integer, got {block}", "block")
    if not isinstance(keep, int) or not 1 <= keep <= block:
        raise OpError(f"keep must be an integer in 1..{block} (the block), got {keep}", "keep")
    n = x.type.shape[1]
    if isinstance(n, int) and n % block:
        raise OpError(f"`{x.name}` has {n} columns, not a whole number of {block}-column blocks", 0)
    return (TensorType(F32, (x.type.shape[0], n // block * keep if isinstance(n, int) else n)),)


def compact(x, block, keep):
    rows, n = x.shape
    return (x.reshape(rows, n // block, block)[:, :, :keep].reshape(rows, n // block * keep).astype(jnp.float32),)


register(
    OpDef(
        "compact",
        ("x",),
        _compact_infer,
        compact,
        lambda ins, outs, a: Cost(),
        attrs={"block": REQUIRED, "keep": REQUIRED},
        doc="The first `keep` columns of every `block` columns, concatenated, as f32 (undoes per-block padding).",
        kernel_expr="compact_columns({x}, {block}, {keep})",
        shard="any",
    )
)


def mla_attention(q, c_kv, k_extra, w_kvb, cache, positions, heads, nope, extra, vdim, scale=None):
    """Decode MLA with weight absorption over a latent cache [B, S, R + extra].

    Writes [c_kv | k_extra] (in the cache's dtype) at each row's position, then per head h:
    q_lat = bf16(q_nope)·W_UKᵀ, scores (q_lat·c_t + q_extra·e_t)·scale over t <= position,
    f32 softmax, o_lat = Σ p_t·c_t, y = bf16(o_lat)·W_UV; the two products with the cache follow
    the MXU contract of ops/attention.py's `mxu_operand` (q_lat, q_extra and the softmax's
    unnormalised weights rounded to bf16 for a bf16 cache). W_UK/W_UV of head h are the column
    blocks [h·(nope+vdim), +nope) and [+nope, +vdim) of w_kvb [R, heads·(nope+vdim)].
    """
    b, r = c_kv.shape
    rows = jnp.arange(b)
    entry = jnp.concatenate([c_kv, k_extra], axis=-1).astype(cache.dtype)
    cache = cache.at[rows, positions].set(entry)
    scale = (nope + extra) ** -0.5 if scale is None else scale
    w = weight_f32(w_kvb).reshape(r, heads, nope + vdim)
    w_uk, w_uv = w[..., :nope], w[..., nope:]
    qh = q.astype(jnp.float32).reshape(b, heads, nope + extra)
    q_nope = qh[..., :nope].astype(jnp.bfloat16).astype(jnp.float32)
    q_lat = jnp.einsum("bhn,rhn->bhr", q_nope, w_uk, precision="highest")
    c = cache.astype(jnp.float32)
    q_lat, q_extra = mxu_operand(q_lat, cache.dtype), mxu_operand(qh[..., nope:], cache.dtype)
    s = jnp.einsum("bhr,bsr->bhs", q_lat, c[..., :r], precision="highest")
    s = (s + jnp.einsum("bhe,bse->bhs", q_extra, c[..., r:], precision="highest")) * scale
    t = jnp.arange(cache.shape[1])
    s = jnp.where(t[None, None, :] <= positions[:, None, None], s, -jnp.inf)
    e, denom = softmax_parts(s, None, None)
    e = mxu_operand(e, cache.dtype)
    o_lat = jnp.einsum("bhs,bsr->bhr", e, c[..., :r], precision="highest") / denom
    o_lat = o_lat.astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.einsum("bhr,rhv->bhv", o_lat, w_uv, precision="highest")
    return y.reshape(b, heads * vdim), cache


def mla_prefill(rows, q, c_kv, k_extra, w_kvb, cache, positions, heads, nope, extra, vdim, scale=None):
    """Prefill: write every prompt token's latent entry at its position, then each token attends
    causally over 0..its position, with the same roundings as `mla_attention` per token."""
    n, r = c_kv.shape
    bsz, t, size = rows.batch, rows.length, cache.shape[1]
    entry = jnp.concatenate([c_kv, k_extra], axis=-1).astype(cache.dtype)
    cache = cache.at[rows.row_ids(), rows.write_positions(size)].set(entry, mode="drop")
    scale = (nope + extra) ** -0.5 if scale is None else scale
    w = weight_f32(w_kvb).reshape(r, heads, nope + vdim)
    w_uk, w_uv = w[..., :nope], w[..., nope:]
    qh = q.astype(jnp.float32).reshape(bsz, t, heads, nope + extra)
    q_nope = qh[..., :nope].astype(jnp.bfloat16).astype(jnp.float32)
    q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk, precision="highest")
    c = cache.astype(jnp.float32)
    q_lat, q_extra = mxu_operand(q_lat, cache.dtype), mxu_operand(qh[..., nope:], cache.dtype)
    s = jnp.einsum("bthr,bsr->bths", q_lat, c[..., :r], precision="highest")
    s = (s + jnp.einsum("bthe,bse->bths", q_extra, c[..., r:], precision="highest")) * scale
    pos = positions.reshape(bsz, t)[:, :, None, None]
    s = jnp.where(jnp.arange(size)[None, None, None, :] <= pos, s, -jnp.inf)
    e, denom = softmax_parts(s, None, None)
    e = mxu_operand(e, cache.dtype)
    o_lat = jnp.einsum("bths,bsr->bthr", e, c[..., :r], precision="highest") / denom
    o_lat = o_lat.astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.einsum("bthr,rhv->bthv", o_lat, w_uv, precision="highest")
    return y.reshape(n, heads * vdim), cache


def _mla_infer(args, attrs):
    q, c_kv, k_extra, w, cache, pos = args
    heads, nope, extra, vdim = (attrs[k] for k in ("heads", "nope", "extra", "vdim"))
    for name in ("heads", "nope", "extra", "vdim"):
        if not isinstance(attrs[name], int) or attrs[name] < 1:
            raise OpError(f"{name} must be a positive integer, got {attrs[name]}", name)
    for i, a in enumerate((q, c_kv, k_extra)):
        expect_rank(a, 2, i, "q, c_kv and k_extra")
        expect_float(a, i)
    if w.kind != "tensor" or w.is_state:
        raise OpError(f"w_kvb must be a declared weight, not `{w.name}`", 3)
    expect_rank(w, 2, 3, "the kv up-projection [R, heads·(nope+vdim)]")
    if not cache.is_state:
        raise OpError(f"operand 5 must be a state tensor (the latent cache), not `{cache.name}`", 4)
    expect_rank(cache, 3, 4, "a latent cache [B, S, R + extra]")
    expect_float(cache, 4)
    expect_dtype(pos, ("i32",), 5)
    expect_rank(pos, 1, 5, "the positions")
    b, _, width = cache.type.shape
    r = c_kv.type.shape[1]
    if isinstance(r, int) and isinstance(width, int) and width != r + extra:
        raise OpError(f"latent cache `{cache.name}` is {width} wide, expected R + extra = {r} + {extra}", 4)
    for i, a, want, what in ((0, q, heads * (nope + extra), "q"), (2, k_extra, extra, "k_extra")):
        if a.type.shape[1] != want:
            raise OpError(f"{what} `{a.name}` has {a.type.shape[1]} columns, expected {want}", i)
    if w.type.shape != (r, heads * (nope + vdim)):
        raise OpError(
            f"w_kvb `{w.name}` is {w.type}, expected [{r}, {heads * (nope + vdim)}] "
            f"(R rows; per head {nope} key then {vdim} value columns)",
            3,
        )
    for i, a in ((0, q), (1, c_kv), (2, k_extra), (5, pos)):
        if a.type.shape[0] != b:
            raise OpError(f"`{a.name}` has {a.type.shape[0]} rows, the cache has {b}", i)
    return (TensorType(F32, (b, heads * vdim)),)


def _mla_cost(ins, outs, attrs):
    q, c_kv, k_extra, w, cache, pos = ins
    b, s, width = cache.shape
    r = c_kv.shape[1]
    h, nope, vdim = attrs["heads"], attrs["nope"], attrs["vdim"]
    item = cache.dtype.bits // 8
    read, written = b * s * width * item, b * width * item
    flops = 2 * b * h * (nope * r + s * width + s * r + r * vdim)
    return Cost(weight_bytes=nbytes(w), state_bytes=read + written, flops=flops)


register(
    OpDef(
        "mla_attention",
        ("q", "c_kv", "k_extra", "w_kvb", "cache", "positions"),
        _mla_infer,
        mla_attention,
        _mla_cost,
        attrs={"heads": REQUIRED, "nope": 128, "extra": 64, "vdim": 128, "scale": None},
        inout=("cache",),
        doc="Decode MLA over a latent [c_kv | k_extra] cache with absorbed W_UK/W_UV; writes the row in place.",
        shard="latent_attention",
        reach=(("w_kvb", "own"),),
        attends=True,
        data_dependent=True,
        latency="cached_tokens",
        loop_unit="latent_tiles",
        prefill=mla_prefill,
    )
)
