"""One-core microbenchmarks of `mkdsl calibrate`, each running the kernel's own code from the
rendered runtime (calibrate/runtime.py): the weight ring (`linear` / `qlinear` over the ring
tables), the routed experts (`MoE`), decode attention (`Attention`), top-k routing (`topk_into`)
and the vector work of a norm and a gate (`rmsnorm`, the gate's kernel expression). Each builder
returns (function, arguments, expected result): the caller times the function on a TPU and always
checks its result against the numpy expectation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkdsl.backends.tpu.calibrate import runtime

F32 = jnp.float32
ROWS = 8  # rows each streamed tile contributes to the checked sum (all would be vector work, not DMA)


@dataclasses.dataclass(frozen=True)
class Within:
    """An expected result and the largest error the arithmetic allows, per entry."""

    value: np.ndarray
    bound: np.ndarray


def _call(kernel, out_shape, in_specs, scratch, interpret):
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        in_specs=in_specs,
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=scratch,
        interpret=interpret,
    )


def ring(x: np.ndarray, w: np.ndarray, tk: int, tn: int, depth: int, interpret=None):
    """out = x @ W, W [K, N] streamed as [tk, tn] tiles through the kernel's ring of `depth` banks,
    `depth - 1` in flight: the runtime's `Stream`, `ring_tables`, `ring_issue` and `linear`, as a
    generated kernel streams a bf16 matrix (an 8-bit W: a `QStream` of fp8 codes decoded in VMEM,
    `qlinear`, the kernel's `cast` format). x is bf16 [rows, K]; the result f32 [rows, N]."""
    rt = runtime.module(depth)
    (k, n), eight = w.shape, w.dtype.itemsize == 1
    if eight:
        st = rt.QStream("w", k=k, n=n, tk=tk, tn=tn, start=0, stacked=False, fmt="cast", parts=(("", "ring", 1, 1),))
    else:
        st = rt.Stream("w", k=k, n=n, tk=tk, tn=tn, start=0, stacked=False)
    tables = rt.ring_tables({0: [(st, None)]}, ())
    names = ("desc", "x", "w", "out", "ring", "ring_sem")

    def kernel(*refs):
        r = rt.Refs(names, refs)

        def issue(g, consumer=None, part=None):  # the generated kernel's `issue` (module.py.jinja)
            if part == "own":
                arms, past = (tables.arms.index(dataclasses.replace(consumer, start=0)),), False
            elif part == "beyond":
                arms, past = tables.beyond[consumer]
            else:
                arms, past = tables.ahead[consumer] if consumer is not None else (None, True)
            rt.ring_issue(r, tables, r.desc, g, arms, past)

        for g in range(depth - 1):  # the prologue: the first tiles in flight
            issue(g)
        (rt.qlinear if eight else rt.linear)(r, issue, st, 0, 0, r.x, r.out)

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    fn = _call(
        kernel,
        jax.ShapeDtypeStruct((x.shape[0], n), F32),
        [pl.BlockSpec(memory_space=pltpu.SMEM), vmem, any_],
        [pltpu.VMEM((depth, tk, tn), w.dtype), pltpu.SemaphoreType.DMA((depth,))],
        interpret,
    )
    xf, wf = x.astype(np.float64), w.astype(np.float64)
    # bf16 x bf16 (or fp8) products are exact in f32; an f32 sum of K of them in any order is off
    # by at most K * 2^-24 * sum |products|
    expected = Within((xf @ wf).astype(np.float32), k * 2.0**-24 * (np.abs(xf) @ np.abs(wf)))
    return fn, (jnp.asarray(tables.desc), jnp.asarray(x), jnp.asarray(w)), expected


KV_SLOTS = 3  # KV tile buffers in flight, as the kernel's (lowerings/attention.py KV_SLOTS)


def attention(tokens: int, heads: int, kv_heads: int, d: int, kv_tile: int, interpret=None):
    """One row's decode attention by the kernel's `Attention` (runtime/attention.py.jinja): the new
    token at position tokens - 1 patched into its KV tile and written back in place, the cache
    walked in `kv_tile`-token tiles (KV_SLOTS - 1 in flight) with an online softmax; the (row, KV
    tile) tables from the kernel's `kv_tables`. Result: the row's output [1, heads * d]."""
    rt = runtime.module(2)
    rows, batch, seq = 16, 1, -(-tokens // kv_tile) * kv_tile
    keys = ("q2d", "k2d", "v2d", "o2d", "ktiles", "vtiles", "m", "l", "acc", "wb", "kv_sem", "wb_sem")
    scratch = {
        "q2d": pltpu.VMEM((1, heads * rows, 128), F32),
        "k2d": pltpu.VMEM((1, kv_heads * rows, 128), F32),
        "v2d": pltpu.VMEM((1, kv_heads * rows, 128), F32),
        "o2d": pltpu.VMEM((1, heads * rows, 128), F32),
        "ktiles": pltpu.VMEM((KV_SLOTS, kv_heads, kv_tile, d), jnp.bfloat16),
        "vtiles": pltpu.VMEM((KV_SLOTS, kv_heads, kv_tile, d), jnp.bfloat16),
        "m": pltpu.VMEM((heads, 1), F32),
        "l": pltpu.VMEM((heads, 1), F32),
        "acc": pltpu.VMEM((heads, d), F32),
        "wb": pltpu.VMEM((2, batch, kv_heads, rt.KV_BLOCK, d), jnp.bfloat16),
        "kv_sem": pltpu.SemaphoreType.DMA((2, KV_SLOTS)),
        "wb_sem": pltpu.SemaphoreType.DMA((1,)),
        "kv_row": pltpu.SMEM((batch * seq // kv_tile,), jnp.int32),
        "kv_t0": pltpu.SMEM((batch * seq // kv_tile,), jnp.int32),
        "kv_n": pltpu.SMEM((1,), jnp.int32),
        "wb_pending": pltpu.SMEM((1,), jnp.int32),
    }
    names = ("positions", "q", "k", "v", "k_cache", "v_cache", "out", "k_cache_out", "v_cache_out", *scratch)
    caches = {"k_cache": "k_cache", "v_cache": "v_cache", "k_cache_out": "k_cache_out", "v_cache_out": "v_cache_out"}

    def kernel(*refs):
        r = rt.Refs(names, refs)
        rt.kv_tables(r.positions, batch, kv_tile, r.kv_row, r.kv_t0, r.kv_n)
        r.wb_pending[0] = 0
        att = rt.Attention(r, r.positions, 0, rows=rows, batch=batch, heads=heads, kv_heads=kv_heads, dk=d, dv=d,
                           kv_tile=kv_tile, kv_slots=KV_SLOTS, scale=d**-0.5,
                           names={**{k: k for k in keys}, **caches}, window=None)  # fmt: skip
        att(0, r.q, r.k, r.v, r.out)
        att.drain()  # the write-back of the new token's block, as the kernel drains at its end

    vmem, any_ = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    cache = jax.ShapeDtypeStruct((1, batch, kv_heads, seq, d), jnp.bfloat16)
    call = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, heads * d), F32), cache, cache),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), vmem, vmem, vmem, any_, any_],
        out_specs=(vmem, any_, any_),
        scratch_shapes=list(scratch.values()),
        input_output_aliases={4: 1, 5: 2},
        interpret=interpret,
    )
    r = np.random.default_rng(tokens)
    bf16 = tile_dtype("bf16")
    q, k, v = (r.standard_normal((rows, n * d)).astype(np.float32) / 2 for n in (heads, kv_heads, kv_heads))
    kc, vc = (r.standard_normal(cache.shape).astype(bf16) for _ in range(2))
    pos = np.array([tokens - 1], np.int32)
    return (
        (lambda *a: call(*a)[0][0:1]),
        (pos, q, k, v, kc, vc),
        _attention_expected(q, k, v, kc, vc, tokens, heads, kv_heads, d),
    )


