"""Gated DeltaNet (Qwen3-Next) forms of `delta_rule` against an independent float64 numpy oracle.

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


def gated_delta_oracle(q, k, v, g, beta, state, heads, key_heads):
    """facts §3 step 4 per row and value head; g is [B, heads] (scalar decay) or [B, heads·dk].
    Returns (o, new state, Σ|terms| of o, Σ|terms| of the state)."""
    b = q.shape[0]
    dk, dv = state.shape[2], state.shape[3]
    group = heads // key_heads
    per_channel = g.shape[1] != heads
    out, out_mag = np.empty((b, heads * dv)), np.empty((b, heads * dv))
    new, new_mag = np.empty(state.shape), np.empty(state.shape)
    for r in range(b):
        for h in range(heads):
            kh = h // group
            kk, qq = k[r, kh * dk : (kh + 1) * dk], q[r, kh * dk : (kh + 1) * dk]
            vv = v[r, h * dv : (h + 1) * dv]
            s = np.empty((dk, dv))
            for i in range(dk):
                alpha = np.exp(g[r, h * dk + i] if per_channel else g[r, h])
                for j in range(dv):
                    s[i, j] = alpha * state[r, h, i, j]
            d, dmag = np.empty(dv), np.empty(dv)
            for j in range(dv):
                m = sum(s[i, j] * kk[i] for i in range(dk))
                d[j] = beta[r, h] * (vv[j] - m)
                dmag[j] = abs(beta[r, h]) * (abs(vv[j]) + sum(abs(s[i, j] * kk[i]) for i in range(dk)))
            mag = np.abs(s) + np.abs(kk)[:, None] * dmag[None, :]
            for i in range(dk):
                for j in range(dv):
                    s[i, j] += kk[i] * d[j]
            for j in range(dv):
                out[r, h * dv + j] = sum(s[i, j] * qq[i] for i in range(dk))
                out_mag[r, h * dv + j] = sum(mag[i, j] * abs(qq[i]) for i in range(dk))
            new[r, h], new_mag[r, h] = s, mag
    return out, new, out_mag, new_mag


@oracle_for("delta_rule")
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
    kraw = rng.standard_normal((b, key_heads, dk))
    k = (kraw / np.linalg.norm(kraw, axis=-1, keepdims=True)).reshape(b, key_heads * dk).astype(np.float32)
    q = f32(rng, (b, key_heads * dk), dk**-0.5)
    v = f32(rng, (b, heads * dv))
    # the Gated DeltaNet gate -exp(A_log)·softplus(a + dt_bias) lies in (-inf, 0); draw it in [-6, 0)
    g = (-6.0 * sigmoid(rng.standard_normal((b, heads if scalar else heads * dk)))).astype(np.float32)
    beta = sigmoid(rng.standard_normal((b, heads))).astype(np.float32)
    s0 = f32(rng, (b, heads, dk, dv), sscale)
    o, s1 = run("delta_rule", q, k, v, g, beta, s0, heads=heads, key_heads=key_heads)
    want_o, want_s, mag_o, mag_s = gated_delta_oracle(
        *(a.astype(np.float64) for a in (q, k, v, g, beta, s0)), heads, key_heads
    )
    assert o.dtype == np.float32 and s1.dtype == np.float32
    close(s1, want_s, ATOL * mag_s, RTOL, "state")
    close(o, want_o, ATOL * mag_o, RTOL, "output")


def val(shape, name="x"):
    return Operand(TensorType(F32, tuple(shape)), "value", name)


def state(shape, name="s"):
    return Operand(TensorType(F32, tuple(shape)), "tensor", name, is_state=True)


def infer(args, **attrs):
    op = OPS["delta_rule"]
    return op.infer(args, {k: v for k, v in op.attrs.items() if v is not REQUIRED} | attrs)


def test_shape_rule_accepts_qwen3_next_shapes():
    """16 key heads of 128 for 32 value heads of 128, one decay per head."""
    b = "B"
    qk, v, g = val((b, 16 * 128)), val((b, 32 * 128)), val((b, 32))
    args = [qk, qk, v, g, val((b, 32)), state((b, 32, 128, 128))]
    assert infer(args, heads=32, key_heads=16) == (TensorType(F32, (b, 32 * 128)),)
    args[3] = val((b, 32 * 128))  # a per-channel decay is still accepted
    assert infer(args, heads=32, key_heads=16) == (TensorType(F32, (b, 32 * 128)),)


BAD = [
    # (operands, attrs, blamed arg, message fragment)
    (
        [val(("B", 8))] * 4 + [val(("B", 4)), state(("B", 4, 4, 4))],
        {"heads": 4, "key_heads": 3},
        "key_heads",
        "not a multiple",
    ),
    (
        [val(("B", 8))] * 4 + [val(("B", 4)), state(("B", 4, 4, 4))],
        {"heads": 4, "key_heads": 0},
        "key_heads",
        "positive",
    ),
    ([val(("B", 16))] * 4 + [val(("B", 4)), state(("B", 4, 4, 4))], {"heads": 4, "key_heads": 2}, 0, "2 key heads"),
    (
        [val(("B", 8)), val(("B", 8)), val(("B", 16)), val(("B", 3)), val(("B", 4)), state(("B", 4, 4, 4))],
        {"heads": 4, "key_heads": 2},
        3,
        "(or 4, one decay per head)",
    ),
]


@pytest.mark.parametrize("args, attrs, arg, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_shape_rule_rejects_bad_operands(args, attrs, arg, message):
    with pytest.raises(OpError) as err:
        infer(args, **attrs)
    assert message in str(err.value) and err.value.arg == arg, (err.value.arg, str(err.value))
