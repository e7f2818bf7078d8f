"""Block drafters (speculative decoding): attention of one block of rows over a slot cache of
target context, and the left-to-right Markov-biased argmax that reads the block's drafts.

A block drafter (Kimi K3's DSpark, docs/language.md "Drafters") runs one step per target step:
its rows are one block of one sequence (the anchor token and mask tokens at consecutive
positions), and it reads the target's hidden states of the rows accepted since its last step
(the `context` state, written by the host). Both ops are general: any window, head layout and
block size; any vocabulary and Markov rank.
"""

from __future__ import annotations

from mkdsl.lang.dtypes import F32, I32
from mkdsl.lang.ir import TensorType
from mkdsl.lazy import jax, jnp
from mkdsl.ops.attention import mxu_operand
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


def slot_write(ck, cv, k_cache, v_cache, slot_pos, ctx_positions):
    """Write context row i (its position `ctx_positions[i]` >= 0; -1 marks no row) at slot
    position mod S of both caches [kv_heads, S, d], and remember its position in `slot_pos` [S]
    (-1: an empty slot). Rows are written in order, so a later row wins a shared slot."""
    k_cache, v_cache, slot_pos = jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(slot_pos)
    kvh, size, dk = k_cache.shape
    dv = v_cache.shape[2]
    n = ck.shape[0]
    slots = jnp.where(ctx_positions >= 0, ctx_positions % size, size)  # size: dropped
    i = jnp.arange(n)
    later = ((slots[None, :] == slots[:, None]) & (i[None, :] > i[:, None])).any(axis=1)
    slots = jnp.where(later, size, slots)  # a later row wins a shared slot: the earlier one is dropped
    ks = jnp.swapaxes(ck.reshape(n, kvh, dk).astype(k_cache.dtype), 0, 1)
    vs = jnp.swapaxes(cv.reshape(n, kvh, dv).astype(v_cache.dtype), 0, 1)
    k_cache = k_cache.at[:, slots].set(ks, mode="drop")
    v_cache = v_cache.at[:, slots].set(vs, mode="drop")
    return k_cache, v_cache, slot_pos.at[slots].set(ctx_positions, mode="drop")