def _attention_expected(q, k, v, kc, vc, tokens, heads, kv_heads, d) -> Within:
    """Row 0's attention in float64 over the cache's first tokens - 1 entries and the new token (K/V
    stored as bf16, as the kernel patches them). The kernel also rounds q and the softmax weights to
    bf16 before the MXU (relative 2^-8 each): within 2^-6 of the largest |value| per entry."""
    bf = tile_dtype("bf16")
    group = heads // kv_heads
    out = np.zeros((1, heads * d))
    vmax = 0.0
    for h in range(heads):
        g = h // group
        keys = np.concatenate([kc[0, 0, g, : tokens - 1], k[0:1, g * d : (g + 1) * d].astype(bf)]).astype(np.float64)
        vals = np.concatenate([vc[0, 0, g, : tokens - 1], v[0:1, g * d : (g + 1) * d].astype(bf)]).astype(np.float64)
        s = keys @ q[0, h * d : (h + 1) * d].astype(np.float64) * d**-0.5
        p = np.exp(s - s.max())
        out[0, h * d : (h + 1) * d] = p @ vals / p.sum()
        vmax = max(vmax, float(np.abs(vals).max()))
    return Within(out.astype(np.float32), np.full(out.shape, 2.0**-6 * vmax))


def experts(ids: np.ndarray, w13: tuple, w2: np.ndarray, tn: int, slots: int, interpret=None):
    """The routed experts of one layer by the kernel's `MoE` (runtime/moe.py.jinja, bf16 experts):
    the rows' chosen ids staged to SMEM and made distinct (`take_ids`), each distinct expert
    streamed once in [D, tn] / [tn, D] column tile sets through `slots` slots, `slots - 1` in
    flight, and summed by the rows' weights. ids [rows, k]; w13: W1, W3 [E, D, F]; w2 [E, F, D].
    Result: the experts' output f32 [rows, D]."""
    rt = runtime.module(2)
    rows, k = ids.shape
    e, d, f = w13[0].shape
    pieces = {"w1": (slots, d, tn), "w3": (slots, d, tn), "w2": (slots, tn, d)}
    scratch = {f"moe_{n}": pltpu.VMEM(shape, jnp.bfloat16) for n, shape in pieces.items()}
    scratch |= {
        "moe_sem": pltpu.SemaphoreType.DMA((3, slots)),
        "moe_zb": pltpu.VMEM((rows, d), jnp.bfloat16),
        "moe_ids_stage": pltpu.VMEM((rows, rt.ID_LANES), jnp.int32),
        "moe_ids_smem": pltpu.SMEM((rows, rt.ID_LANES), jnp.int32),
        "moe_id_sem": pltpu.SemaphoreType.DMA((1,)),
        "moe_list": pltpu.SMEM((rows * k,), jnp.int32),
        "moe_count": pltpu.SMEM((1,), jnp.int32),
        "moe_pos": pltpu.SMEM((e,), jnp.int32),
    }
    names = ("ids", "weights", "z", "w_1", "w_3", "w_2", "out", *scratch)

    def kernel(*refs):
        r = rt.Refs(names, refs)
        moe = rt.MoE(r, rows=rows, batch=rows, E=e, k=k, D=d, F=f, tn=tn, slots=slots, prefix="moe_", fmt="bf16",
                     names={"w1": "w_1", "w3": "w_3", "w2": "w_2"}, act=lambda g, u: jax.nn.silu(g) * u)  # fmt: skip
        moe.take_ids(r.ids)
        moe.experts(None, r.z, r.weights, r.out, r.ids)

    vmem, any_ = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY)
    call = _call(kernel, jax.ShapeDtypeStruct((rows, d), F32), [vmem, vmem, vmem, any_, any_, any_],
                 list(scratch.values()), interpret)  # fmt: skip
    r = np.random.default_rng(int(ids.sum()) + slots)
    z = r.standard_normal((rows, d)).astype(np.float32)
    weights = r.random((rows, k)).astype(np.float32)
    return call, (ids, weights, z, *w13, w2), _experts_expected(ids, weights, z, w13, w2)


