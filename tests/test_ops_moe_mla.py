"""Kimi K3's MLA (latent cache) and MoE ops against independent numpy oracles.

The oracles are float64 numpy with explicit loops over rows, heads, choices and tokens, written
from facts/kimi_k3.md and the ops' documented semantics; they never call jnp or an mkdsl helper.
MXFP4 is decoded from its bits (e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, sign bit 3, scale
2^(byte-127)); bf16 rounding is done on float64 significands. Inputs are random (seeds drawn by
Hypothesis) and never zero; every reference output is checked to be free of NaN.

Tolerances:

* exact: slice; the cache row mla_attention writes (and the rows it must not touch); route's
  ids; MXFP4 decoding, through `quant.dequantize` and through moe_experts with one-hot inputs,
  where every product is exact in f32;
* route's weights: 4·(k + 1)·2^-24 relative, 4x the worst case of an f32 sum of k positive
  terms and a division (or a reciprocal and a product), and so is the distance of their sum
  from 1 (observed: worst 0.08x);
* mla_attention and moe_experts round one intermediate to bf16 (the latent output o_lat, the
  SiTU output). The oracle rounds its exact value the same way. The reference rounds its own
  f32 value, which lies within a derived bound e of the exact one, so where [v - e, v + e]
  straddles a bf16 rounding boundary it may land on the neighbouring bf16 value: that gap is
  allowed, propagated through the next matmul. On top of it, the f32 bound
  (n + c)·2^-24·Σ|terms| (c <= 4 + k) for every n-term dot product, propagated through softmax (relative
  change <= 2.1·score error) and SiTU (|d/dg| <= 1 + beta/4, |d/du| <= 1, and 1e-5 relative
  for its f32 tanh/sigmoid, as tests/test_ops_oracle.py checks).
  These worst-case bounds are loose for generic values (a rounding gap is allowed for ~20%
  of the elements), so half the examples draw inputs `on_grid`: few significant bits, which
  makes the f32 dot products before the rounding exact (`f32_dot_error` proves it per case
  and then contributes zero), and inputs the op must round to bf16 jittered off the bf16 grid.
  There the gap is allowed for ~1-2% of the elements and the rest is f32-tight, so an omitted
  bf16 rounding, a wrong head or expert slice, or a wrong scale fails.
  The gap allowance is two-valued, not a margin: where the reference lands on the neighbouring
  bf16 value its error is that step through the next matmul, up to ~1.0x of the bound by
  construction. The rest of the bound is f32 arithmetic: observed worst 0.053x (mla_attention)
  and 0.029x (moe_experts) of it over a `ci` and a `dev` draw.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mkdsl.lang.block_attrs import op_block
from mkdsl.lang.dtypes import BF16, F32, I32, MXFP4
from mkdsl.lang.ir import BlockAttr, TensorType
from mkdsl.lang.quant import QTensor, dequantize
from mkdsl.ops import OPS, REQUIRED, Operand, OpError

U = 2.0**-24  # f32 unit roundoff
RHO = 1e-5  # relative error of XLA's f32 tanh/sigmoid chain (SiTU), as tests/test_ops_oracle.py checks
TINY = 1e-30
SEEDS = st.integers(0, 2**32 - 1)
FEW = settings(max_examples=8, deadline=None)
SOME = settings(max_examples=15, deadline=None)

ORACLES: dict[str, list[str]] = {}  # op name -> tests comparing it with an oracle
KNOWN_ATTRS = {  # the attributes the oracles below pass by name
    "slice": {"start", "size"},
    "compact": {"block", "keep"},
    "mla_attention": {"heads", "nope", "extra", "vdim", "scale"},
    "route": {"k"},
    "moe_experts": {"act", "weigh"},
}


def oracle_for(*ops: str):
    def mark(test):
        for op in ops:
            ORACLES.setdefault(op, []).append(test.__name__)
        return test

    return mark


# ---------------------------------------------------------------- number formats (numpy only)


def bf16(x) -> np.ndarray:
    """The nearest bf16 value (ties to even) of each float64: 8 significant bits."""
    m, e = np.frexp(np.asarray(x, np.float64))
    return np.ldexp(np.round(m * 256.0), e - 8)


def bf16_rounded(v, e):
    """(bf16(v), gap): the oracle's rounding of the exact v, and how far the reference's rounding
    of its own value, known to lie within e of v, may land from it. Rounding is monotone, so
    the gap is zero unless [v - e, v + e] straddles a rounding boundary."""
    r = bf16(v)
    return r, np.maximum(np.abs(bf16(v + e) - r), np.abs(bf16(v - e) - r))


def as_bf16(v) -> np.ndarray:
    """A bfloat16 array holding the bf16-representable float64 values `v` (exact)."""
    v = np.asarray(v, np.float64)
    assert np.array_equal(bf16(v), v)
    return v.astype(np.float32).astype(ml_dtypes.bfloat16)


def bits_f64(a) -> np.ndarray:
    """bf16 or f32 array -> float64, from the bits (bf16 is the upper half of an f32)."""
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64)


def _low_exponent(t) -> np.ndarray:
    """e such that t = odd integer·2^e, for nonzero float64 t."""
    m, e = np.frexp(np.abs(t))
    mi = (m * 2.0**53).astype(np.int64)
    return e - 53 + np.log2((mi & -mi).astype(np.float64)).astype(np.int64)


def f32_dot_error(x, w, x_err=None) -> np.ndarray:
    """Bound on |f32(x @ w) - x @ w| for x [n], w [n, m], when the f32 x may be off by x_err.
    Zero when x is exact and every product is a multiple of one power of two q, with
    Σ|x||w| < 2^24·q: then every product and partial sum is an f32 number, in any summation
    order. Otherwise the classic bound (n + 2)·u·Σ|x||w|, plus x_err·|w|."""
    ax, aw = np.abs(x), np.abs(w)
    if x_err is not None and np.any(x_err):
        return x_err @ aw + (len(x) + 2) * U * ((ax + x_err) @ aw)
    total = ax @ aw
    terms = x[:, None] * w
    terms = terms[terms != 0]
    if terms.size and total.max() < 2.0**24 * 2.0 ** _low_exponent(terms).min():
        return np.zeros_like(total)
    return (len(x) + 2) * U * total


def grid(rng, shape, bits: int, exp: int, jitter: bool = False) -> np.ndarray:
    """Nonzero m·2^exp with |m| < 2^bits, so that f32 sums of their products are exact (see
    f32_dot_error). With `jitter`, the f32 value is moved by less than a quarter of the bf16
    spacing: bf16 rounding gives the grid value back, so an omitted rounding shows."""
    v = np.ldexp((rng.integers(1, 2**bits, shape) * rng.choice([-1, 1], shape)).astype(np.float64), exp)
    if jitter:
        spacing = np.ldexp(1.0, np.frexp(v)[1] - 8)
        j = (v + rng.uniform(-0.24, 0.24, shape) * spacing).astype(np.float32).astype(np.float64)
        assert np.array_equal(bf16(j), v)
        v = j
    return v


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitude of code & 7; bit 3 is the sign


def mxfp4_value(code: int, byte: int) -> float:
    mag = E2M1[code & 7] * 2.0 ** (int(byte) - 127)
    return -mag if code & 8 else mag


def mxfp4_decode(codes, scales) -> np.ndarray:
    """uint32 [..., K/8, N] + E8M0 [..., K/32, N] -> float64 [..., K, N], element by element:
    input k is nibble k % 8 (low first) of word k // 8, scaled by block k // 32's byte."""
    *lead, k8, n = codes.shape
    out = np.empty((*lead, 8 * k8, n))
    for idx in np.ndindex(*lead):
        for k in range(8 * k8):
            for j in range(n):
                code = (int(codes[(*idx, k // 8, j)]) >> (4 * (k % 8))) & 0xF
                out[(*idx, k, j)] = mxfp4_value(code, scales[(*idx, k // 32, j)])
    return out


def mxfp4_pack(nib) -> np.ndarray:
    """int [..., K, N] codes -> uint32 [..., K/8, N]: code k goes to bits 4·(k % 8) of word k // 8."""
    *lead, k, n = nib.shape
    words = np.zeros((*lead, k // 8, n), np.uint64)
    for i in range(k):
        words[..., i // 8, :] |= nib[..., i, :].astype(np.uint64) << np.uint64(4 * (i % 8))
    return words.astype(np.uint32)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def situ(g, u, beta, lb):
    return beta * np.tanh(g / beta) * sigmoid(g) * lb * np.tanh(u / lb)


# ---------------------------------------------------------------- running references


@functools.cache
def _jitted(name: str, attrs: tuple, layout: tuple):
    """The reference under jit; quantised operands travel as (codes, scales) leaves."""
    ref, kw = OPS[name].reference, dict(attrs)

    def call(*leaves):
        it = iter(leaves)
        args = [QTensor(next(it), next(it), *fmt) if fmt else next(it) for fmt in layout]
        return ref(*args, **kw)

    return jax.jit(call)


def run(name: str, *args, **attrs) -> list[np.ndarray]:
    """OPS[name].reference under jit with the registry's defaults for attributes not given."""
    attrs = {k: v for k, v in OPS[name].attrs.items() if v is not REQUIRED} | attrs
    layout = tuple((a.fmt, a.group) if isinstance(a, QTensor) else None for a in args)
    leaves = [x for a in args for x in ((a.codes, a.scales) if isinstance(a, QTensor) else (a,))]
    outs = [np.asarray(o) for o in _jitted(name, tuple(sorted(attrs.items())), layout)(*leaves)]
    assert len(outs) == OPS[name].outputs + len(OPS[name].inout), name
    for o in outs:
        assert not np.isnan(o.astype(np.float64)).any(), f"{name} produced NaN"
    return outs


def close(got, want, atol, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want)
    bound = np.broadcast_to(atol, err.shape)
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    assert not (err > bound).any(), (
        f"{what}: {(err > bound).sum()} of {err.size} outside tolerance; worst at "
        f"{i}: got {got[i]!r}, want {want[i]!r}, bound {bound[i]:.3g}"
    )


def exact(got, want, what=""):
    got = np.asarray(got)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    assert np.array_equal(bits_f64(got), np.asarray(want, np.float64)), what


def nonzero_normal(rng, shape, scale=1.0) -> np.ndarray:
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    assert np.all(x != 0)
    return x


# ---------------------------------------------------------------- slice


@oracle_for("slice")
@SOME
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3, 8]),
    n=st.sampled_from([1, 7, 64]),
    frac=st.floats(0, 1),
    sfrac=st.floats(0, 1),
    dt=st.sampled_from(["f32", "bf16"]),
)
def test_slice(seed, b, n, frac, sfrac, dt):
    rng = np.random.default_rng(seed)
    start = int(frac * (n - 1))
    size = 1 + int(sfrac * (n - start - 1))
    xv = nonzero_normal(rng, (b, n)).astype(np.float64)
    x = as_bf16(bf16(xv)) if dt == "bf16" else xv.astype(np.float32)
    (out,) = run("slice", x, start=start, size=size)
    assert out.dtype == np.float32
    want = np.array([[bits_f64(x)[r, start + j] for j in range(size)] for r in range(b)])
    exact(out, want, f"slice start={start} size={size} of {n}")


@oracle_for("compact")
@SOME
@given(
    seed=SEEDS,
    b=st.integers(1, 8),
    blocks=st.integers(1, 6),
    block=st.sampled_from([1, 3, 128, 256]),
    kfrac=st.floats(0, 1),
    dt=st.sampled_from(["f32", "bf16"]),
)
def test_compact(seed, b, blocks, block, kfrac, dt):
    """Column j of block i of the output is column i·block + j of the input, for j < keep."""
    rng = np.random.default_rng(seed)
    keep = 1 + int(kfrac * (block - 1))
    xv = nonzero_normal(rng, (b, blocks * block)).astype(np.float64)
    x = as_bf16(bf16(xv)) if dt == "bf16" else xv.astype(np.float32)
    (out,) = run("compact", x, block=block, keep=keep)
    assert out.dtype == np.float32
    want = np.array([[bits_f64(x)[r, i * block + j] for i in range(blocks) for j in range(keep)] for r in range(b)])
    exact(out, want, f"compact block={block} keep={keep} of {blocks} blocks")


# ---------------------------------------------------------------- MLA


def mla_head_bf16_cache(q_nope, q_ext, w_uk, w_uv, lat, ext, scale):
    """One head against a bf16 cache, in the reference's contract (docs/architecture.md, "Attention
    numerics"): q_lat = q_nope·W_UKᵀ in f32, then q_lat, q_extra and e_t = exp(s_t - max) rounded
    to bf16 for the two cache products, o_lat = Σ bf16(e_t)·c_t / Σ e_t, y = bf16(o_lat)·W_UV. A
    value the reference computes in f32 and then rounds may round the other way when it lies
    within its f32 error of a rounding boundary (`bf16_rounded`'s gap); the bound carries each gap
    forward. Returns (y, atol)."""
    q_lat = w_uk @ q_nope
    ql_b, ql_gap = bf16_rounded(q_lat, f32_dot_error(q_nope, w_uk.T))
    qe_b = bf16(q_ext)
    s = (lat @ ql_b + ext @ qe_b) * scale
    # the reference's scores: its two f32 dots, the q_lat roundings that may differ, the sum and scale
    e_s = scale * (np.abs(lat) @ ql_gap + f32_dot_error(ql_b, lat.T) + f32_dot_error(qe_b, ext.T)) + 3 * U * np.abs(s)
    eps = 2 * e_s.max() + U * (np.abs(s).max() + s.max() - s.min())  # of s - max
    e = np.exp(s - s.max())
    rel = 1.01 * eps + 4 * U  # of each f32 e_t (XLA's exp within ~2 ulp)
    e_b, e_gap = bf16_rounded(e, rel * e)
    den = e.sum()
    o_lat = e_b @ lat / den
    num_err = e_gap @ np.abs(lat) + f32_dot_error(e_b, lat)
    e_o = num_err / den + np.abs(o_lat) * (1.01 * rel + (len(e) + 4) * U) + TINY
    o_b, gap = bf16_rounded(o_lat, e_o)
    return o_b @ w_uv, gap @ np.abs(w_uv) + (len(o_b) + 4) * U * ((np.abs(o_b) + gap) @ np.abs(w_uv)) + TINY


def mla_oracle(q, c_kv, k_extra, w, cache, positions, heads, nope, extra, vdim, scale, store, bf16_cache=False):
    """One decode step of MLA in the expanded form (float64): write store([c_kv | k_extra]) at
    each row's position; per head h the keys are [c_t·W_UK_h | e_t] and the values c_t·W_UV_h,
    formed explicitly for every token t <= position; scores bf16(q_nope)·k_nope_t + q_extra·e_t
    (times scale), softmax, P·V. The latent design rounds o_lat = Σ p_t·c_t to bf16 before
    W_UV: `want` adds that one rounding to the expanded result, (bf16(o_lat) - o_lat)·W_UV.
    A bf16 cache rounds the operands of its products too: `mla_head_bf16_cache`.
    Returns (want, new cache, atol)."""
    b, r = c_kv.shape
    cache = cache.copy()
    want, atol = np.empty((b, heads * vdim)), np.empty((b, heads * vdim))
    for row in range(b):
        p = int(positions[row])
        cache[row, p] = store(np.concatenate([c_kv[row], k_extra[row]]))
        lat, ext = cache[row, : p + 1, :r], cache[row, : p + 1, r:]
        for h in range(heads):
            base = h * (nope + vdim)
            w_uk, w_uv = w[:, base : base + nope], w[:, base + nope : base + nope + vdim]
            qh = q[row, h * (nope + extra) : (h + 1) * (nope + extra)]
            q_nope, q_ext = bf16(qh[:nope]), qh[nope:]
            cols = slice(h * vdim, (h + 1) * vdim)
            if bf16_cache:
                want[row, cols], atol[row, cols] = mla_head_bf16_cache(q_nope, q_ext, w_uk, w_uv, lat, ext, scale)
                continue
            keys = np.array([lat[t] @ w_uk for t in range(p + 1)])  # [t, nope]
            values = np.array([lat[t] @ w_uv for t in range(p + 1)])  # [t, vdim]
            s = np.array([(keys[t] @ q_nope + ext[t] @ q_ext) * scale for t in range(p + 1)])
            e = np.exp(s - s.max())
            prob = e / e.sum()
            y = sum(prob[t] * values[t] for t in range(p + 1))
            o_lat = sum(prob[t] * lat[t] for t in range(p + 1))
            # f32 error of the reference's scores: q_lat = q_nope·W_UKᵀ, q_lat·c_t + q_extra·e_t, ·scale, - max
            q_lat = w_uk @ q_nope
            e_lat = f32_dot_error(q_lat, lat.T, f32_dot_error(q_nope, w_uk.T))
            e_dots = e_lat + f32_dot_error(q_ext, ext.T) + U * np.abs(s) / scale  # the two einsums and their sum
            eps = (scale * e_dots).max() + U * (np.abs(s).max() + s.max() - s.min())
            abs_o = sum(prob[t] * np.abs(lat[t]) for t in range(p + 1))
            e_o = (2.1 * eps + (2 * p + 24) * U) * abs_o
            o_b, gap = bf16_rounded(o_lat, e_o)
            want[row, cols] = y + (o_b - o_lat) @ w_uv
            atol[row, cols] = gap @ np.abs(w_uv) + (r + 4) * U * ((np.abs(o_b) + gap) @ np.abs(w_uv)) + TINY
    return want, cache, atol


@oracle_for("mla_attention")
@settings(max_examples=12, deadline=None)
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3]),
    heads=st.sampled_from([1, 3]),
    defaults=st.booleans(),
    s=st.sampled_from([4, 9]),
    cache_dt=st.sampled_from(["bf16", "f32"]),
    wdt=st.sampled_from(["bf16", "f32"]),
    scale=st.sampled_from([None, 0.3]),
    qscale=st.sampled_from([0.5, 3.0]),
    on_grid=st.booleans(),
)
def test_mla_attention_matches_expanded_form_over_decode_steps(
    seed, b, heads, defaults, s, cache_dt, wdt, scale, qscale, on_grid
):
    """Three decode steps; each row starts at its own position and the cache grows by one
    token per step. The cache starts full of other tokens' entries: everything after each
    row's position must be masked, and only the row's own slot written. `on_grid`: inputs
    with few significant bits (q jittered off the bf16 grid) make the scores' f32 sums exact,
    so the softmax and o_lat are f32-accurate and the bf16 rounding of o_lat is pinned down."""
    rng = np.random.default_rng(seed)
    bf16_cache = cache_dt == "bf16"

    def draw(shape, scale_, bits=4, exp=-3, jitter=False):
        if on_grid:
            return grid(rng, shape, bits, exp, jitter)
        return nonzero_normal(rng, shape, scale_).astype(np.float64)

    steps = 3
    nope, extra, vdim, r = (128, 64, 128, 32) if defaults else (8, 4, 8, 16)
    attrs = {"heads": heads} | ({} if defaults else {"nope": nope, "extra": extra, "vdim": vdim})
    attrs |= {} if scale is None else {"scale": scale}
    store = bf16 if cache_dt == "bf16" else (lambda v: v.astype(np.float32).astype(np.float64))
    make = as_bf16 if cache_dt == "bf16" else (lambda v: v.astype(np.float32))
    wv = draw((r, heads * (nope + vdim)), r**-0.5, bits=3)
    w = as_bf16(bf16(wv)) if wdt == "bf16" else wv.astype(np.float32)
    wv = bits_f64(w)
    cache_v = store(draw((b, s, r + extra), 1.0))
    cache = make(cache_v)
    start = rng.integers(0, s - steps + 1, b)
    if b > 1:
        start[0] = 0  # a fresh sequence: softmax over one token
    for step in range(steps):
        positions = (start + step).astype(np.int32)
        q = draw((b, heads * (nope + extra)), qscale, exp=-4 if qscale < 1 else -2, jitter=True).astype(np.float32)
        c_kv = draw((b, r), 1.0, jitter=bf16_cache).astype(np.float32)
        k_extra = draw((b, extra), 1.0, jitter=bf16_cache).astype(np.float32)
        out, new_cache = run("mla_attention", q, c_kv, k_extra, w, cache, positions, **attrs)
        want, cache_v, atol = mla_oracle(
            q.astype(np.float64),
            c_kv.astype(np.float64),
            k_extra.astype(np.float64),
            wv,
            cache_v,
            positions,
            heads,
            nope,
            extra,
            vdim,
            (nope + extra) ** -0.5 if scale is None else scale,
            store,
            bf16_cache,
        )
        assert out.dtype == np.float32 and new_cache.dtype == cache.dtype
        exact(new_cache, cache_v, f"step {step}: latent cache (row written at each position, nothing else)")
        close(out, want, atol, f"step {step}: mla_attention {attrs}")
        cache = new_cache


# ---------------------------------------------------------------- routing


def route_oracle(scores, bias, k):
    """ids: top k of f32(scores + bias), descending, ties to the lower index; weights: the
    chosen unbiased scores over their sum."""
    b, e = scores.shape
    sel = (scores.astype(np.float32) + bias.astype(np.float32)).astype(np.float64)  # the f32 sum
    ids = np.array([sorted(range(e), key=lambda i: (-sel[r, i], i))[:k] for r in range(b)])
    chosen = np.array([[float(scores[r, i]) for i in ids[r]] for r in range(b)])
    return chosen / chosen.sum(axis=1, keepdims=True), ids


def check_route(scores, bias, k):
    weights, ids = run("route", scores, bias, k=k)
    assert weights.dtype == np.float32 and ids.dtype == np.int32
    want_w, want_ids = route_oracle(scores, bits_f64(bias), k)
    exact(ids, want_ids, "route ids")
    rel = 4 * (k + 1) * U  # 4x the worst case: k - 1 adds and a division (or 1/sum and a product)
    close(weights, want_w, rel * want_w, "route weights")
    close(weights.astype(np.float64).sum(axis=1), np.ones(len(ids)), rel, "route weights sum to 1")
    return weights, ids


@oracle_for("route")
@SOME
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3, 8]),
    e=st.sampled_from([4, 16, 40]),
    kfrac=st.floats(0, 1),
    bdt=st.sampled_from(["f32", "bf16"]),
)
def test_route_bias_steers_selection_but_not_weights(seed, b, e, kfrac, bdt):
    """A large bias on k experts outside the unbiased top k of some row selects exactly those
    experts; their weights still come from the unbiased scores and sum to one."""
    rng = np.random.default_rng(seed)
    k = 1 + int(kfrac * (e // 2 - 1))
    scores = sigmoid(rng.standard_normal((b, e)) * 2).astype(np.float32)
    bottom = np.argsort(-scores[0].astype(np.float64), kind="stable")[k:]  # not in row 0's unbiased top k
    favoured = rng.choice(bottom, k, replace=False)
    bias = rng.standard_normal(e) * 0.01
    bias[favoured] += 2.0  # more than any difference of two scores
    bias = as_bf16(bf16(bias)) if bdt == "bf16" else bias.astype(np.float32)
    weights, ids = check_route(scores, bias, k)
    for r in range(b):
        assert set(ids[r]) == set(favoured.tolist()), "the bias decides the selection"
        biased = bits_f64(bias)[ids[r]] + scores[r, ids[r]]
        chosen = scores[r, ids[r]].astype(np.float64)
        # the two candidate answers differ 25x beyond the tolerance, so the check above tells them apart
        assert k == 1 or np.abs(biased / biased.sum() - chosen / chosen.sum()).max() > 100 * (k + 1) * U
    unbiased = route_oracle(scores, np.zeros(e), k)[1]
    assert set(unbiased[0]) != set(ids[0]), "without the bias row 0 would choose differently"


@oracle_for("route")
@SOME
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3, 8]),
    e=st.sampled_from([1, 5, 33]),
    kfrac=st.floats(0, 1),
    ties=st.booleans(),
    bdt=st.sampled_from(["f32", "bf16"]),
)
def test_route_random_and_tied(seed, b, e, kfrac, ties, bdt):
    rng = np.random.default_rng(seed)
    k = 1 + int(kfrac * (e - 1))
    if ties:  # a coarse grid: many equal scores + bias, whose ties go to the lower index
        scores = rng.integers(1, 8, (b, e)).astype(np.float32) / 8
        bias = rng.integers(-2, 3, e) / 4
    else:
        scores = sigmoid(rng.standard_normal((b, e))).astype(np.float32)
        bias = rng.standard_normal(e) * 0.1
    bias = as_bf16(bf16(bias)) if bdt == "bf16" else bias.astype(np.float32)
    check_route(scores, bias, k)


