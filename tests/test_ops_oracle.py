"""Every op's jnp reference against an independent numpy oracle written from the equations.

The oracles below use numpy in float64 only: no jnp, no mkdsl helper. Where an op rounds
its input to bf16 (linear), the oracle applies the same rounding (its own bit arithmetic), so
tolerances stay tight. Tolerances, stated per test:

* exact (bitwise): add, mul, embedding, topk, argmax, weight decoding (bf16, fp8, mxfp4, int4)
  and nibble packing;
* `F32_RTOL` = 1e-5 relative, elementwise: f32 transcendental ops (sigmoid, silu, swiglu,
  situ, softcap, softmax, rmsnorm), whose XLA versions are a few ulps from correctly rounded;
* linear: twice the f32 dot-product bound, 2·(K + 2)·2^-24·(|x| @ |w|) per output (the worst
  case of any summation order is (K + 2)·2^-24; observed up to 0.28 of it at K = 8, so twice it
  keeps the 4x margin), while an omitted bf16 rounding of x is off by ~2^-9 relative;
* rope: 2·max|x|·(1e-6 + p·2^-22) per row: the angle p·θ^(-2i/d) is formed in f32, so its
  absolute error grows with the position p;
* attention: max|v|·(4·e_s + (S + 8)·2^-24) per head, where e_s bounds the f32 score error, plus,
  against bf16 caches, one bf16 ulp of each softmax weight whose rounding e_s can flip.

Observed worst error / tolerance over two draws (the `ci` profile and a `dev` run): linear
0.14x, softmax 0.13x, rope 0.09x, situ/swiglu 0.05x, softcap/silu/sigmoid 0.03x, rmsnorm 0.02x,
attention 0.03x. The quantiser tests check properties (nearest code, scale = bf16(amax / 7)
exactly: numpy's f32 division and the bf16 cast are IEEE-defined), not tolerances.

Every example also asserts that the reference produced no NaN. Shapes come from small sets
(jit compiles dominate the run time); values from Hypothesis-drawn seeds.

`ORACLES` records which op each test covers and `KNOWN_ATTRS` the attributes its oracle
passes. Other tests/test_ops_*.py modules keep the same two tables for their ops; the coverage
tests at the end merge them all and fail when an op in `OPS` has no oracle test, or has an
attribute its oracle does not know of, and when a weight format has no linear oracle.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mkdsl.lang.dtypes import ALL_NAMES, MXFP4, int4
from mkdsl.lang.quant import QTensor, dequantize, pack_nibbles, quantize, unpack_nibbles
from mkdsl.ops import OPS, REQUIRED

U = 2.0**-24  # f32 unit roundoff
F32_RTOL = 1e-5  # ~170 f32 ulps: XLA's f32 exp/tanh/rsqrt are within a few ulps, then <= 8 roundings
TINY = 1e-30  # absolute slack for results XLA flushes from subnormal to zero

SEEDS = st.integers(0, 2**32 - 1)
SCALES = st.sampled_from([1e-3, 0.5, 1.0, 8.0])  # magnitude of random activations
ACT_DTYPES = st.sampled_from(["f32", "bf16"])
FEW = settings(max_examples=12, deadline=None)
MANY = settings(max_examples=20, deadline=None)

ORACLES: dict[str, list[str]] = {}  # op name -> tests comparing it with an oracle
LINEAR_FORMATS: set[str] = set()  # weight formats the linear tests cover


def oracle_for(op: str, *formats: str):
    def mark(test):
        ORACLES.setdefault(op, []).append(test.__name__)
        LINEAR_FORMATS.update(formats)
        return test

    return mark


# ---------------------------------------------------------------- numpy-only number formats


def bf16_round(x) -> np.ndarray:
    """f32 -> f32 holding the nearest bf16 (round to nearest, ties to even), by bit arithmetic."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def bf16_array(x) -> np.ndarray:
    """A bfloat16 array (the storage type jax takes) holding bf16_round(x)."""
    return (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16).view(ml_dtypes.bfloat16)


def bf16_decode(a) -> np.ndarray:
    """bf16 bits -> float64: the upper half of an f32."""
    bits = np.asarray(a).view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


def fp8_decode(a, exp_bits: int, man_bits: int) -> np.ndarray:
    """fp8 bits -> float64 from the bit definition (finite codes only): sign, biased exponent,
    mantissa, subnormals at exponent 0."""
    b = np.asarray(a).view(np.uint8).astype(np.int64)
    bias = 2 ** (exp_bits - 1) - 1
    sign = np.where(b >> 7, -1.0, 1.0)
    e = (b >> man_bits) & (2**exp_bits - 1)
    m = (b & (2**man_bits - 1)).astype(np.float64) / 2**man_bits
    mag = np.where(e == 0, m * 2.0 ** (1 - bias), (1.0 + m) * 2.0 ** (e - bias))
    return sign * mag