def _experts_expected(ids, weights, z, w13, w2) -> Within:
    """sum_i w[b, i] * bf16(silu(bf16 z W1) * (bf16 z W3)) @ W2 of expert ids[b, i], in float64.
    The kernel's f32 sums over D (and then F) may round its hidden values to bf16 differently
    (one bf16 step, 2^-8 relative): within 2^-7 of sum_i |w| (|h| @ |W2|) per entry."""
    bf = tile_dtype("bf16")
    zb = z.astype(bf).astype(np.float64)
    out, bound = np.zeros(z.shape), np.zeros(z.shape)
    for b in range(ids.shape[0]):
        for i, ex in enumerate(ids[b]):
            g, u = zb[b] @ w13[0][ex].astype(np.float64), zb[b] @ w13[1][ex].astype(np.float64)
            h = (g / (1 + np.exp(-g)) * u).astype(bf).astype(np.float64)
            w2e = w2[ex].astype(np.float64)
            out[b] += weights[b, i] * (h @ w2e)
            bound[b] += abs(weights[b, i]) * 2.0**-7 * (np.abs(h) @ np.abs(w2e))
    return Within(out.astype(np.float32), bound)


def routing(scores: np.ndarray, k: int, interpret=None):
    """Top-k of each row of `scores` [8, E] in-kernel by the kernel's `topk_into` (k passes of a
    row max, ties to the lower index: mkdsl's `topk` and `route`). Result: the ids [8, k]."""
    rt = runtime.module(2)
    rows = scores.shape[0]

    def kernel(s_ref, v_ref, o_ref):
        rt.topk_into(s_ref[...], v_ref, o_ref, k)

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, k), F32), jax.ShapeDtypeStruct((rows, k), jnp.int32)),
        in_specs=[vmem],
        out_specs=(vmem, vmem),
        interpret=interpret,
    )
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)
    return (lambda s: call(s)[1]), (jnp.asarray(scores),), expected