def block_attention(
    q, k, v, ck, cv, k_cache, v_cache, slot_pos, ctx_positions, positions, *, heads, kv_heads, scale=None, window=None
):
    """The step's rows are one block of one sequence at `positions` (row 0 the anchor). First the
    context rows' keys/values are written into the slot cache (`slot_write`); then row r attends to
    the cached slots whose position t satisfies 0 <= t < positions[0] and t > positions[0] - window
    (every slot the cache holds without a window), and causally to the block's rows 0..r (their
    keys/values are the step's own, never cached). Grouped-query heads and the MXU roundings of
    `attention` (ops/attention.py)."""
    k_cache, v_cache, slot_pos = slot_write(ck, cv, k_cache, v_cache, slot_pos, ctx_positions)
    b = q.shape[0]
    dk, dv = k_cache.shape[-1], v_cache.shape[-1]
    g = heads // kv_heads
    scale = dk**-0.5 if scale is None else scale
    anchor = positions[0]
    seen = (slot_pos >= 0) & (slot_pos < anchor)
    if window is not None:
        seen = seen & (slot_pos > anchor - window)
    kb = k.reshape(b, kv_heads, dk).astype(k_cache.dtype).astype(jnp.float32)  # as a kernel would keep them
    vb = v.reshape(b, kv_heads, dv).astype(v_cache.dtype).astype(jnp.float32)
    qh = mxu_operand(q.reshape(b, kv_heads, g, dk), k_cache.dtype)
    sc = jnp.einsum("bkgd,ksd->bkgs", qh, k_cache.astype(jnp.float32), precision="highest") * scale
    sb = jnp.einsum("bkgd,ckd->bkgc", qh, kb, precision="highest") * scale
    causal = jnp.arange(b)[None, :] <= jnp.arange(b)[:, None]  # [row, block row]
    sc = jnp.where(seen[None, None, None, :], sc, -jnp.inf)
    sb = jnp.where(causal[:, None, None, :], sb, -jnp.inf)
    s = jnp.concatenate([sc, sb], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    e = mxu_operand(e, v_cache.dtype)
    size = k_cache.shape[1]
    o = jnp.einsum("bkgs,ksd->bkgd", e[..., :size], v_cache.astype(jnp.float32), precision="highest")
    o = o + jnp.einsum("bkgc,ckd->bkgd", e[..., size:], vb, precision="highest")
    return (o / denom).reshape(b, heads * dv), k_cache, v_cache, slot_pos


def _block_attention_prefill(rows, *operands, **attrs):
    """A drafter is not prefilled from a prompt: its host feeds the prompt's context through
    steps (mkdsl/run/drafters.py)."""
    raise NotImplementedError("block_attention runs per step: a drafter's host feeds the prompt's context in steps")


def _block_attention_infer(args, attrs):
    q, k, v, ck, cv, kc, vc, sp, cpos, pos = args
    heads, kv_heads = attrs["heads"], attrs["kv_heads"]
    window = attrs["window"]
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise OpError(f"window must be a positive number of tokens (or 0: none), got {window!r}", "window")
    expect_divides(heads, kv_heads, "query heads per KV head", "kv_heads")
    for i, a in enumerate((q, k, v, ck, cv)):
        expect_rank(a, 2, i, "q, k, v and the context keys/values")
        expect_float(a, i)
    for i, c in ((5, kc), (6, vc)):
        if not c.is_state:
            raise OpError(f"operand {i + 1} must be a state tensor (the slot cache), not `{c.name}`", i)
        expect_rank(c, 3, i, "a slot cache [kv_heads, slots, head_dim]")
        if c.type.shape[0] != kv_heads:
            raise OpError(f"slot cache `{c.name}` is {c.type}, expected {kv_heads} KV heads first", i)
    if not sp.is_state:
        raise OpError(f"operand 8 must be a state tensor (the slots' positions), not `{sp.name}`", 7)
    expect_dtype(sp, ("i32",), 7)
    if sp.type.shape != kc.type.shape[1:2] or vc.type.shape[:2] != kc.type.shape[:2]:
        raise OpError(f"slot positions {sp.type} and caches {kc.type}, {vc.type} disagree on the slots", 7)
    for i, a in ((8, cpos), (9, pos)):
        expect_dtype(a, ("i32",), i)
        expect_rank(a, 1, i, "positions [rows]")
    dk, dv = kc.type.shape[2], vc.type.shape[2]
    b, c = q.type.shape[0], ck.type.shape[0]
    for i, a, rows, want, what in (
        (0, q, b, heads * dk, "q"),
        (1, k, b, kv_heads * dk, "k"),
        (2, v, b, kv_heads * dv, "v"),
        (3, ck, c, kv_heads * dk, "context keys"),
        (4, cv, c, kv_heads * dv, "context values"),
    ):
        if a.type.shape != (rows, want):
            raise OpError(f"{what} `{a.name}` is {a.type}, expected [{rows}, {want}]", i)
    if cpos.type.shape != (c,) or pos.type.shape != (b,):
        raise OpError(f"positions: context {cpos.type} for {c} rows, block {pos.type} for {b} rows", 8)
    return (TensorType(F32, (b, heads * dv)),)


def _block_attention_cost(ins, outs, attrs):
    """The slot caches are read whole and written back (the kernel keeps them in VMEM per layer)."""
    q, kc, vc = ins[0], ins[5], ins[6]
    kvh, size, dk = kc.shape
    dv = vc.shape[2]
    cache = kvh * size * (dk + dv) * (kc.dtype.bits // 8) + size * 4
    b = q.shape[0]
    flops = 2 * b * attrs["heads"] * (size + b) * (dk + dv)
    return Cost(state_bytes=2 * cache, flops=flops)


register(
    OpDef(
        "block_attention",
        ("q", "k", "v", "ctx_k", "ctx_v", "k_cache", "v_cache", "slot_pos", "ctx_positions", "positions"),
        _block_attention_infer,
        block_attention,
        _block_attention_cost,
        attrs={"heads": 1, "kv_heads": 1, "scale": None, "window": None},
        unset=(("window", 0),),
        inout=("k_cache", "v_cache", "slot_pos"),
        reach=(("ctx_positions", "own"),),  # a state its lowering copies to SMEM itself
        doc="A block of rows of one sequence attends to a slot cache of context (positions below the first "
        "row's, within the window) and causally to itself; writes the context rows into the cache first.",
        shard="block_heads",
        attends=True,
        prefill=_block_attention_prefill,
    )
)


def markov_argmax(logits, tokens, w1, w2):
    """Drafts read left to right: draft r = argmax_v (logits[r, v] + w2[v] . w1[prev]), prev
    being tokens[0] (the anchor) for r = 0 and draft r-1 after it (first index on ties).
    w1, w2: [V, rank]; the bias is an f32 product of the stored weights."""
    x = jnp.asarray(logits, jnp.float32)
    w1f, w2f = jnp.asarray(w1, jnp.float32), jnp.asarray(w2, jnp.float32)

    def row(prev, xr):
        bias = jnp.dot(w2f, w1f[prev], precision="highest")
        d = jnp.argmax(xr + bias).astype(jnp.int32)
        return d, d

    _, drafts = jax.lax.scan(row, jnp.asarray(tokens[0], jnp.int32), x)
    return (drafts,)


def _markov_infer(args, attrs):
    x, tokens, w1, w2 = args
    expect_rank(x, 2, 0, "the logits [rows, V]")
    expect_float(x, 0)
    expect_dtype(tokens, ("i32",), 1)
    expect_rank(tokens, 1, 1, "token ids [rows]")
    for i, w in ((2, w1), (3, w2)):
        if w.kind != "tensor" or w.is_state:
            raise OpError(f"operand {i + 1} must be a declared weight [V, rank], not `{w.name}`", i)
        expect_rank(w, 2, i, "a Markov matrix [V, rank]")
        expect_float(w, i)
    if w1.type.shape[1] != w2.type.shape[1] or w2.type.shape[0] != x.type.shape[1]:  # w1 whole on every device
        raise OpError(f"Markov matrices {w1.type}, {w2.type} must be [V, rank], [{x.type.shape[1]}, rank]", 3)
    if tokens.type.shape[0] != x.type.shape[0]:
        raise OpError(f"token ids {tokens.type} must have one per row of the logits {x.type}", 1)
    return (TensorType(I32, (x.type.shape[0],)),)


def _markov_cost(ins, outs, attrs):
    """w2 read whole, one row of w1 per draft."""
    x, w1, w2 = ins[0], ins[2], ins[3]
    b, v = x.shape
    rank = w2.shape[1]
    row = rank * (w1.dtype.bits // 8)
    return Cost(weight_bytes=w2.dtype.bits // 8 * v * rank + b * row, flops=2 * b * v * rank + b * v)


register(
    OpDef(
        "markov_argmax",
        ("logits", "tokens", "w1", "w2"),
        _markov_infer,
        markov_argmax,
        _markov_cost,
        doc="Drafts read left to right: row r's argmax of logits + w2·w1[previous token] (the anchor, "
        "tokens[0], before row 0).",
        shard="markov",
        reach=(("w1", "own"),),
        exchange="best",
        exchange_axes="shard_axes",
    )
)
