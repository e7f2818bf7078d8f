"""The `recurrent` family (Gated DeltaNet / KDA delta rule; Mamba2, GLA, RetNet outer product) against an
independent float64 numpy oracle.

The oracle is written from the decode equations in facts/models.md section 3 with explicit loops
over rows, value heads and channels: value head h reads key head h // (heads / key_heads); the
decay alpha = exp(g) is one scalar per (row, head) (Gated DeltaNet) or one per key channel (KDA);
it scales the state before the read-out m = Sᵀk, then d = beta·(v - m), S += k dᵀ, o = Sᵀq.
It never calls a jnp reference or an mkdsl helper. Inputs are random (seeds drawn by Hypothesis)
and never all zero; every reference output is checked to be free of NaN.

Tolerance (elementwise |got - want| <= ATOL·mag + RTOL·|want|): `mag` is the sum of |terms|
behind each state and output element, the scale f32 rounding errors are relative to when terms
cancel. Each result is formed by at most ~64 f32 roundings (2^-24 = 6e-8 each) of those
magnitudes (sums of <= 32 terms, dk <= 16), a worst case of <= 3.8e-6 of them: 1e-5 is >= 2.6x
that, while a wrong head mapping or decay is off by O(1).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mkdsl.lang.dtypes import F32
from mkdsl.lang.ir import TensorType
from mkdsl.ops import OPS, REQUIRED, Operand, OpError

RTOL = 1e-5  # >= 2.6x the <= 64 f32 roundings (2^-24 each) of a result here, relative to it
ATOL = 1e-5  # the same, relative to the sum of |terms| the result is formed from
SEEDS = st.integers(0, 2**32 - 1)
SOME = settings(max_examples=15, deadline=None)

ORACLES: dict[str, list[str]] = {}  # op name -> tests comparing it with an oracle (merged by test_ops_oracle)


def oracle_for(*ops: str):
    def mark(test):
        for op in ops:
            ORACLES.setdefault(op, []).append(test.__name__)
        return test

    return mark


@functools.cache
def _jitted(name: str, attrs: tuple):
    ref, kw = OPS[name].reference, dict(attrs)
    return jax.jit(lambda *args: ref(*args, **kw))


def run(name: str, *args, **attrs) -> list[np.ndarray]:
    attrs = {k: v for k, v in OPS[name].attrs.items() if v is not REQUIRED} | attrs
    outs = [np.asarray(o) for o in _jitted(name, tuple(sorted(attrs.items())))(*args)]
    for o in outs:
        assert not np.isnan(o.astype(np.float64)).any(), f"{name} produced NaN"
    return outs


def close(got, want, atol, rtol=RTOL, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, bound = np.abs(got - want), atol + rtol * np.abs(want)
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{what}: worst at {i}: got {got[i]!r}, want {want[i]!r}, bound {bound[i]:.3g}"


def f32(rng, shape, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    assert np.any(x != 0)
    return x


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def recurrent_oracle(q, k, v, g, beta, state, heads, key_heads, rule="delta"):
    """facts §3 step 4 per row and value head, and the plain gated outer product of Mamba2 /
    GLA / RetNet (rule "outer": S = alpha·S + k (beta·v)ᵀ, o = Sᵀq). g is None (alpha = 1), a
    [heads] constant, [B, heads] (scalar decay) or [B, heads·dk]; beta None is 1.
    Returns (o, new state, Σ|terms| of o, Σ|terms| of the state)."""
    b = q.shape[0]
    dk, dv = state.shape[2], state.shape[3]
    group = heads // key_heads
    out, out_mag = np.empty((b, heads * dv)), np.empty((b, heads * dv))
    new, new_mag = np.empty(state.shape), np.empty(state.shape)
    for r in range(b):
        for h in range(heads):
            kh = h // group
            kk, qq = k[r, kh * dk : (kh + 1) * dk], q[r, kh * dk : (kh + 1) * dk]
            vv = v[r, h * dv : (h + 1) * dv]
            bb = 1.0 if beta is None else beta[r, h]
            s = np.empty((dk, dv))
            for i in range(dk):
                if g is None:
                    alpha = 1.0
                elif g.ndim == 1:
                    alpha = np.exp(g[h])
                else:
                    alpha = np.exp(g[r, h * dk + i] if g.shape[1] != heads else g[r, h])
                for j in range(dv):
                    s[i, j] = alpha * state[r, h, i, j]
            d, dmag = np.empty(dv), np.empty(dv)
            for j in range(dv):
                if rule == "delta":
                    m = sum(s[i, j] * kk[i] for i in range(dk))
                    d[j] = bb * (vv[j] - m)
                    dmag[j] = abs(bb) * (abs(vv[j]) + sum(abs(s[i, j] * kk[i]) for i in range(dk)))
                else:
                    d[j], dmag[j] = bb * vv[j], abs(bb * vv[j])
            mag = np.abs(s) + np.abs(kk)[:, None] * dmag[None, :]
            for i in range(dk):
                for j in range(dv):
                    s[i, j] += kk[i] * d[j]
            for j in range(dv):
                out[r, h * dv + j] = sum(s[i, j] * qq[i] for i in range(dk))
                out_mag[r, h * dv + j] = sum(mag[i, j] * abs(qq[i]) for i in range(dk))
            new[r, h], new_mag[r, h] = s, mag
    return out, new, out_mag, new_mag


def _inputs(rng, b, heads, key_heads, dk, dv, sscale):
    kraw = rng.standard_normal((b, key_heads, dk))
    k = (kraw / np.linalg.norm(kraw, axis=-1, keepdims=True)).reshape(b, key_heads * dk).astype(np.float32)
    q = f32(rng, (b, key_heads * dk), dk**-0.5)
    return q, k, f32(rng, (b, heads * dv)), f32(rng, (b, heads, dk, dv), sscale)


def _check(q, k, v, s0, g, beta, heads, key_heads, rule):
    """The op against the oracle; g precedes beta, so a call giving beta gives g."""
    args = [q, k, v, s0] + [a for a in (g, beta) if a is not None]
    o, s1 = run("recurrent", *args, heads=heads, key_heads=key_heads, rule=rule)
    to64 = lambda a: None if a is None else a.astype(np.float64)  # noqa: E731
    want_o, want_s, mag_o, mag_s = recurrent_oracle(*(to64(a) for a in (q, k, v, g, beta, s0)), heads, key_heads, rule)
    assert o.dtype == np.float32 and s1.dtype == np.float32
    close(s1, want_s, ATOL * mag_s, RTOL, "state")
    close(o, want_o, ATOL * mag_o, RTOL, "output")


@oracle_for("recurrent")
@SOME
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3]),
    heads_keys=st.sampled_from([(2, 1), (4, 2), (6, 3), (2, 2)]),
    dk=st.sampled_from([1, 8, 16]),
    dv=st.sampled_from([4, 16]),
    scalar=st.booleans(),
    sscale=st.sampled_from([1e-2, 1.0, 5.0]),
)
def test_delta_rule_key_heads_and_scalar_decay(seed, b, heads_keys, dk, dv, scalar, sscale):
    heads, key_heads = heads_keys
    rng = np.random.default_rng(seed)
    q, k, v, s0 = _inputs(rng, b, heads, key_heads, dk, dv, sscale)
    # the Gated DeltaNet gate -exp(A_log)·softplus(a + dt_bias) lies in (-inf, 0); draw it in [-6, 0)
    g = (-6.0 * sigmoid(rng.standard_normal((b, heads if scalar else heads * dk)))).astype(np.float32)
    beta = sigmoid(rng.standard_normal((b, heads))).astype(np.float32)
    _check(q, k, v, s0, g, beta, heads, key_heads, "delta")


@oracle_for("recurrent")
@SOME
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 2]),
    heads_keys=st.sampled_from([(4, 1), (4, 2), (2, 2)]),
    dk=st.sampled_from([1, 8]),
    dv=st.sampled_from([4, 8]),
    rule=st.sampled_from(["outer", "delta"]),
    decay=st.sampled_from(["none", "const", "head", "key"]),
    with_beta=st.booleans(),
)
def test_recurrent_family_rules_and_decays(seed, b, heads_keys, dk, dv, rule, decay, with_beta):
    """Mamba2 (outer, a decay dt·A per head, beta = dt, one key group), GLA (outer, a decay per key
    channel, no beta), RetNet (outer, a constant decay per head, no beta), DeltaNet (delta, no decay)
    and the other mixes. A call without g gives no beta (g precedes it)."""
    heads, key_heads = heads_keys
    rng = np.random.default_rng(seed)
    q, k, v, s0 = _inputs(rng, b, heads, key_heads, dk, dv, 1.0)
    dt = np.log1p(np.exp(rng.standard_normal((b, heads)))).astype(np.float32)  # softplus(.) > 0
    g = {
        "none": None,
        "const": np.log(1.0 - 2.0 ** (-5.0 - np.arange(heads))).astype(np.float32),  # RetNet's log gamma_h
        "head": (-dt * np.exp(rng.standard_normal(heads))).astype(np.float32),  # Mamba2's dt·A, A = -exp(A_log)
        "key": (-6.0 * sigmoid(rng.standard_normal((b, heads * dk)))).astype(np.float32),
    }[decay]
    beta = dt if with_beta and g is not None else None
    _check(q, k, v, s0, g, beta, heads, key_heads, rule)


def val(shape, name="x"):
    return Operand(TensorType(F32, tuple(shape)), "value", name)


def state(shape, name="s"):
    return Operand(TensorType(F32, tuple(shape)), "tensor", name, is_state=True)


def infer(args, **attrs):
    op = OPS["recurrent"]
    return op.infer(args, {k: v for k, v in op.attrs.items() if v is not REQUIRED} | attrs)


def weight(shape, name="w"):
    return Operand(TensorType(F32, tuple(shape)), "tensor", name)


def test_shape_rule_accepts_qwen3_next_shapes():
    """16 key heads of 128 for 32 value heads of 128, one decay per head."""
    b = "B"
    qk, v, g = val((b, 16 * 128)), val((b, 32 * 128)), val((b, 32))
    args = [qk, qk, v, state((b, 32, 128, 128)), g, val((b, 32))]
    assert infer(args, heads=32, key_heads=16) == (TensorType(F32, (b, 32 * 128)),)
    args[4] = val((b, 32 * 128))  # a per-channel decay is still accepted
    assert infer(args, heads=32, key_heads=16) == (TensorType(F32, (b, 32 * 128)),)
    args[4] = weight((32,))  # a constant decay per head (RetNet)
    assert infer(args[:5], heads=32, key_heads=16, rule="outer") == (TensorType(F32, (b, 32 * 128)),)
    assert infer(args[:4], heads=32, key_heads=16, rule="outer") == (TensorType(F32, (b, 32 * 128)),)


S4 = state(("B", 4, 4, 4))
BAD = [
    # (operands, attrs, blamed arg, message fragment)
    (
        [val(("B", 8))] * 3 + [S4, val(("B", 8)), val(("B", 4))],
        {"heads": 4, "key_heads": 3},
        "key_heads",
        "not a multiple",
    ),
    ([val(("B", 8))] * 3 + [S4, val(("B", 8)), val(("B", 4))], {"heads": 4, "key_heads": 0}, "key_heads", "positive"),
    ([val(("B", 16))] * 3 + [S4, val(("B", 4)), val(("B", 4))], {"heads": 4, "key_heads": 2}, 0, "2 key heads"),
    (
        [val(("B", 8)), val(("B", 8)), val(("B", 16)), S4, val(("B", 3)), val(("B", 4))],
        {"heads": 4, "key_heads": 2},
        4,
        "expected 4 (one decay per head) or 16 (one per key channel)",
    ),
    ([val(("B", 8)), val(("B", 8)), val(("B", 16)), S4, weight((3,))], {"heads": 4, "key_heads": 2}, 4, "heads=4"),
    (
        [val(("B", 8)), val(("B", 8)), val(("B", 16)), S4],
        {"heads": 4, "key_heads": 2, "rule": "mamba"},
        "rule",
        "one of",
    ),
]


@pytest.mark.parametrize("args, attrs, arg, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_shape_rule_rejects_bad_operands(args, attrs, arg, message):
    with pytest.raises(OpError) as err:
        infer(args, **attrs)
    assert message in str(err.value) and err.value.arg == arg, (err.value.arg, str(err.value))


def conv_oracle(x, w, state, bias, act):
    """facts §3's causal depthwise conv per row and channel: sum over the K-1 previous inputs and
    x of tap times input, plus the bias, then SiLU (or nothing)."""
    b, c = x.shape
    taps = w.shape[0]
    y, mag = np.empty((b, c)), np.empty((b, c))
    for r in range(b):
        for j in range(c):
            terms = [state[r, t, j] * w[t, j] for t in range(taps - 1)] + [x[r, j] * w[taps - 1, j]]
            terms += [bias[j]] if bias is not None else []
            z = sum(terms)
            y[r, j] = z / (1.0 + np.exp(-z)) if act == "silu" else z
            mag[r, j] = sum(abs(t) for t in terms)
    return y, mag


@oracle_for("short_conv")
@SOME
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3]),
    c=st.sampled_from([4, 16]),
    taps=st.sampled_from([2, 4]),
    with_bias=st.booleans(),
    act=st.sampled_from(["silu", "none"]),
)
def test_short_conv_bias_and_activation(seed, b, c, taps, with_bias, act):
    """Mamba2's conv1d (bias, then SiLU) and the bias with the activation left to the spec."""
    rng = np.random.default_rng(seed)
    x, w, s0 = f32(rng, (b, c)), f32(rng, (taps, c), 0.5), f32(rng, (b, taps - 1, c))
    bias = f32(rng, (c,)) if with_bias else None
    y, s1 = run("short_conv", *[a for a in (x, w, s0, bias) if a is not None], act=act)
    want, mag = conv_oracle(*(None if a is None else a.astype(np.float64) for a in (x, w, s0, bias)), act)
    close(y, want, ATOL * mag, RTOL, "conv output")
    assert np.array_equal(s1, np.concatenate([s0[:, 1:], x[:, None, :]], axis=1))  # the window shifts in x
