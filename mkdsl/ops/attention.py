"""Grouped-query decode attention over a KV cache (rotary embedding: ops/rope.py)."""

from __future__ import annotations

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jnp
from mkdsl.ops.registry import (
    Cost,
    OpDef,
    OpError,
    expect_divides,
    expect_dtype,
    expect_float,
    expect_rank,
    register,
)


def seen_keys(key, pos, window=None, chunk=None, global_tokens=None):
    """The mask description: a query at `pos` sees key position `key` when key <= pos, within the
    sliding window (key > pos - window) if there is one, and in the query's own chunk of `chunk`
    positions (key // chunk == pos // chunk: block-local attention, Llama 4) if there is one; the
    first `global_tokens` positions are seen past the window and chunk (prefix-global tokens)."""
    seen = key <= pos
    if window is not None:
        seen = seen & (key > pos - window)
    if chunk is not None:
        seen = seen & (key >= pos - pos % chunk)
    if global_tokens is not None:
        seen = seen | ((key < global_tokens) & (key <= pos))
    return seen


def attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    sinks=None,
    *,
    heads,
    kv_heads,
    scale=None,
    window=None,
    chunk=None,
    global_tokens=None,
):
    """Decode attention: write this token's k/v at `positions`, then attend over the keys at
    positions 0..p that the mask description lets it see (`seen_keys`: window, chunk).

    Grouped-query: query head h reads KV head h // (heads // kv_heads). Cached keys/values are
    read back in the cache's dtype, as a kernel would; the two products follow the MXU contract
    of `mxu_operand` (docs/architecture.md, "Attention numerics"). `sinks` ([heads]) adds one
    unscaled logit per head to the softmax's denominator only.
    """
    b = q.shape[0]
    dk, dv = k_cache.shape[-1], v_cache.shape[-1]
    rows = jnp.arange(b)
    k_cache = k_cache.at[rows, :, positions].set(k.reshape(b, kv_heads, dk).astype(k_cache.dtype))
    v_cache = v_cache.at[rows, :, positions].set(v.reshape(b, kv_heads, dv).astype(v_cache.dtype))
    scale = dk**-0.5 if scale is None else scale
    qh = mxu_operand(q.reshape(b, kv_heads, heads // kv_heads, dk), k_cache.dtype)
    s = jnp.einsum("bkgd,bksd->bkgs", qh, k_cache.astype(jnp.float32), precision="highest") * scale
    t = jnp.arange(k_cache.shape[2])[None, None, None, :]
    seen = seen_keys(t, positions[:, None, None, None], window, chunk, global_tokens)
    e, denom = softmax_parts(jnp.where(seen, s, -jnp.inf), sinks, (1, kv_heads, heads // kv_heads, 1))
    e = mxu_operand(e, v_cache.dtype)
    o = jnp.einsum("bkgs,bksd->bkgd", e, v_cache.astype(jnp.float32), precision="highest") / denom
    return o.reshape(b, heads * dv), k_cache, v_cache


def mxu_operand(x, cache_dtype):
    """What multiplies a cache of `cache_dtype` on the MXU, as f32: rounded to bf16 when the cache is
    bf16 (a bf16 x bf16 product, exact in f32, accumulated in f32), else x in f32 (full-precision
    f32 products). Queries and the softmax's unnormalised weights go through this."""
    x = x.astype(jnp.float32)
    return x.astype(jnp.bfloat16).astype(jnp.float32) if cache_dtype == jnp.bfloat16 else x


def softmax_parts(s, sinks, shape):
    """The softmax over the last axis as (e, denominator): e = exp(s - max), unnormalised (a kernel's
    online softmax multiplies these by the values, then divides); e^sinks (one per query head,
    broadcast as `shape`) is added to each denominator only."""
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(shape)
        m = jnp.maximum(m, sink)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    return e, denom if sinks is None else denom + jnp.exp(sink - m)


def attention_prefill(
    rows,
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    sinks=None,
    *,
    heads,
    kv_heads,
    scale=None,
    window=None,
    chunk=None,
    global_tokens=None,
):
    """Prefill: write every prompt token's k/v at its position, then each token attends causally
    over 0..its position (earlier cached tokens and the prompt so far; within the window and its
    chunk if the op has them), as `attention` per token, with its roundings."""
    n, (bsz, t) = q.shape[0], (rows.batch, rows.length)
    dk, dv, size = k_cache.shape[-1], v_cache.shape[-1], k_cache.shape[2]
    b, at = rows.row_ids(), rows.write_positions(size)
    k_cache = k_cache.at[b, :, at].set(k.reshape(n, kv_heads, dk).astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[b, :, at].set(v.reshape(n, kv_heads, dv).astype(v_cache.dtype), mode="drop")
    scale = dk**-0.5 if scale is None else scale
    qh = mxu_operand(q.reshape(bsz, t, kv_heads, heads // kv_heads, dk), k_cache.dtype)
    s = jnp.einsum("btkgd,bksd->btkgs", qh, k_cache.astype(jnp.float32), precision="highest") * scale
    pos = positions.reshape(bsz, t)[:, :, None, None, None]
    key = jnp.arange(size)[None, None, None, None, :]
    seen = seen_keys(key, pos, window, chunk, global_tokens)
    e, denom = softmax_parts(jnp.where(seen, s, -jnp.inf), sinks, (1, 1, kv_heads, heads // kv_heads, 1))
    e = mxu_operand(e, v_cache.dtype)
    o = jnp.einsum("btkgs,bksd->btkgd", e, v_cache.astype(jnp.float32), precision="highest") / denom
    return o.reshape(n, heads * dv), k_cache, v_cache


def _check_sinks(sinks, heads) -> None:
    if sinks.kind != "tensor" or sinks.is_state:
        raise OpError(f"sinks must be a declared weight [heads], not `{sinks.name}`", 6)
    expect_float(sinks, 6)
    if sinks.type.shape != (heads,):
        raise OpError(f"sinks `{sinks.name}` is {sinks.type}, expected one logit per query head: [{heads}]", 6)


def _attention_infer(args, attrs):
    q, k, v, kc, vc, pos = args[:6]
    heads, kv_heads = attrs["heads"], attrs["kv_heads"]
    for what in ("window", "chunk", "global_tokens"):
        n = attrs.get(what)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise OpError(f"{what} must be a positive number of tokens (or 0: none), got {n!r}", what)
    if len(args) > 6:
        _check_sinks(args[6], heads)
    for i, a in enumerate((q, k, v)):
        expect_rank(a, 2, i, "q, k and v")
        expect_float(a, i)
    for i, c in ((3, kc), (4, vc)):
        if not c.is_state:
            raise OpError(f"operand {i + 1} must be a state tensor (the cache), not `{c.name}`", i)
        expect_rank(c, 4, i, "a KV cache [B, kv_heads, S, head_dim]")
    expect_dtype(pos, ("i32",), 5)
    if not attrs.get("kv_axes"):  # set by the shard pass when the KV heads are replicated
        expect_divides(heads, kv_heads, "query heads per KV head", "kv_heads")
    b, _, s, dk = kc.type.shape
    dv = vc.type.shape[3]
    for i, c in ((3, kc), (4, vc)):
        if c.type.shape[1] != kv_heads:
            raise OpError(f"caches must have {kv_heads} KV heads in dimension 2, got {c.type}", i)
    if vc.type.shape[:3] != kc.type.shape[:3]:
        raise OpError(f"key cache {kc.type} and value cache {vc.type} disagree", 4)
    for i, a, want, what in ((0, q, heads * dk, "q"), (1, k, kv_heads * dk, "k"), (2, v, kv_heads * dv, "v")):
        if a.type.shape[1] != want:
            raise OpError(f"{what} `{a.name}` has {a.type.shape[1]} columns, expected {want}", i)
        if a.type.shape[0] != b:
            raise OpError(f"{what} `{a.name}` has {a.type.shape[0]} rows, the caches have {b}", i)
    return (TensorType(F32, (b, heads * dv)),)


def _attention_cost(ins, outs, attrs):
    kc, vc = ins[3], ins[4]
    b, kvh, s, dk = kc.shape
    bounds = [b for b in (attrs["window"], attrs.get("chunk")) if b is not None]
    if bounds:  # the cost is charged on the tokens seen (sequence dims = context + 1); a chunk: at
        s = min(s, min(bounds) + (attrs.get("global_tokens") or 0))  # most its size, plus the global ones
    dv = vc.shape[3]
    cache_read = b * kvh * s * (dk + dv) * (kc.dtype.bits // 8)
    written = b * kvh * (dk + dv) * (kc.dtype.bits // 8)
    return Cost(state_bytes=cache_read + written, flops=2 * b * attrs["heads"] * s * (dk + dv))


register(
    OpDef(
        "attention",
        ("q", "k", "v", "k_cache", "v_cache", "positions", "sinks"),
        _attention_infer,
        attention,
        _attention_cost,
        attrs={"heads": 1, "kv_heads": 1, "scale": None, "window": None, "chunk": None, "global_tokens": None},
        optional=1,
        unset=(
            ("window", 0),
            ("chunk", 0),
            ("global_tokens", 0),
        ),  # `window=0`, `chunk=0`: no window, no chunks (a block parameter's "none")
        inout=("k_cache", "v_cache"),
        doc="Grouped-query decode attention (optional sliding window, chunks of `chunk` tokens seen only from "
        "inside, the first `global_tokens` seen by all, per-head sink logits); writes k/v at each row's position "
        "in place.",
        shard="kv_heads",
        attends=True,
        data_dependent=True,
        latency="cached_tokens",
        loop_unit="kv_tiles",
        prefill=attention_prefill,
    )
)
