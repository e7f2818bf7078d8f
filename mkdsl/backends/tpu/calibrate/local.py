"""One-core microbenchmarks of `mkdsl calibrate`: the weight ring (the kernel's own `linear` over its
ring tables, from the rendered runtime: calibrate/runtime.py), the expert DMAs (a stream kernel,
the tiles' order given by an SMEM table as the kernel's expert slots are), decode attention over a
streamed KV cache, top-k routing (the kernel's `topk_into`) and the vector work of a norm and a
gate (the kernel's `rmsnorm`, the gate's kernel expression). Each builder returns (function,
arguments, expected result): the caller times the function on a TPU and always checks its result
against the numpy expectation."""

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


def stream(ids: np.ndarray, tiles: np.ndarray, slots: int, interpret=None):
    """Tiles `tiles[ids[i]]` streamed in order through `slots` VMEM banks, `slots - 1` in flight
    ahead (the kernel's ring; its expert slots when `ids` are chosen experts). Result: the sum of
    each tile's first ROWS rows, in f32."""
    n, (tk, tn) = len(ids), tiles.shape[1:]

    def kernel(ids_ref, w_hbm, o_ref, ring, sem):
        def copy(i):
            slot = i % slots
            return pltpu.make_async_copy(w_hbm.at[ids_ref[i]], ring.at[slot], sem.at[slot])

        for i in range(min(slots - 1, n)):
            copy(i).start()

        def body(i, acc):
            @pl.when(i + slots - 1 < n)
            def _():
                copy(i + slots - 1).start()

            copy(i).wait()
            return acc + ring[i % slots, :ROWS, :].astype(F32)

        o_ref[...] = jax.lax.fori_loop(0, n, body, jnp.zeros((ROWS, tn), F32))

    fn = _call(
        kernel,
        jax.ShapeDtypeStruct((ROWS, tn), F32),
        [pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        [pltpu.VMEM((slots, tk, tn), tiles.dtype), pltpu.SemaphoreType.DMA((slots,))],
        interpret,
    )
    expected = tiles[ids, :ROWS, :].astype(np.float32).sum(0)
    return fn, (jnp.asarray(ids, jnp.int32), jnp.asarray(tiles)), expected


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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, tile: int, interpret=None):
    """One row's decode attention over a cache of len(k) tokens, K and V streamed in `tile`-token
    tiles (two buffers) with an online softmax, as mkdsl's attention walks its KV tiles."""
    s, d = k.shape
    n = s // tile

    def kernel(q_ref, k_hbm, v_hbm, o_ref, kb, vb, sem):
        def copies(i):
            b = i % 2
            return (
                pltpu.make_async_copy(k_hbm.at[pl.ds(i * tile, tile)], kb.at[b], sem.at[0, b]),
                pltpu.make_async_copy(v_hbm.at[pl.ds(i * tile, tile)], vb.at[b], sem.at[1, b]),
            )

        for c in copies(0):
            c.start()

        def body(i, carry):
            m, den, acc = carry

            @pl.when(i + 1 < n)
            def _():
                for c in copies(i + 1):
                    c.start()

            for c in copies(i):
                c.wait()
            sc = jnp.dot(q_ref[...], kb[i % 2].T, preferred_element_type=F32)  # [8, tile]
            m2 = jnp.maximum(m, sc.max(axis=1, keepdims=True))
            p = jnp.exp(sc - m2)
            scale = jnp.exp(m - m2)
            acc = acc * scale + jnp.dot(p, vb[i % 2], preferred_element_type=F32)
            return m2, den * scale + p.sum(axis=1, keepdims=True), acc

        init = (jnp.full((8, 1), -jnp.inf, F32), jnp.zeros((8, 1), F32), jnp.zeros((8, d), F32))
        m, den, acc = jax.lax.fori_loop(0, n, body, init)
        o_ref[...] = acc / den

    fn = _call(
        kernel,
        jax.ShapeDtypeStruct((8, d), F32),
        [pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        [pltpu.VMEM((2, tile, d), F32), pltpu.VMEM((2, tile, d), F32), pltpu.SemaphoreType.DMA((2, 2))],
        interpret,
    )
    qs = np.repeat(q[None], 8, 0)  # the row padded to a sublane tile, as the kernel pads rows
    sc = qs @ k.T
    p = np.exp(sc - sc.max(1, keepdims=True))
    expected = (p / p.sum(1, keepdims=True)) @ v
    return fn, (jnp.asarray(qs), jnp.asarray(k), jnp.asarray(v)), expected


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