def vector(x: np.ndarray, w: np.ndarray, g: np.ndarray, reps: int, interpret=None):
    """The vector work of a layer's small ops, `reps` times over: the kernel's `rmsnorm` of x by w,
    then the SwiGLU gate of g times it, as the kernel computes it (the op's own `kernel_expr`,
    evaluated over the rendered runtime). Result: the last repetition's (all equal)."""
    from mkdsl.ops import OPS

    rt = runtime.module(2)
    eps = 1e-6
    gate = compile(OPS["swiglu"].kernel_expr.format(gate="gate", up="up"), "<swiglu kernel_expr>", "eval")

    def kernel(x_ref, w_ref, g_ref, o_ref, n_ref):
        def body(_, acc):
            rt.rmsnorm(x_ref, w_ref[...], n_ref, eps, 1)
            return acc * 0.0 + eval(gate, rt.__dict__, {"gate": g_ref[...], "up": n_ref[...]})  # noqa: S307

        o_ref[...] = jax.lax.fori_loop(0, reps, body, jnp.zeros(x.shape, F32))

    spec = pl.BlockSpec(memory_space=pltpu.VMEM)
    fn = _call(kernel, jax.ShapeDtypeStruct(x.shape, F32), [spec, spec, spec], [pltpu.VMEM(x.shape, F32)], interpret)
    n = x / np.sqrt((x * x).mean(1, keepdims=True) + eps) * w
    expected = g / (1 + np.exp(-g)) * n if reps else np.zeros_like(x)
    return fn, (jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)), expected


@functools.cache
def tile_dtype(name: str):
    return {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "f32": jnp.float32}[name]
