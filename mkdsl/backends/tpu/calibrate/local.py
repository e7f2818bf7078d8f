"""One-core microbenchmarks of `mkdsl calibrate`: the weight ring and the expert DMAs (one stream
kernel, the tiles' order given by an SMEM table as the kernel's ring and expert slots are), decode
attention over a streamed KV cache, top-k routing and the vector work of a norm and a gate. Each
builder returns (function, arguments, expected result): the caller times the function on a TPU and
always checks its result against the numpy expectation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
ROWS = 8  # rows each streamed tile contributes to the checked sum (all would be vector work, not DMA)


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
    """Top-k of each row of `scores` [8, E] in-kernel: k rounds of a row max and the lowest index
    reaching it, masked out after (the rank-free form of mkdsl's `route`)."""
    rows, e = scores.shape

    def kernel(s_ref, o_ref):
        s = s_ref[...]
        lanes = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        out = jnp.zeros((rows, 128), jnp.int32)
        col = jax.lax.broadcasted_iota(jnp.int32, (rows, 128), 1)
        for j in range(k):
            best = s.max(axis=1, keepdims=True)
            idx = jnp.where(s == best, lanes, e).min(axis=1, keepdims=True)
            out = jnp.where(col == j, idx, out)
            s = jnp.where(lanes == idx, -jnp.inf, s)
        o_ref[...] = out

    fn = _call(
        kernel, jax.ShapeDtypeStruct((rows, 128), jnp.int32), [pl.BlockSpec(memory_space=pltpu.VMEM)], [], interpret
    )
    expected = np.zeros((rows, 128), np.int32)
    expected[:, :k] = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return fn, (jnp.asarray(scores),), expected


def vector(x: np.ndarray, w: np.ndarray, g: np.ndarray, reps: int, interpret=None):
    """The vector work of a layer's small ops, `reps` times over: an RMSNorm of x by w, then a
    SiLU gate of g times it. Result: the last repetition's (all equal)."""
    eps = 1e-6

    def kernel(x_ref, w_ref, g_ref, o_ref):
        def body(_, acc):
            x = x_ref[...]
            n = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps) * w_ref[...]
            gg = g_ref[...]
            return acc * 0.0 + gg * jax.nn.sigmoid(gg) * n

        o_ref[...] = jax.lax.fori_loop(0, reps, body, jnp.zeros(x.shape, F32))

    spec = pl.BlockSpec(memory_space=pltpu.VMEM)
    fn = _call(kernel, jax.ShapeDtypeStruct(x.shape, F32), [spec, spec, spec], [], interpret)
    n = x / np.sqrt((x * x).mean(1, keepdims=True) + eps) * w
    expected = g / (1 + np.exp(-g)) * n
    return fn, (jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)), expected


@functools.cache
def tile_dtype(name: str):
    return {"bf16": jnp.bfloat16, "int8": jnp.int8, "f32": jnp.float32}[name]