# The 16 e2m1 codes: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def nibble(codes, k: int, n: int) -> int:
    """Input row k's 4-bit code in column n: nibble k % 8 (low first) of word k // 8."""
    return (int(codes[k // 8, n]) >> (4 * (k % 8))) & 0xF


def mxfp4_decode(codes, scales) -> np.ndarray:
    """[K/8, N] uint32 codes + [K/32, N] E8M0 bytes -> float64 [K, N], element by element."""
    k8, n = codes.shape
    out = np.empty((k8 * 8, n))
    for k in range(k8 * 8):
        for j in range(n):
            out[k, j] = E2M1[nibble(codes, k, j)] * 2.0 ** (int(scales[k // 32, j]) - 127)
    return out


def int4_decode(codes, scales, group: int) -> np.ndarray:
    """[K/8, N] uint32 two's-complement nibbles + [K/g, N] bf16 scales -> float64 [K, N]."""
    k8, n = codes.shape
    s = bf16_decode(scales)
    out = np.empty((k8 * 8, n))
    for k in range(k8 * 8):
        for j in range(n):
            c = nibble(codes, k, j)
            out[k, j] = (c - 16 if c >= 8 else c) * s[k // group, j]
    return out


def pack_oracle(nib: np.ndarray) -> np.ndarray:
    """[K, N] nibbles -> [K/8, N] uint32 words, nibble k % 8 of word k // 8 holding row k."""
    k, n = nib.shape
    words = np.zeros((k // 8, n), np.uint64)
    for i in range(k):
        words[i // 8] |= nib[i].astype(np.uint64) << np.uint64(4 * (i % 8))
    return words.astype(np.uint32)


def activation(rng, shape, scale: float, dtype: str):
    """(array handed to the op, its exact value in float64); never all zeros."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    assert np.any(x != 0)
    if dtype == "bf16":
        a = bf16_array(x)
        return a, bf16_decode(a)
    return x, x.astype(np.float64)


# ---------------------------------------------------------------- running references


@functools.cache
def _jitted(name: str, attrs: tuple):
    ref, kw = OPS[name].reference, dict(attrs)
    return jax.jit(lambda *args: ref(*args, **kw))


def run(name: str, *args, **attrs) -> list[np.ndarray]:
    """OPS[name].reference under jit, as the reference evaluator runs it: attributes not given
    take the registry's defaults (as elaboration fills them in); outputs as numpy."""
    attrs = {k: v for k, v in OPS[name].attrs.items() if v is not REQUIRED} | attrs
    outs = _jitted(name, tuple(sorted(attrs.items())))(*args)
    outs = [np.asarray(o) for o in outs]
    for o in outs:
        assert not np.isnan(o.astype(np.float64)).any(), f"{name} produced NaN"
    return outs


@functools.cache
def _jitted_qlinear(fmt: str, group: int):
    ref = OPS["linear"].reference
    return jax.jit(lambda x, codes, scales: ref(x, QTensor(codes, scales, fmt, group)))


@functools.cache
def _jitted_decode(fmt: str, group: int):
    return jax.jit(lambda codes, scales: dequantize(QTensor(codes, scales, fmt, group)))


def mkdsl_decode(codes, scales, fmt: str, group: int) -> np.ndarray:
    return np.asarray(_jitted_decode(fmt, group)(codes, scales), np.float64)


def close(got, want, atol=0.0, rtol=0.0, what=""):
    """|got - want| <= atol + rtol·|want| elementwise (atol may be an array)."""
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    bound = atol + rtol * np.abs(want)
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} outside tolerance; worst err {err.max():.3g}, "
        f"at {np.unravel_index(np.argmax(err - bound), err.shape)}: got {got.flat[np.argmax(err - bound)]!r}, "
        f"want {want.flat[np.argmax(err - bound)]!r}"
    )


def exact(got, want, what=""):
    got = np.asarray(got)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    assert np.array_equal(got.astype(np.float64), np.asarray(want, np.float64)), what


ROWS = st.sampled_from([1, 3, 8])
COLS = st.sampled_from([1, 7, 64])


def test_oracle_bf16_rounding_agrees_with_ml_dtypes():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000), [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]]).astype(np.float32)
    exact(bf16_round(x), x.astype(ml_dtypes.bfloat16).astype(np.float32), "bf16 rounding")


# ---------------------------------------------------------------- elementwise


@oracle_for("add")
@MANY
@given(seed=SEEDS, b=ROWS, n=COLS, scale=SCALES, da=ACT_DTYPES, db=ACT_DTYPES)
def test_add(seed, b, n, scale, da, db):
    rng = np.random.default_rng(seed)
    (a, av), (c, cv) = activation(rng, (b, n), scale, da), activation(rng, (b, n), 1.0, db)
    (out,) = run("add", a, c)
    assert out.dtype == np.float32
    exact(out, (av + cv).astype(np.float32), "add")  # f64 then f32: double rounding is innocuous


@oracle_for("mul")
@MANY
@given(seed=SEEDS, b=ROWS, n=COLS, scale=SCALES, da=ACT_DTYPES, db=ACT_DTYPES)
def test_mul(seed, b, n, scale, da, db):
    rng = np.random.default_rng(seed)
    (a, av), (c, cv) = activation(rng, (b, n), scale, da), activation(rng, (b, n), 1.0, db)
    (out,) = run("mul", a, c)
    assert out.dtype == np.float32
    exact(out, (av * cv).astype(np.float32), "mul")


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-x))


@oracle_for("sigmoid")
@oracle_for("silu")
@oracle_for("softcap")
@MANY
@given(
    seed=SEEDS,
    b=ROWS,
    n=COLS,
    scale=st.sampled_from([1e-3, 1.0, 8.0, 40.0]),
    dt=ACT_DTYPES,
    cap=st.sampled_from([1.0, 30.0, 50.0]),
)
def test_unary_activations(seed, b, n, scale, dt, cap):
    x, xv = activation(np.random.default_rng(seed), (b, n), scale, dt)
    close(run("sigmoid", x)[0], sigmoid64(xv), TINY, F32_RTOL, "sigmoid")
    close(run("silu", x)[0], xv * sigmoid64(xv), TINY, F32_RTOL, "silu")
    close(run("softcap", x, cap=cap)[0], cap * np.tanh(xv / cap), TINY, F32_RTOL, "softcap")


@oracle_for("swiglu")
@oracle_for("situ")
@MANY
@given(
    seed=SEEDS,
    b=ROWS,
    n=COLS,
    scale=st.sampled_from([1e-3, 1.0, 8.0, 40.0]),
    dt=ACT_DTYPES,
    beta=st.sampled_from([None, 1.0, 4.0]),
    linear_beta=st.sampled_from([None, 2.0, 25.0]),
)
def test_gated_activations(seed, b, n, scale, dt, beta, linear_beta):
    rng = np.random.default_rng(seed)
    (g, gv), (u, uv) = activation(rng, (b, n), scale, dt), activation(rng, (b, n), scale, dt)
    close(run("swiglu", g, u)[0], gv * sigmoid64(gv) * uv, TINY, F32_RTOL, "swiglu")
    attrs = {k: v for k, v in (("beta", beta), ("linear_beta", linear_beta)) if v is not None}
    bt, lb = attrs.get("beta", 4.0), attrs.get("linear_beta", 25.0)  # the documented defaults
    want = bt * np.tanh(gv / bt) * sigmoid64(gv) * lb * np.tanh(uv / lb)
    close(run("situ", g, u, **attrs)[0], want, TINY, F32_RTOL, f"situ{attrs}")


@oracle_for("softmax")
@MANY
@given(seed=SEEDS, b=ROWS, n=COLS, scale=st.sampled_from([1e-3, 1.0, 8.0]), dt=ACT_DTYPES)
def test_softmax(seed, b, n, scale, dt):
    x, xv = activation(np.random.default_rng(seed), (b, n), scale, dt)
    e = np.exp(xv - xv.max(axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    (out,) = run("softmax", x)
    # x - max is rounded in f32 (relative error u·|x - max| after exp), plus the n-term sum.
    spread = xv.max(axis=-1, keepdims=True) - xv.min(axis=-1, keepdims=True)
    close(out, want, TINY, F32_RTOL + U * (2 * spread + n), "softmax")
    close(out.sum(axis=-1), np.ones(b), 0, (n + 8) * U, "softmax row sums")


# ---------------------------------------------------------------- normalisation


@oracle_for("rmsnorm")
@MANY
@given(
    seed=SEEDS,
    b=ROWS,
    heads=st.sampled_from([1, 2, 4]),
    width=st.sampled_from([8, 64]),
    scale=SCALES,
    dt=ACT_DTYPES,
    wdt=ACT_DTYPES,
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    offset=st.sampled_from([0.0, 1.0, None]),
)
def test_rmsnorm(seed, b, heads, width, scale, dt, wdt, eps, offset):
    """offset + w is one f32 rounding of exact values (relative to the result), so F32_RTOL holds.
    offset None: the weightless norm (no weight operand; Llama 4's qk norm), x·rsqrt(mean(x²)+eps)."""
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, heads * width), scale, dt)
    w, wv = activation(rng, (width,), 1.0, wdt)
    if offset is None:
        (out,) = run("rmsnorm", x, eps=eps, heads=heads)
        wv = np.ones(width)
    else:
        (out,) = run("rmsnorm", x, w, eps=eps, heads=heads, offset=offset)
        wv = offset + wv
    want = np.empty((b, heads * width))
    for r in range(b):
        for h in range(heads):
            sl = slice(h * width, (h + 1) * width)
            want[r, sl] = xv[r, sl] / np.sqrt(np.mean(xv[r, sl] ** 2) + eps) * wv
    close(out, want, TINY, F32_RTOL, f"rmsnorm heads={heads}")


@oracle_for("layernorm")
@MANY
@given(
    seed=SEEDS,
    b=ROWS,
    heads=st.sampled_from([1, 2]),
    width=st.sampled_from([8, 64]),
    scale=SCALES,
    shift=st.sampled_from([0.0, 3.0]),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    bias=st.booleans(),
)
def test_layernorm(seed, b, heads, width, scale, shift, eps, bias):
    """torch.nn.LayerNorm: (x - mean)/sqrt(mean((x - mean)²) + eps)·w (+ b). Rows shifted off zero
    (`shift`): the mean's f32 rounding is relative to |x|, so the centred values carry an error of
    ~n·u·max|x|, relative to their spread std: the bound scales by 1 + shift/std."""
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, heads * width), scale, "f32")
    x = (x + np.float32(shift * scale)).astype(np.float32)
    xv = x.astype(np.float64)
    w, wv = activation(rng, (width,), 1.0, "bf16")
    bb, bv = activation(rng, (width,), 1.0, "bf16")
    (out,) = run("layernorm", x, w, bb, eps=eps, heads=heads) if bias else run("layernorm", x, w, eps=eps, heads=heads)
    want = np.empty((b, heads * width))
    rel = np.empty((b, heads * width))
    for r in range(b):
        for h in range(heads):
            sl = slice(h * width, (h + 1) * width)
            c = xv[r, sl] - xv[r, sl].mean()
            std = np.sqrt(np.mean(c**2) + eps)
            want[r, sl] = c / std * wv + (bv if bias else 0.0)
            rel[r, sl] = 4 * (width + 4) * U * (1 + np.abs(xv[r, sl]).max() / std) * np.abs(wv)
    close(out, want, TINY + rel, F32_RTOL, f"layernorm heads={heads} bias={bias}")


# ---------------------------------------------------------------- linear and embedding


def check_linear(out, xv, wv, what):
    xb = bf16_round(xv.astype(np.float32)).astype(np.float64)  # linear's input rounding
    want = xb @ wv
    k = wv.shape[0]
    assert out.shape == want.shape and out.dtype == np.float32, (out.shape, want.shape)
    close(out, want, 2 * (k + 2) * U * (np.abs(xb) @ np.abs(wv)) + TINY, 0, what)  # 2x the any-order f32 bound


def fp8_array(rng, shape, fmt: str):
    """Random fp8 codes over all finite values (subnormals included)."""
    if fmt == "fp8_e4m3":  # e4m3fn: no inf, NaN at S.1111.111
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        b = np.where((b & 0x7F) == 0x7F, b ^ 0x01, b)
        return b.view(ml_dtypes.float8_e4m3fn), fp8_decode(b, 4, 3)
    # e5m2: exponent 31 is inf/NaN; keep magnitudes below 2^8 so products stay tame
    b = rng.integers(0, 256, shape, dtype=np.uint8)
    b = np.where(((b >> 2) & 0x1F) > 22, b ^ 0x40, b)
    return b.view(ml_dtypes.float8_e5m2), fp8_decode(b, 5, 2)


@oracle_for("linear", "bf16", "f32", "fp8_e4m3", "fp8_e5m2")
@settings(max_examples=20, deadline=None)
@given(
    seed=SEEDS,
    b=ROWS,
    k=st.sampled_from([8, 64, 256]),
    n=st.sampled_from([1, 24]),
    scale=SCALES,
    dt=ACT_DTYPES,
    fmt=st.sampled_from(["bf16", "f32", "fp8_e4m3", "fp8_e5m2"]),
    transposed=st.booleans(),
)
def test_linear_plain_weights(seed, b, k, n, scale, dt, fmt, transposed):
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, dt)
    if fmt == "bf16":
        w = bf16_array(rng.standard_normal((k, n)) / np.sqrt(k))
        wv = bf16_decode(w)
    elif fmt == "f32":
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        wv = w.astype(np.float64)
    else:
        w, wv = fp8_array(rng, (k, n), fmt)
    if transposed:  # stored [N, K] (a tied head): the same product of the transposed array
        out = run("linear", x, np.ascontiguousarray(w.T), transposed=True)[0]
    else:
        out = run("linear", x, w)[0]
    check_linear(out, xv, wv, f"linear {fmt}{' transposed' if transposed else ''}")