# ---------------------------------------------------------------- MXFP4 decoding


def test_mxfp4_dequantize_all_codes_over_the_normal_scale_range():
    """Stacked [2, 32, 125]: expert e, column j holds the 16 codes twice under scale byte
    2 + 125·e + j (bytes 2..251, under which every value is a normal f32); exact."""
    bytes_ = np.arange(2, 252)
    e, n = 2, 125
    nib = np.broadcast_to((np.arange(32) % 16)[None, :, None], (e, 32, n))
    codes = mxfp4_pack(nib)
    scales = bytes_.reshape(e, 1, n).astype(np.uint8)
    got = np.asarray(jax.jit(lambda c, s: dequantize(QTensor(c, s, "mxfp4", 32)))(codes, scales))
    want = mxfp4_decode(codes, scales)
    exact(got, want, "mxfp4 dequantize")
    assert np.array_equal(np.signbit(got), np.signbit(want)), "sign of zero"
    assert {float(v) for v in want[0, :16, 0] * 2.0**125} == set(E2M1) | {-v for v in E2M1}, "all codes seen"


@FEW
@given(seed=SEEDS, e=st.sampled_from([1, 3]), k=st.sampled_from([32, 64]), n=st.sampled_from([1, 5]))
def test_mxfp4_dequantize_random_stacked(seed, e, k, n):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**32, (e, k // 8, n), dtype=np.uint32)
    scales = rng.integers(2, 253, (e, k // 32, n), dtype=np.uint8)
    got = np.asarray(jax.jit(lambda c, s: dequantize(QTensor(c, s, "mxfp4", 32)))(codes, scales))
    exact(got, mxfp4_decode(codes, scales), "stacked mxfp4 dequantize")


@oracle_for("moe_experts")
@FEW
@given(seed=SEEDS, experts=st.sampled_from([2, 5]), f=st.sampled_from([32, 64]), b=st.sampled_from([1, 4]))
def test_moe_experts_decodes_mxfp4_exactly(seed, experts, f, b):
    """One-hot z and k = 1 make the expert's SiTU output one-hot at column f0 (W1 and W3 are
    ±0 elsewhere, under random scales; situ(0, u) = 0). Then r = v·W2[f0, :] with v a bf16
    value and W2 an e2m1 value times a power of two: every product is exact in f32, so the
    output is v times the bit-decoded W2 row, exactly. Row f0 holds all 16 codes under scale
    bytes spread over 20..230; column d_ref holds exactly 1.0 and reads v off."""
    rng = np.random.default_rng(seed)
    d = 32
    codes1, codes3 = rng.choice([0, 8], (2, experts, d, f))  # ±0
    codes2 = rng.integers(0, 16, (experts, f, d))
    f0 = rng.integers(0, f, experts)
    ref_col = rng.integers(0, d, experts)
    scales2 = rng.integers(2, 253, (experts, f // 32, d)).astype(np.uint8)
    for x in range(experts):
        codes1[x, :, f0[x]] = rng.integers(1, 8, d)  # g > 0, so that v is not tiny
        codes3[x, :, f0[x]] = rng.choice([c for c in range(16) if c & 7], d)  # u != 0
        row = rng.permutation(np.tile(np.arange(16), d // 16))
        j = int(np.flatnonzero(row == 2)[0])
        row[[j, ref_col[x]]] = row[[ref_col[x], j]]
        codes2[x, f0[x]] = row  # code 2 (= 1.0) at the reference column
        scales2[x, f0[x] // 32] = rng.integers(20, 231, d)
        scales2[x, f0[x] // 32, ref_col[x]] = 127
    w1 = QTensor(mxfp4_pack(codes1), rng.integers(124, 131, (experts, 1, f)).astype(np.uint8), "mxfp4", 32)
    w3 = QTensor(mxfp4_pack(codes3), rng.integers(124, 131, (experts, 1, f)).astype(np.uint8), "mxfp4", 32)
    w2 = QTensor(mxfp4_pack(codes2), scales2, "mxfp4", 32)
    w1v, w3v, w2v = (mxfp4_decode(w.codes, w.scales) for w in (w1, w3, w2))
    ids = rng.integers(0, experts, (b, 1)).astype(np.int32)
    dims = rng.integers(0, d, b)
    z = np.zeros((b, d), np.float32)
    z[np.arange(b), dims] = 1.0
    (out,) = run("moe_experts", z, np.ones((b, 1), np.float32), ids, w1, w3, w2, act=situ_act(b, f))
    for r in range(b):
        x = ids[r, 0]
        v = float(out[r, ref_col[x]])
        g, u = w1v[x, dims[r], f0[x]], w3v[x, dims[r], f0[x]]
        # v is bf16 of the f32 SiTU: half a bf16 step (<= 2^-8·|v|) from a value within RHO of it
        assert v != 0 and bf16(v) == v and abs(v - situ(g, u, 4.0, 25.0)) <= (2.0**-8 + 2 * RHO) * abs(v), (v, g, u)
        exact(out[r], v * w2v[x, f0[x]], f"moe_experts row {r}: expert {x}'s W2 row {f0[x]} decoded exactly")


# ---------------------------------------------------------------- experts


def situ_act(b, f, **attrs) -> BlockAttr:
    """The activation block `act=situ` (with these attributes) on [b, f] gate and up results."""
    t = TensorType(F32, (b, f))
    return BlockAttr(op_block("situ", (t, t), **attrs))


def moe_oracle(z, weights, ids, w1, w3, w2, beta, lb):
    """r_b = Σ_i weights[b, i]·bf16(situ(bf16(z_b)·W1_e, bf16(z_b)·W3_e))·W2_e, e = ids[b, i].
    Returns (want, atol); the bf16 rounding of the SiTU output follows `bf16_rounded`."""
    b, k = ids.shape
    d, f = w1.shape[1:]
    want, atol = np.zeros((b, d)), np.zeros((b, d))
    for row in range(b):
        zb = bf16(z[row])
        for i in range(k):
            e = ids[row, i]
            g, u = zb @ w1[e], zb @ w3[e]
            eg, eu = f32_dot_error(zb, w1[e]), f32_dot_error(zb, w3[e])
            h = situ(g, u, beta, lb)
            sens = (1 + beta / 4) * eg * np.abs(u) + (np.abs(g) + eg) * eu
            h_b, gap = bf16_rounded(h, sens + RHO * (np.abs(h) + sens) + TINY)
            wi = weights[row, i]
            want[row] += wi * (h_b @ w2[e])
            atol[row] += abs(wi) * (gap @ np.abs(w2[e]) + (f + k + 4) * U * ((np.abs(h_b) + gap) @ np.abs(w2[e])))
    return want, atol + TINY


@oracle_for("moe_experts")
@settings(max_examples=12, deadline=None)
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3]),
    experts=st.sampled_from([2, 5]),
    k=st.sampled_from([1, 2]),
    d=st.sampled_from([32, 64]),
    f=st.sampled_from([32, 64]),
    fmt=st.sampled_from(["mxfp4", "bf16"]),
    zscale=st.sampled_from([0.1, 1.0, 4.0]),
    byte=st.sampled_from([120, 123, 126]),
    betas=st.sampled_from([None, (1.0, 2.0)]),
    on_grid=st.booleans(),
)
def test_moe_experts(seed, b, experts, k, d, f, fmt, zscale, byte, betas, on_grid):
    """`on_grid`: z has 8 significant bits (jittered off the bf16 grid, so its rounding is
    checked) and the weights few, so the f32 sums z·W1 and z·W3 are exact and the bf16
    rounding of the SiTU output is pinned down."""
    rng = np.random.default_rng(seed)
    if on_grid:
        z = grid(rng, (b, d), 8, {0.1: -10, 1.0: -7, 4.0: -5}[zscale], jitter=True).astype(np.float32)
    else:
        z = nonzero_normal(rng, (b, d), zscale)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(b)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (b, k))
    weights = (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
    mats = []
    for shape in ((experts, d, f), (experts, d, f), (experts, f, d)):
        if fmt == "mxfp4":  # all codes; scales around 2^(byte-127)
            w = QTensor(
                rng.integers(0, 2**32, (shape[0], shape[1] // 8, shape[2]), dtype=np.uint32),
                rng.integers(byte - 2, byte + 3, (shape[0], shape[1] // 32, shape[2])).astype(np.uint8),
                "mxfp4",
                32,
            )
            mats.append((w, mxfp4_decode(w.codes, w.scales)))
        else:
            wv = grid(rng, shape, 4, -5) if on_grid else nonzero_normal(rng, shape, shape[1] ** -0.5)
            w = as_bf16(bf16(wv))
            mats.append((w, bits_f64(w)))
    (w1, w1v), (w3, w3v), (w2, w2v) = mats
    attrs = {} if betas is None else {"beta": betas[0], "linear_beta": betas[1]}
    (out,) = run("moe_experts", z, weights, ids, w1, w3, w2, act=situ_act(b, f, **attrs))
    assert out.dtype == np.float32 and out.shape == (b, d)
    beta, lb = betas or (4.0, 25.0)  # the documented defaults
    want, atol = moe_oracle(z.astype(np.float64), weights.astype(np.float64), ids, w1v, w3v, w2v, beta, lb)
    close(out, want, atol, f"moe_experts {fmt} E={experts} k={k} D={d} F={f} {attrs}")


def moe_input_oracle(z, weights, ids, w1, w3, w2):
    """Llama 4 (transformers Llama4TextMoe): the chosen expert runs on its input scaled by the
    router score, x = s·bf16(z) (routed_in = h * score), and the outputs are summed unweighted:
    r_b = Σ_i bf16(silu(x·W1_e)·(x·W3_e))·W2_e with x = weights[b, i]·bf16(z_b). The reference's
    f32 products may be off by f32_dot_error(bf16(z), W)·s plus one rounding of the scaling."""
    b, k = ids.shape
    d, f = w1.shape[1:]
    want, atol = np.zeros((b, d)), np.zeros((b, d))
    for row in range(b):
        for i in range(k):
            e, sc = ids[row, i], weights[row, i]
            x = sc * bf16(z[row])
            g, u = x @ w1[e], x @ w3[e]
            eg = abs(sc) * f32_dot_error(bf16(z[row]), w1[e]) + 2 * U * np.abs(g)
            eu = abs(sc) * f32_dot_error(bf16(z[row]), w3[e]) + 2 * U * np.abs(u)
            silu = g / (1 + np.exp(-g))
            h = silu * u
            sens = 1.1 * eg * np.abs(u) + (np.abs(silu) + 1.1 * eg) * eu  # |silu'| <= 1.1
            h_b, gap = bf16_rounded(h, sens + RHO * (np.abs(h) + sens) + TINY)
            want[row] += h_b @ w2[e]
            atol[row] += gap @ np.abs(w2[e]) + (f + k + 4) * U * ((np.abs(h_b) + gap) @ np.abs(w2[e]))
    return want, atol + TINY


@oracle_for("moe_experts")
@settings(max_examples=8, deadline=None)
@given(seed=SEEDS, b=st.sampled_from([1, 3]), k=st.sampled_from([1, 2]), zscale=st.sampled_from([0.1, 1.0, 4.0]))
def test_moe_experts_weighted_on_the_input(seed, b, k, zscale):
    """weigh="input" against the published Llama 4 form; the output-weighted sum of the same
    call differs (silu is not linear), so the attribute is not ignored."""
    rng = np.random.default_rng(seed)
    experts, d, f = 4, 32, 64
    z = nonzero_normal(rng, (b, d), zscale)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(b)]).astype(np.int32)
    weights = rng.uniform(0.05, 1.0, (b, k)).astype(np.float32)  # sigmoid scores: not normalised
    mats = [as_bf16(bf16(nonzero_normal(rng, shape, shape[1] ** -0.5))) for shape in ((experts, d, f),) * 2]
    mats.append(as_bf16(bf16(nonzero_normal(rng, (experts, f, d), f**-0.5))))
    act = BlockAttr(op_block("swiglu", (TensorType(F32, (b, f)),) * 2))
    (out,) = run("moe_experts", z, weights, ids, *mats, act=act, weigh="input")
    want, atol = moe_input_oracle(z.astype(np.float64), weights.astype(np.float64), ids, *map(bits_f64, mats))
    close(out, want, atol, f"moe_experts weigh=input k={k}")
    (other,) = run("moe_experts", z, weights, ids, *mats, act=act)
    assert np.abs(other - want).max() > 10 * atol.max()


# ---------------------------------------------------------------- shape rules and costs


def val(*shape, dtype=F32, name="x"):
    return Operand(TensorType(dtype, tuple(shape)), "value", name)


def weight(*shape, dtype=BF16, name="w"):
    return Operand(TensorType(dtype, tuple(shape)), "tensor", name)


def state(*shape, dtype=BF16, name="cache"):
    return Operand(TensorType(dtype, tuple(shape)), "tensor", name, is_state=True)


MLA = {"heads": 3, "nope": 8, "extra": 4, "vdim": 6, "scale": None}
MLA_ARGS = (val("B", 36), val("B", 16), val("B", 4), weight(16, 42), state("B", "S", 20), val("B", dtype=I32))
MOE_ARGS = (
    val("B", 64),
    val("B", 2),
    val("B", 2, dtype=I32),
    weight(5, 64, 32, dtype=MXFP4),
    weight(5, 64, 32, dtype=MXFP4),
    weight(5, 32, 64, dtype=MXFP4),
)


def test_shape_rules_accept_kimi_shapes():
    assert OPS["slice"].infer([val("B", 576)], {"start": 512, "size": 64}) == (TensorType(F32, ("B", 64)),)
    assert OPS["mla_attention"].infer(list(MLA_ARGS), MLA) == (TensorType(F32, ("B", 18)),)
    k3 = [
        val("B", 96 * 192),
        val("B", 512),
        val("B", 64),
        weight(512, 96 * 256),
        state("B", "S", 576),
        val("B", dtype=I32),
    ]
    assert OPS["mla_attention"].infer(k3, {**MLA, "heads": 96, "nope": 128, "extra": 64, "vdim": 128}) == (
        TensorType(F32, ("B", 96 * 128)),
    )
    assert OPS["route"].infer([val("B", 896), weight(896, dtype=F32)], {"k": 16}) == (
        TensorType(F32, ("B", 16)),
        TensorType(I32, ("B", 16)),
    )
    assert OPS["moe_experts"].infer(list(MOE_ARGS), {}) == (TensorType(F32, ("B", 64)),)
    bf = [*MOE_ARGS[:3], weight(5, 64, 32), weight(5, 64, 32), weight(5, 32, 64)]
    assert OPS["moe_experts"].infer(bf, {}) == (TensorType(F32, ("B", 64)),)


def _with(args, i, new):
    return [new if j == i else a for j, a in enumerate(args)]


@pytest.mark.parametrize(
    "op,args,attrs,arg,message",
    [
        ("slice", [val("B", 10)], {"start": 8, "size": 3}, "size", "out of range"),
        ("slice", [val("B", 10)], {"start": -1, "size": 3}, "start", "non-negative"),
        ("slice", [val("B", 10, 2)], {"start": 0, "size": 3}, 0, "rank 2"),
        ("mla_attention", _with(MLA_ARGS, 0, val("B", 35)), MLA, 0, "columns"),
        ("mla_attention", _with(MLA_ARGS, 2, val("B", 5)), MLA, 2, "columns"),
        ("mla_attention", _with(MLA_ARGS, 3, weight(16, 36)), MLA, 3, "expected [16, 42]"),
        ("mla_attention", _with(MLA_ARGS, 3, val(16, 42)), MLA, 3, "declared weight"),
        ("mla_attention", _with(MLA_ARGS, 4, state("B", "S", 21)), MLA, 4, "R + extra"),
        ("mla_attention", _with(MLA_ARGS, 4, weight("B", "S", 20)), MLA, 4, "state tensor"),
        ("mla_attention", _with(MLA_ARGS, 5, val("B", dtype=F32)), MLA, 5, "i32"),
        ("mla_attention", MLA_ARGS, {**MLA, "heads": 0}, "heads", "positive"),
        ("route", [val("B", 8), weight(7, dtype=F32)], {"k": 2}, 1, "8 experts"),
        ("route", [val("B", 8), val(8)], {"k": 2}, 1, "declared weight"),
        ("route", [val("B", 8), weight(8, dtype=I32)], {"k": 2}, 1, "dtype"),
        ("route", [val("B", 8), weight(8, dtype=F32)], {"k": 9}, "k", "1..8"),
        ("moe_experts", _with(MOE_ARGS, 3, weight(64, 32, dtype=MXFP4)), {}, 3, "rank 3"),
        (
            "moe_experts",
            _with(MOE_ARGS, 3, weight(5, 64, 32, dtype=F32)),
            {},
            3,
            "dtype",
        ),  # int4/int8 experts are valid
        ("moe_experts", _with(MOE_ARGS, 0, val("B", 32)), {}, 3, "64 inputs"),
        ("moe_experts", _with(MOE_ARGS, 4, weight(5, 64, 64, dtype=MXFP4)), {}, 4, "w3"),
        ("moe_experts", _with(MOE_ARGS, 5, weight(5, 64, 32, dtype=MXFP4)), {}, 5, "expected [5, 32, 64]"),
        ("moe_experts", _with(MOE_ARGS, 2, val("B", 2)), {}, 2, "i32"),
        ("moe_experts", _with(MOE_ARGS, 2, val("B", 3, dtype=I32)), {}, 2, "expert ids"),
        ("moe_experts", _with(MOE_ARGS, 5, state(5, 32, 64)), {}, 5, "declared weight"),
        ("linear", [val("B", 64), weight(5, 64, 32)], {}, 1, "rank 2"),  # experts are not a linear weight
    ],
)
def test_shape_rules_reject_bad_operands(op, args, attrs, arg, message):
    with pytest.raises(OpError) as err:
        OPS[op].infer(args, attrs)
    assert err.value.arg == arg and message in str(err.value), (err.value.arg, str(err.value))


def test_costs():
    t = lambda *s, dt=F32: TensorType(dt, s)  # noqa: E731
    b, s, r, extra, heads, nope, vdim = 2, 10, 16, 4, 3, 8, 6
    ins = [
        t(b, heads * (nope + extra)),
        t(b, r),
        t(b, extra),
        t(r, heads * (nope + vdim), dt=BF16),
        t(b, s, r + extra, dt=BF16),
        t(b, dt=I32),
    ]
    c = OPS["mla_attention"].cost(ins, [t(b, heads * vdim)], MLA)
    assert c.state_bytes == b * s * (r + extra) * 2 + b * (r + extra) * 2  # tokens read + the row written
    assert c.weight_bytes == r * heads * (nope + vdim) * 2
    assert c.flops == 2 * b * heads * (nope * r + s * (r + extra) + s * r + r * vdim)
    assert OPS["slice"].cost([t(b, 20)], [t(b, 4)], {"start": 0, "size": 4}).weight_bytes == 0
    assert OPS["route"].cost([t(b, 8), t(8, dt=BF16)], [t(b, 2), t(b, 2, dt=I32)], {"k": 2}).weight_bytes == 16
    # mxfp4 expert [64, 32]: 8·32 uint32 codes + 2·32 scale bytes = 1088 bytes; [32, 64]: 4·64·4 + 64
    per_expert = 2 * (8 * 32 * 4 + 2 * 32) + (4 * 64 * 4 + 64)
    for rows, k, experts in ((1, 2, 5), (2, 2, 5), (4, 2, 5), (8, 4, 5)):
        ins = [
            t(rows, 64),
            t(rows, k),
            t(rows, k, dt=I32),
            t(experts, 64, 32, dt=MXFP4),
            t(experts, 64, 32, dt=MXFP4),
            t(experts, 32, 64, dt=MXFP4),
        ]
        c = OPS["moe_experts"].cost(ins, [t(rows, 64)], {"beta": 4.0, "linear_beta": 25.0})
        # The expected distinct experts of `rows` uniform k-subsets of E: E (1 - (1 - k/E)^rows), whole
        # bytes; one row uses exactly its k, more rows at most rows x k and at most E.
        unused = Fraction(experts - k, experts) ** rows
        assert c.weight_bytes == math.ceil(experts * (1 - unused) * per_expert), (rows, k)
        assert c.weight_bytes <= min(rows * k, experts) * per_expert
        assert rows > 1 or c.weight_bytes == k * per_expert
        assert c.flops == 2 * rows * k * 3 * 64 * 32 and c.state_bytes == 0


def test_oracle_table_is_consistent():
    mine = set(KNOWN_ATTRS)
    assert mine <= set(OPS) and mine == set(ORACLES), sorted(mine ^ set(ORACLES))
    for op, names in ORACLES.items():
        assert set(OPS[op].attrs) == KNOWN_ATTRS[op], f"{op} attributes changed: update its oracle"
        for name in names:
            assert name.startswith("test_") and callable(globals().get(name)), name
