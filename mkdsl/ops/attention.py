"""Attention: rotary position embedding and decode attention over a KV cache."""

from __future__ import annotations

from mkdsl.dtypes import F32
from mkdsl.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.registry import (
    Cost,
    OpDef,
    OpError,
    expect_divides,
    expect_dtype,
    expect_float,
    expect_rank,
    numel,
    register,
)


def rope(x, positions, heads, theta):
    """Rotary embedding, rotate-half convention: pairs (i, i + d/2) of each head rotate by
    positions·theta^(-2i/d)."""
    x = x.astype(jnp.float32)
    b, n = x.shape
    d = n // heads
    inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angle = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(angle)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angle)] * 2, axis=-1)[:, None, :]
    xh = x.reshape(b, heads, d)
    rotated = jnp.concatenate([-xh[..., d // 2 :], xh[..., : d // 2]], axis=-1)
    return (xh * cos + rotated * sin).reshape(b, n)


def _rope_infer(args, attrs):
    x, pos = args
    expect_rank(x, 2, 0, "the input")
    expect_float(x, 0)
    expect_dtype(pos, ("i32",), 1)
    d = expect_divides(x.type.shape[1], attrs["heads"], "row width per head", "heads")
    if isinstance(d, int) and d % 2:
        raise OpError(f"rope needs an even head dimension, got {d}", "heads")
    return (TensorType(F32, x.type.shape),)


register(
    OpDef(
        "rope",
        ("x", "positions"),
        _rope_infer,
        lambda x, p, heads, theta: (rope(x, p, heads, theta),),
        lambda ins, outs, a: Cost(flops=6 * numel(outs[0])),
        attrs={"heads": 1, "theta": 10000.0},
        doc="Rotary position embedding (rotate-half pairs) of each head at each row's position.",
        shard="heads",
    )
)


def attention(q, k, v, k_cache, v_cache, positions, heads, kv_heads, scale=None):
    """Decode attention: write this token's k/v at `positions`, then attend over 0..position.

    Grouped-query: query head h reads KV head h // (heads // kv_heads). Scores and softmax in
    f32; cached keys/values are read back in the cache's dtype, as a kernel would.
    """
    b = q.shape[0]
    dk, dv = k_cache.shape[-1], v_cache.shape[-1]
    rows = jnp.arange(b)
    k_cache = k_cache.at[rows, :, positions].set(k.reshape(b, kv_heads, dk).astype(k_cache.dtype))
    v_cache = v_cache.at[rows, :, positions].set(v.reshape(b, kv_heads, dv).astype(v_cache.dtype))
    scale = dk**-0.5 if scale is None else scale
    qh = q.astype(jnp.float32).reshape(b, kv_heads, heads // kv_heads, dk)
    s = jnp.einsum("bkgd,bksd->bkgs", qh, k_cache.astype(jnp.float32), precision="highest") * scale
    t = jnp.arange(k_cache.shape[2])
    s = jnp.where(t[None, None, None, :] <= positions[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgs,bksd->bkgd", p, v_cache.astype(jnp.float32), precision="highest")
    return o.reshape(b, heads * dv), k_cache, v_cache


def attention_prefill(rows, q, k, v, k_cache, v_cache, positions, heads, kv_heads, scale=None):
    """Prefill: write every prompt token's k/v at its position, then each token attends causally
    over 0..its position (earlier cached tokens and the prompt so far), as `attention` per token."""
    n, (bsz, t) = q.shape[0], (rows.batch, rows.length)
    dk, dv, size = k_cache.shape[-1], v_cache.shape[-1], k_cache.shape[2]
    b, at = rows.row_ids(), rows.write_positions(size)
    k_cache = k_cache.at[b, :, at].set(k.reshape(n, kv_heads, dk).astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[b, :, at].set(v.reshape(n, kv_heads, dv).astype(v_cache.dtype), mode="drop")
    scale = dk**-0.5 if scale is None else scale
    qh = q.astype(jnp.float32).reshape(bsz, t, kv_heads, heads // kv_heads, dk)
    s = jnp.einsum("btkgd,bksd->btkgs", qh, k_cache.astype(jnp.float32), precision="highest") * scale
    pos = positions.reshape(bsz, t)[:, :, None, None, None]
    s = jnp.where(jnp.arange(size)[None, None, None, None, :] <= pos, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("btkgs,bksd->btkgd", p, v_cache.astype(jnp.float32), precision="highest")
    return o.reshape(n, heads * dv), k_cache, v_cache


def _attention_infer(args, attrs):
    q, k, v, kc, vc, pos = args
    heads, kv_heads = attrs["heads"], attrs["kv_heads"]
    for i, a in enumerate((q, k, v)):
        expect_rank(a, 2, i, "q, k and v")
        expect_float(a, i)
    for i, c in ((3, kc), (4, vc)):
        if not c.is_state:
            raise OpError(f"operand {i + 1} must be a state tensor (the cache), not `{c.name}`", i)
        expect_rank(c, 4, i, "a KV cache [B, kv_heads, S, head_dim]")
    expect_dtype(pos, ("i32",), 5)
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
    q, k, v, kc, vc, pos = ins
    b, kvh, s, dk = kc.shape
    dv = vc.shape[3]
    cache_read = b * kvh * s * (dk + dv) * (kc.dtype.bits // 8)
    written = b * kvh * (dk + dv) * (kc.dtype.bits // 8)
    return Cost(state_bytes=cache_read + written, flops=2 * b * attrs["heads"] * s * (dk + dv))


register(
    OpDef(
        "attention",
        ("q", "k", "v", "k_cache", "v_cache", "positions"),
        _attention_infer,
        attention,
        _attention_cost,
        attrs={"heads": 1, "kv_heads": 1, "scale": None},
        inout=("k_cache", "v_cache"),
        doc="Grouped-query decode attention; writes k/v at each row's position in place.",
        shard="kv_heads",
        attends=True,
        data_dependent=True,
        prefill=attention_prefill,
    )
)