@oracle_for("linear")
@FEW
@given(seed=SEEDS, b=ROWS, k=st.sampled_from([8, 256]), n=st.sampled_from([1, 24]), scale=SCALES)
def test_linear_f32_input(seed, b, k, n, scale):
    """input="f32" (a router the reference implementation computes in f32): x is not rounded, so
    the product is x @ w to f32 summation error; rounding x to bf16 first misses it by ~2^-9."""
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, "f32")
    w = bf16_array(rng.standard_normal((k, n)) / np.sqrt(k))
    wv = bf16_decode(w)
    (out,) = run("linear", x, w, input="f32")
    want = xv @ wv
    close(out, want, 2 * (k + 2) * U * (np.abs(xv) @ np.abs(wv)) + TINY, 0, "linear f32 input")
    # x = 1 + 2^-12 is no bf16 value: eight of them times ones are 8 + 2^-9 kept f32, 8 rounded first
    ones, xs = bf16_array(np.ones((8, 1))), np.full((1, 8), 1 + 2.0**-12, np.float32)
    exact(run("linear", xs, ones, input="f32")[0], [[8 + 2.0**-9]], "linear f32 input keeps x")
    exact(run("linear", xs, ones)[0], [[8.0]], "linear rounds x to bf16 by default")


@oracle_for("linear", "mxfp4")
@FEW
@given(seed=SEEDS, b=ROWS, k=st.sampled_from([32, 128]), n=st.sampled_from([1, 24]), scale=SCALES, dt=ACT_DTYPES)
def test_linear_mxfp4(seed, b, k, n, scale, dt):
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, dt)
    codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32)
    scales = rng.integers(112, 136, (k // 32, n), dtype=np.uint8)
    (out,) = _jitted_qlinear("mxfp4", 32)(x, codes, scales)
    check_linear(np.asarray(out), xv, mxfp4_decode(codes, scales), "linear mxfp4")


@oracle_for("linear", "int8", "fp8_e4m3", "fp8_e5m2")
@FEW
@given(
    seed=SEEDS,
    b=ROWS,
    k=st.sampled_from([64, 128]),
    n=st.sampled_from([1, 24]),
    group=st.sampled_from([16, 64]),
    scale=SCALES,
    dt=ACT_DTYPES,
    fmt=st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3:block"]),
)
def test_linear_scaled_codes(seed, b, k, n, group, scale, dt, fmt):
    """int8 and fp8 codes with f32 scales: per `group` inputs of a column, or per [g, g] square."""
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, dt)
    if fmt == "int8":
        codes = rng.integers(-128, 128, (k, n)).astype(np.int8)
        cv = codes.astype(np.float64)
    else:
        codes, cv = fp8_array(rng, (k, n), fmt.split(":")[0])
    blocks = (-(-k // group), -(-n // group)) if fmt.endswith(":block") else (k // group, n)
    scales = (rng.standard_normal(blocks) * 0.01).astype(np.float32)
    full = np.repeat(scales.astype(np.float64), group, 0)
    full = np.repeat(full, group, 1)[:k, :n] if fmt.endswith(":block") else full
    (out,) = _jitted_qlinear(fmt, group)(x, codes, scales)
    # the reference rounds each code x scale to f32 once (2^-24 relative): inside check_linear's bound
    check_linear(np.asarray(out), xv, cv * full, f"linear {fmt}(group={group})")


@oracle_for("linear", "int4")
@FEW
@given(
    seed=SEEDS,
    b=ROWS,
    k=st.sampled_from([64, 128]),
    n=st.sampled_from([1, 24]),
    group=st.sampled_from([8, 32, 64]),
    scale=SCALES,
    dt=ACT_DTYPES,
)
def test_linear_int4(seed, b, k, n, group, scale, dt):
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, dt)
    codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32)
    scales = bf16_array(rng.standard_normal((k // group, n)) * 0.05)  # either sign
    (out,) = _jitted_qlinear("int4", group)(x, codes, scales)
    check_linear(np.asarray(out), xv, int4_decode(codes, scales, group), f"linear int4(group={group})")


@oracle_for("linear", "q8_0", "q4_0", "q4_1")
@FEW
@given(
    seed=SEEDS,
    b=ROWS,
    k=st.sampled_from([64, 128]),
    n=st.sampled_from([1, 24]),
    fmt=st.sampled_from(["q8_0", "q4_0", "q4_1"]),
    scale=SCALES,
    dt=ACT_DTYPES,
)
def test_linear_gguf_blocks(seed, b, k, n, fmt, scale, dt):
    """llama.cpp's blocks of 32 inputs, element by element from their published definitions: Q8_0
    d * q (q int8), Q4_0 d * (q - 8), Q4_1 d * q + m (q a nibble), d and m f16, stored as mkdsl
    keeps them (dtypes.storage: Q4_1's d | m << 16 per block, Q8_0/Q4_0 two blocks' d per word)."""
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, dt)
    d = (rng.standard_normal((k // 32, n)) * 0.01).astype(np.float16)
    m = (rng.standard_normal((k // 32, n)) * 0.01).astype(np.float16)
    bits = lambda h: h.view(np.uint16).astype(np.uint32)  # noqa: E731
    if fmt == "q8_0":
        codes = rng.integers(-128, 128, (k, n)).astype(np.int8)
        q = codes.astype(np.float64)
    else:
        codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32)
        q = np.array([[nibble(codes, i, j) for j in range(n)] for i in range(k)], np.float64)
    if fmt == "q4_1":
        words = bits(d) | bits(m) << np.uint32(16)
        want = q * np.repeat(d.astype(np.float64), 32, 0) + np.repeat(m.astype(np.float64), 32, 0)
    else:
        words = bits(d[0::2]) | bits(d[1::2]) << np.uint32(16)
        want = (q - (8.0 if fmt == "q4_0" else 0.0)) * np.repeat(d.astype(np.float64), 32, 0)
    (out,) = _jitted_qlinear(fmt, 32)(x, codes, words)
    # each decoded value is exact in f32 but Q4_1's d * q + m, rounded once (2^-24 relative): inside check_linear's bound
    check_linear(np.asarray(out), xv, want, f"linear {fmt}")


@functools.cache
def _jitted_kquant_linear(fmt: str):
    ref = OPS["linear"].reference
    return jax.jit(lambda x, codes, words, extra: ref(x, QTensor(codes, words, fmt, 256, None, extra)))


def kquant_values(fmt: str, codes, words, extra) -> np.ndarray:
    """K-quant weights [K, N] in float64, element by element from ggml's definitions and mkdsl's
    documented storage (docs/language.md, Dtypes): q the nibble plus, for q5_k/q6_k, the bits of
    `high` above it (word j of a super-block's W words holds inputs j, j + W, ...); q4_k/q5_k
    d * sc * q - dmin * m per sub-block of 32 (6-bit sc, m of ggml's get_scale_min_k4 over the
    12 bytes in words 1..3), q6_k d * sc * (q - 32) per 16 (int8 sc, the d of super-blocks 2i,
    2i + 1 in one word)."""
    k, n = codes.shape[0] * 8, codes.shape[1]
    per = {"q4_k": 0, "q5_k": 32, "q6_k": 16}[fmt]
    out = np.zeros((k, n))

    def byte(word: int, b: int) -> int:
        return (int(word) >> (8 * b)) & 255

    def f16(bits: int) -> float:
        return float(np.array([bits & 0xFFFF], np.uint16).view(np.float16)[0])

    for c in range(n):
        for i in range(k):
            s, r = divmod(i, 256)
            q = nibble(codes, i, c)
            if per:
                w, bits = 256 // per, 32 // per
                q += ((int(extra[0][w * s + r % w, c]) >> (bits * (r // w))) & (2**bits - 1)) << 4
            ws = [int(words[4 * s + f, c]) for f in range(4)]
            if fmt == "q6_k":
                j = r // 16
                sc = byte(ws[j // 4], j % 4)
                d = f16(int(extra[1][s // 2, c]) >> (16 * (s % 2)))
                out[i, c] = d * (sc - 256 if sc >= 128 else sc) * (q - 32)
                continue
            j = r // 32
            b = [byte(ws[1 + t // 4], t % 4) for t in range(12)]
            if j < 4:
                sc, m = b[j] & 63, b[j + 4] & 63
            else:
                sc, m = (b[j + 4] & 15) | ((b[j - 4] >> 6) << 4), (b[j + 4] >> 4) | ((b[j] >> 6) << 4)
            out[i, c] = f16(ws[0]) * sc * q - f16(ws[0] >> 16) * m
    return out


@oracle_for("linear", "q4_k", "q5_k", "q6_k")
@FEW
@given(
    seed=SEEDS,
    b=ROWS,
    n=st.sampled_from([1, 24]),
    fmt=st.sampled_from(["q4_k", "q5_k", "q6_k"]),
    scale=SCALES,
    dt=ACT_DTYPES,
)
def test_linear_kquants(seed, b, n, fmt, scale, dt):
    """GGUF K-quants (super-blocks of 256, two of them: q6_k's d words pair them): random codes,
    bits and packed scales, f16 d and dmin of a trained model's size."""
    rng = np.random.default_rng(seed)
    k = 512
    x, xv = activation(rng, (b, k), scale, dt)
    codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32)
    words = rng.integers(0, 2**32, (k // 64, n), dtype=np.uint32)
    f16 = lambda a: a.astype(np.float16).view(np.uint16).astype(np.uint32)  # noqa: E731
    extra = ()
    if fmt != "q6_k":  # word 0 of each super-block: d | dmin << 16
        words[0::4] = f16(rng.uniform(1e-4, 3e-3, (k // 256, n))) | f16(rng.uniform(1e-4, 3e-3, (k // 256, n))) << 16
    if fmt != "q4_k":
        extra = (rng.integers(0, 2**32, (k // (32 if fmt == "q5_k" else 16), n), dtype=np.uint32),)
    if fmt == "q6_k":
        extra += (f16(rng.uniform(1e-4, 3e-3, (k // 512, n))) | f16(rng.uniform(1e-4, 3e-3, (k // 512, n))) << 16,)
    (out,) = _jitted_kquant_linear(fmt)(x, codes, words, extra)
    # each decoded value rounds once in f32 (the subtraction; q6_k's product by q): inside check_linear's bound
    check_linear(np.asarray(out), xv, kquant_values(fmt, codes, words, extra), f"linear {fmt}")


@oracle_for("linear", "nvfp4")
@FEW
@given(seed=SEEDS, b=ROWS, k=st.sampled_from([16, 128]), n=st.sampled_from([1, 24]), scale=SCALES, dt=ACT_DTYPES)
def test_linear_nvfp4(seed, b, k, n, scale, dt):
    """NVFP4: e2m1 code x e4m3 scale (one per 16 inputs) x the matrix's f32 global scale."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, k), scale, dt)
    codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32)
    scales = (rng.uniform(0.01, 448.0, (k // 16, n)) * rng.choice([-1, 1], (k // 16, n))).astype(
        ml_dtypes.float8_e4m3fn
    )
    glob = np.array([[rng.uniform(1e-4, 1e-2)]], np.float32)
    e4m3 = scales.astype(np.float64)  # every e4m3 value is exact in float64
    want = np.array([[E2M1[nibble(codes, i, j)] for j in range(n)] for i in range(k)])
    want = want * np.repeat(e4m3, 16, axis=0) * float(glob[0, 0])
    ref = OPS["linear"].reference
    (out,) = jax.jit(lambda x, c, s, g: ref(x, QTensor(c, s, "nvfp4", 16, g)))(x, codes, scales, glob)
    # the reference rounds each value x global to f32 once (2^-24 relative): inside check_linear's bound
    check_linear(np.asarray(out), xv, want, "linear nvfp4")


@oracle_for("linear")
@FEW
@given(seed=SEEDS, b=ROWS, n=st.sampled_from([1, 24]), group=st.sampled_from([16, 128]), scale=SCALES, dt=ACT_DTYPES)
def test_linear_int4_with_f32_scales(seed, b, n, group, scale, dt):
    rng = np.random.default_rng(seed)
    k = 128
    x, xv = activation(rng, (b, k), scale, dt)
    codes = rng.integers(0, 2**32, (k // 8, n), dtype=np.uint32)
    scales = (rng.standard_normal((k // group, n)) * 0.05).astype(np.float32)
    nib = np.array([[nibble(codes, i, j) for j in range(n)] for i in range(k)])
    want = np.where(nib >= 8, nib - 16, nib) * np.repeat(scales.astype(np.float64), group, axis=0)
    (out,) = _jitted_qlinear("int4", group)(x, codes, scales)
    check_linear(np.asarray(out), xv, want, f"linear int4(group={group}, scale=f32)")


@oracle_for("embedding")
@MANY
@given(
    seed=SEEDS,
    b=ROWS,
    vocab=st.sampled_from([1, 5, 300]),
    h=st.sampled_from([8, 64]),
    fmt=st.sampled_from(["bf16", "f32", "fp8_e4m3"]),
)
def test_embedding(seed, b, vocab, h, fmt):
    rng = np.random.default_rng(seed)
    if fmt == "fp8_e4m3":
        table, tv = fp8_array(rng, (vocab, h), fmt)
    else:
        table, tv = activation(rng, (vocab, h), 1.0, fmt)
    tokens = rng.integers(0, vocab, b).astype(np.int32)
    (out,) = run("embedding", tokens, table)
    want = np.stack([tv[t] for t in tokens])
    exact(out, want, "embedding")


# ---------------------------------------------------------------- rope and attention


def rope_oracle(xv, positions, heads, theta):
    """Rotate-half: in each head, pair (i, i + d/2) rotates by angle p·theta^(-2i/d)."""
    b, n = xv.shape
    d = n // heads
    out = np.empty_like(xv)
    for r in range(b):
        for h in range(heads):
            base = h * d
            for i in range(d // 2):
                a = float(positions[r]) * theta ** (-2.0 * i / d)
                x1, x2 = xv[r, base + i], xv[r, base + i + d // 2]
                out[r, base + i] = x1 * np.cos(a) - x2 * np.sin(a)
                out[r, base + i + d // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    return out


POSITIONS = st.sampled_from(["small", "large"])


def draw_positions(rng, b, kind, high=None):
    high = high if high is not None else (64 if kind == "small" else 70000)
    return rng.integers(0, high, b).astype(np.int32)


@oracle_for("rope")
@MANY
@given(
    seed=SEEDS,
    b=ROWS,
    heads=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([2, 8, 64]),
    theta=st.sampled_from([10000.0, 500000.0]),
    scale=SCALES,
    dt=ACT_DTYPES,
    pos=POSITIONS,
)
def test_rope(seed, b, heads, d, theta, scale, dt, pos):
    rng = np.random.default_rng(seed)
    x, xv = activation(rng, (b, heads * d), scale, dt)
    positions = draw_positions(rng, b, pos)
    if b > 1:
        positions[0] = 0  # position 0 is the identity
    (out,) = run("rope", x, positions, heads=heads, theta=theta)
    want = rope_oracle(xv, positions, heads, theta)
    atol = 2 * np.abs(xv).max(axis=1, keepdims=True) * (1e-6 + positions[:, None] * 2.0**-22)
    close(out, want, atol, 0, f"rope heads={heads} d={d}")
    if b > 1:
        exact(out[0], xv[0].astype(np.float32), "rope at position 0")


def attention_oracle(qv, kv, vv, kc, vc, positions, heads, kv_heads, scale, cache_round):
    """Per row and head: write k/v at the row's position, softmax(q·k_t·scale) over t <= p. Against
    bf16 caches both products are bf16 MXU dots (the numeric contract, docs/architecture.md
    "Attention numerics"): q and the unnormalised weights exp(s - max) are rounded to bf16, the
    sum that divides is not."""
    mxu_round = (lambda a: bf16_round(a).astype(np.float64)) if cache_round is not _as_f32 else _f32
    b = qv.shape[0]
    dk, dv = kc.shape[-1], vc.shape[-1]
    kc, vc = kc.copy(), vc.copy()
    out = np.empty((b, heads * dv))
    atol = np.empty((b, heads * dv))
    group = heads // kv_heads
    for r in range(b):
        p = int(positions[r])
        for j in range(kv_heads):
            kc[r, j, p] = cache_round(kv[r, j * dk : (j + 1) * dk])
            vc[r, j, p] = cache_round(vv[r, j * dv : (j + 1) * dv])
        for h in range(heads):
            j = h // group  # grouped-query: this head's KV head
            q = mxu_round(qv[r, h * dk : (h + 1) * dk])
            keys, values = kc[r, j, : p + 1], vc[r, j, : p + 1]
            s = keys @ q * scale
            e = np.exp(s - s.max())
            score_err = (dk + 2) * U * scale * (np.abs(keys) @ np.abs(q)).max()
            out[r, h * dv : (h + 1) * dv] = mxu_round(e) @ values / e.sum()
            flips = e_flips(e, 2 * score_err + 8 * U) if mxu_round is not _f32 else 0 * e
            atol[r, h * dv : (h + 1) * dv] = (
                np.abs(values).max() * (4 * score_err + (p + 10) * U) + flips @ np.abs(values) / e.sum() + TINY
            )
    return out, kc, vc, atol


def _f32(a):
    return np.asarray(a, np.float64)


def _as_f32(a):
    return a.astype(np.float32)


def e_flips(e, rel):
    """Per weight, how far its bf16 rounding can move if computed with relative error `rel` (the
    kernel's f32 scores vs ours): one bf16 ulp where e(1 - rel) and e(1 + rel) round apart, else 0.
    So the bound stays tight where no rounding can flip, and an omitted bf16 rounding still fails."""
    lo, hi = bf16_round(e * (1 - rel)), bf16_round(e * (1 + rel))
    ulp = np.ldexp(1.0, np.frexp(e)[1] - 8)  # one bf16 ulp of e (8 significant bits)
    return np.where(lo != hi, ulp, 0.0)


@oracle_for("attention")
@settings(max_examples=20, deadline=None)
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    dk=st.sampled_from([8, 64]),
    dv_same=st.booleans(),
    s=st.sampled_from([1, 5, 16]),
    cache=st.sampled_from(["bf16", "f32"]),
    scale=st.sampled_from([None, 0.3]),
    qscale=st.sampled_from([0.5, 3.0]),
)
def test_attention(seed, b, kv_heads, group, dk, dv_same, s, cache, scale, qscale):
    rng = np.random.default_rng(seed)
    heads, dv = kv_heads * group, dk if dv_same else 16
    q, qv = activation(rng, (b, heads * dk), qscale, "f32")
    k, kv = activation(rng, (b, kv_heads * dk), 1.0, "f32")
    v, vv = activation(rng, (b, kv_heads * dv), 1.0, "f32")
    # The caches start full of other tokens' entries: everything past each row's position must be masked.
    kc, kcv = activation(rng, (b, kv_heads, s, dk), 1.0, cache)
    vc, vcv = activation(rng, (b, kv_heads, s, dv), 1.0, cache)
    positions = rng.integers(0, s, b).astype(np.int32)
    if b > 1 and s > 1:
        positions[rng.integers(b)] = s - 1  # the last slot, and (with b = 3) often a repeat
    attrs = {"heads": heads, "kv_heads": kv_heads} | ({} if scale is None else {"scale": scale})  # None: default
    out, new_kc, new_vc = run("attention", q, k, v, kc, vc, positions, **attrs)
    rnd = (lambda a: bf16_round(a.astype(np.float32))) if cache == "bf16" else _as_f32
    want, want_kc, want_vc, atol = attention_oracle(
        qv, kv, vv, kcv, vcv, positions, heads, kv_heads, dk**-0.5 if scale is None else scale, rnd
    )
    assert new_kc.dtype == kc.dtype and new_vc.dtype == vc.dtype
    exact(new_kc, want_kc, "key cache (written at each row's position, untouched elsewhere)")
    exact(new_vc, want_vc, "value cache")
    close(out, want, atol, 0, f"attention heads={heads} kv_heads={kv_heads}")


# ---------------------------------------------------------------- selection


def tie_prone(rng, shape, ties: bool, dt: str):
    if ties:  # few distinct values: many ties
        x = rng.integers(-2, 3, shape).astype(np.float32)
        x[x == 0] = 0.5  # never all zeros (and no signed zeros)
        return (bf16_array(x), x.astype(np.float64)) if dt == "bf16" else (x, x.astype(np.float64))
    return activation(rng, shape, 1.0, dt)


@oracle_for("topk")
@MANY
@given(seed=SEEDS, b=ROWS, n=st.sampled_from([1, 5, 33]), kfrac=st.floats(0, 1), ties=st.booleans(), dt=ACT_DTYPES)
def test_topk(seed, b, n, kfrac, ties, dt):
    rng = np.random.default_rng(seed)
    x, xv = tie_prone(rng, (b, n), ties, dt)
    k = 1 + int(kfrac * (n - 1))
    values, indices = run("topk", x, k=k)
    assert values.dtype == np.float32 and indices.dtype == np.int32
    for r in range(b):
        order = sorted(range(n), key=lambda i: (-xv[r, i], i))[:k]  # descending, ties to lower index
        exact(indices[r], order, f"topk indices row {r}")
        exact(values[r], xv[r, order], f"topk values row {r}")


@oracle_for("argmax")
@MANY
@given(seed=SEEDS, b=ROWS, n=st.sampled_from([1, 5, 33]), ties=st.booleans(), dt=ACT_DTYPES)
def test_argmax(seed, b, n, ties, dt):
    x, xv = tie_prone(np.random.default_rng(seed), (b, n), ties, dt)
    (out,) = run("argmax", x)
    assert out.dtype == np.int32
    want = [min(i for i in range(n) if xv[r, i] == xv[r].max()) for r in range(b)]
    exact(out, want, "argmax (first of equal maxima)")


# ---------------------------------------------------------------- quantised formats


def test_mxfp4_decodes_all_codes_at_every_scale():
    """Column c holds the 16 codes twice (one 32-input block) under scale byte c. Exact where
    the value is a normal f32 or zero (sign of zero included); subnormal values, and every
    value under byte 0 (whose scale 2^-127 is itself subnormal), may be flushed to zero as
    XLA on CPU does; beyond the f32 range: +-inf; byte 0xFF: NaN (E8M0's NaN)."""
    rows = np.arange(32) % 16
    codes = pack_oracle(np.repeat(rows[:, None], 256, axis=1))
    scales = np.arange(256, dtype=np.uint8)[None, :]
    got = mkdsl_decode(codes, scales, "mxfp4", 32)
    want = np.array([[E2M1[c] * 2.0 ** (e - 127) for e in range(256)] for c in rows])
    f32 = np.finfo(np.float32)
    finite = np.abs(want) <= float(f32.max)
    normal_or_zero = finite & ((want == 0) | (np.abs(want) >= float(f32.tiny)))
    normal_or_zero[:, 0] = False
    flushable = finite & ~normal_or_zero
    for m in (finite, normal_or_zero, flushable):
        m[:, 255] = False
    exact(got[normal_or_zero], want[normal_or_zero], "mxfp4 decode")
    assert np.array_equal(np.signbit(got[normal_or_zero]), np.signbit(want[normal_or_zero])), "sign of zero"
    sub_got, sub_want = got[flushable], want[flushable]
    assert np.all((sub_got == sub_want) | (sub_got == 0)), "subnormal: exact or flushed to zero"
    big = ~finite
    big[:, 255] = False
    exact(got[big], np.copysign(np.inf, want[big]), "overflow is +-inf")
    assert np.isnan(got[:, 255]).all(), "E8M0 0xFF is NaN"
    assert normal_or_zero.sum() > 32 * 240 and big.sum() == 24  # {4, 6} at 253; {2, 3, 4, 6} at 254


@MANY
@given(seed=SEEDS, lead=st.sampled_from([(), (2,)]), k8=st.integers(1, 6), n=st.integers(1, 5))
def test_pack_unpack_nibbles(seed, lead, k8, n):
    rng = np.random.default_rng(seed)
    nib = rng.integers(0, 16, (*lead, 8 * k8, n))
    packed = pack_nibbles(nib)
    assert packed.dtype == np.uint32 and packed.shape == (*lead, k8, n)
    for idx in np.ndindex(*lead):
        exact(packed[idx], pack_oracle(nib[idx]), "pack_nibbles bit layout")
    exact(np.asarray(jax.jit(unpack_nibbles)(packed)), nib, "unpack_nibbles")


@FEW
@given(seed=SEEDS, k=st.sampled_from([32, 64]), n=st.sampled_from([1, 5]), lead=st.sampled_from([(), (2,)]))
def test_mxfp4_dequantize_stacked_matches_bit_oracle(seed, k, n, lead):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**32, (*lead, k // 8, n), dtype=np.uint32)
    scales = rng.integers(2, 250, (*lead, k // 32, n), dtype=np.uint8)
    got = mkdsl_decode(codes, scales, "mxfp4", 32)
    for idx in np.ndindex(*lead):
        exact(got[idx], mxfp4_decode(codes[idx], scales[idx]), "stacked mxfp4 decode")


def blocky_weights(rng, lead, k, n, group):
    """Per-block magnitudes spread over 2^±20, some blocks exactly zero, never all."""
    w = rng.standard_normal((*lead, k, n))
    mag = 2.0 ** rng.uniform(-20, 20, (*lead, k // group, 1, n))
    mag[rng.random(mag.shape) < 0.15] = 0.0
    mag.flat[0] = 1.0
    return (w.reshape(*lead, k // group, group, n) * mag).reshape(*lead, k, n).astype(np.float32)


@settings(max_examples=20, deadline=None)
@given(seed=SEEDS, k=st.sampled_from([32, 128]), n=st.sampled_from([1, 6]), lead=st.sampled_from([(), (2,)]))
def test_mxfp4_quantize_rounds_to_nearest_with_smallest_unclipped_scale(seed, k, n, lead):
    rng = np.random.default_rng(seed)
    w = blocky_weights(rng, lead, k, n, 32)
    q = quantize(MXFP4, w)
    assert q.fmt == "mxfp4" and q.group == 32 and q.scales.dtype == np.uint8
    got = mkdsl_decode(q.codes, q.scales, "mxfp4", 32)
    grid = np.array(E2M1[:8])
    for idx in np.ndindex(*lead):
        deq = mxfp4_decode(q.codes[idx], q.scales[idx])
        exact(got[idx], deq, "dequantize(quantize(w)) vs bit oracle")
        wv = w[idx].astype(np.float64)
        s = np.repeat(2.0 ** (q.scales[idx].astype(np.float64) - 127), 32, axis=0)
        err = np.abs(wv - deq)
        # nearest representable value of the block's grid, same sign
        nearest = np.abs(np.abs(wv)[..., None] - grid * s[..., None]).min(-1)
        # slack 1e-6: the quantiser's f32 |w| / s is off by <= 2^-24 relative, ~16x below it
        close(err, nearest, 1e-6 * s, 1e-6, "mxfp4 quantize picks the nearest code")
        assert np.all((deq == 0) | (np.sign(deq) == np.sign(wv))), "sign"
        # the gaps of e2m1 (0.5 below 2, 1 below 4, 2 below 6) bound the error
        assert np.all(err <= 0.25 * np.abs(wv) + 0.25 * s * (1 + 1e-6))
        amax = np.abs(wv.reshape(k // 32, 32, n)).max(1)
        s_block = 2.0 ** (q.scales[idx].astype(np.float64) - 127)
        live = amax > 0
        # slack 2^-20: the f32 log2 may misjudge an exact power of two by a few 2^-24
        assert np.all(amax[live] <= 6 * s_block[live] * (1 + 2**-20)), "no clipping"
        assert np.all(amax[live] > 3 * s_block[live] * (1 - 2**-20)), "smallest scale that does not clip"


@settings(max_examples=20, deadline=None)
@given(
    seed=SEEDS,
    k=st.sampled_from([32, 128]),
    n=st.sampled_from([1, 6]),
    group=st.sampled_from([8, 32, 128]),
    lead=st.sampled_from([(), (2,)]),
)
def test_int4_quantize_error_within_half_a_step(seed, k, n, group, lead):
    group = min(group, k)
    rng = np.random.default_rng(seed)
    w = blocky_weights(rng, lead, k, n, group)
    q = quantize(int4(group), w)
    assert q.fmt == "int4" and q.group == group
    got = mkdsl_decode(q.codes, q.scales, "int4", group)
    for idx in np.ndindex(*lead):
        deq = int4_decode(q.codes[idx], q.scales[idx], group)
        exact(got[idx], deq, "dequantize(quantize(w)) vs bit oracle")
        wv = w[idx].astype(np.float64)
        sc = bf16_decode(q.scales[idx])
        amax = np.abs(wv.reshape(k // group, group, n)).max(1)
        live = amax > 0
        # f32 division and round-to-nearest-even to bf16 are IEEE-defined: exact on any machine
        f32_amax = np.abs(w[idx]).reshape(k // group, group, n).max(1)
        exact(sc[live], bf16_round(f32_amax / np.float32(7))[live], "int4 scale = bf16(f32(amax) / 7)")
        step = np.repeat(np.abs(sc), group, axis=0)
        err = np.abs(wv - deq)
        # property: the nearest code; slack 1e-6 for the f32 quotient w / s (<= 8·2^-24 steps off)
        assert np.all(err <= 0.5 * step * (1 + 1e-6)), f"int4 error {err.max()} above half a step"


def test_qtensor_passes_through_jit():
    """The reference evaluator jits over weights, QTensors included."""
    from mkdsl.lang.quant import register_pytree

    register_pytree()
    rng = np.random.default_rng(0)
    q = quantize(MXFP4, rng.standard_normal((64, 3)).astype(np.float32))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    (out,) = jax.jit(OPS["linear"].reference)(x, q)
    check_linear(np.asarray(out), x.astype(np.float64), mxfp4_decode(q.codes, q.scales), "jitted QTensor linear")


# ---------------------------------------------------------------- coverage

KNOWN_ATTRS = {  # the attributes the oracles above pass by name (ops not listed take none)
    "add": set(),
    "mul": set(),
    "sigmoid": set(),
    "silu": set(),
    "swiglu": set(),
    "softmax": set(),
    "embedding": set(),
    "linear": {"transposed", "input"},
    "argmax": set(),
    "softcap": {"cap"},
    "situ": {"beta", "linear_beta"},
    "rmsnorm": {"eps", "heads", "offset"},
    "rope": {"heads", "theta"},
    "attention": {"heads", "kv_heads", "scale"},
    "topk": {"k"},
    "layernorm": {"eps", "heads"},
}


def oracle_modules():
    """This module and every other tests/test_ops_*.py: each keeps `ORACLES` (op -> tests) and
    `KNOWN_ATTRS` (op -> attribute names its oracles pass) for the checks below."""
    here = Path(__file__).resolve()
    mods = []
    for path in sorted(here.parent.glob("test_ops_*.py")):
        if path == here:
            mods.append(sys.modules[__name__])
            continue
        mod = sys.modules.get(path.stem)
        if mod is None or Path(mod.__file__).resolve() != path:
            spec = importlib.util.spec_from_file_location(f"_oracles_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def test_every_op_has_an_oracle():
    covered: dict[str, list[str]] = {}
    for mod in oracle_modules():
        for op, tests in getattr(mod, "ORACLES", {}).items():
            assert op in OPS, f"{mod.__name__} has oracle tests for an unknown op `{op}`"
            for name in tests:
                assert name.startswith("test_") and callable(getattr(mod, name, None)), (mod.__name__, name)
            covered.setdefault(op, []).extend(tests)
    # Internal ops (collectives the shard pass inserts) are the identity on the whole-model values the
    # reference sees; their exchanges are checked by tests/test_comm.py and tests/test_shard.py.
    missing = sorted(op for op in set(OPS) - set(covered) if not OPS[op].internal)
    assert not missing, f"ops without an oracle test in tests/test_ops_*.py: {missing}"
    assert set(ORACLES) >= set(KNOWN_ATTRS), "this module's ops must all be covered here"


def test_every_op_attribute_is_known_to_its_oracle():
    """Oracles pass attributes by name: an attribute added to or renamed in an op must show up."""
    known: dict[str, set[str]] = {}
    for mod in oracle_modules():
        known.update(getattr(mod, "KNOWN_ATTRS", {}))
    for op, opdef in OPS.items():
        if opdef.internal:
            continue
        assert op in known, f"no oracle module lists the attributes of `{op}` in KNOWN_ATTRS"
        assert set(opdef.attrs) == known[op], f"{op} attributes changed: update its oracle"


def test_every_weight_format_has_a_linear_oracle():
    formats = {name for name in ALL_NAMES if name != "i32"}
    missing = sorted(formats - LINEAR_FORMATS)
    assert not missing, f"linear has no oracle test for weight formats {missing}"
