"""The block drafter's ops (`block_attention`, `markov_argmax`) against independent numpy oracles.

The oracles are written from the DSpark description (facts/kimi_k3.md, "The DSpark drafter") in
float64 with explicit loops over rows, heads, slots and vocabulary; they never call a jnp
reference or an mkdsl helper. Inputs are random (Hypothesis-drawn seeds), never all zero, and
every reference output is checked to be free of NaN.

Tolerances:

* slot writes (caches, slot positions) and `markov_argmax`: exact. The Markov oracle forms each
  row's biased logits in float64; a draw whose best and runner-up are closer than 1e-4 of the
  row's scale (far above the f32 error of a rank-<= 16 product, <= 16·2^-24 relative) is
  redrawn (`assume`), so the argmax cannot tip on rounding.
* `block_attention`'s output: `ATOL` = 1e-5 · max|v|, per element. Queries and softmax weights are
  rounded to bf16 before the products against bf16 caches (the MXU contract, ops/attention.py),
  which the oracle does too (its own bit arithmetic); what remains is f32 rounding of <= 2·(S + B)
  terms of at most max|v|: (2·(64 + 8) + 8)·2^-24 = 9e-6 relative at the largest shapes, and the
  softmax weights' own rounding e_s <= 1e-6; a wrong mask moves the output by O(max|v|/n).
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mkdsl.ops import OPS

SEEDS = st.integers(0, 2**32 - 1)
FEW = settings(max_examples=4, deadline=None)
ATOL = 1e-5  # relative to max|v|; see the docstring

ORACLES: dict[str, list[str]] = {
    "block_attention": ["test_block_attention"],
    "markov_argmax": ["test_markov_argmax"],
    "concat": ["test_concat"],
}
KNOWN_ATTRS = {"block_attention": {"heads", "kv_heads", "scale", "window"}, "markov_argmax": set(), "concat": set()}


def bf16(x) -> np.ndarray:
    """Nearest bf16 (ties to even) as float64, by bit arithmetic on the f32 value."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def _attention_oracle(q, k, v, ck, cv, kc, vc, sp, cpos, pos, heads, kvh, window):
    """Write the context rows into their slots, then per row and head: softmax over the slots the
    anchor may see and the block's rows up to this one."""
    size, dk = kc.shape[1], kc.shape[2]
    kc, vc, sp = bf16(kc), bf16(vc), sp.copy()
    for i, p in enumerate(cpos):
        if p >= 0:
            for h in range(kvh):
                kc[h, p % size] = bf16(ck[i, h * dk : (h + 1) * dk])
                vc[h, p % size] = bf16(cv[i, h * dk : (h + 1) * dk])
            sp[p % size] = p
    b, g, anchor = q.shape[0], heads // kvh, pos[0]
    out = np.zeros((b, heads * dk))
    for r in range(b):
        for hq in range(heads):
            h = hq // g
            qh = bf16(q[r, hq * dk : (hq + 1) * dk])
            keys, vals = [], []
            for t in range(size):
                if 0 <= sp[t] < anchor and (window is None or sp[t] > anchor - window):
                    keys.append(kc[h, t])
                    vals.append(vc[h, t])
            for c in range(r + 1):
                keys.append(bf16(k[c, h * dk : (h + 1) * dk]))
                vals.append(bf16(v[c, h * dk : (h + 1) * dk]))
            s = np.array([qh @ kk for kk in keys]) * dk**-0.5
            e = np.exp(s - s.max())
            out[r, hq * dk : (hq + 1) * dk] = (bf16(e) @ np.array(vals)) / e.sum()
    return out, kc, vc, sp


@FEW
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 8]),
    kvh=st.sampled_from([1, 2]),
    g=st.sampled_from([1, 3]),
    size=st.sampled_from([16, 64]),
    window=st.sampled_from([None, 5, 40]),
)
def test_block_attention(seed, b, kvh, g, size, window):
    """Context rows written at their slots (one row left empty, -1), older slots kept, a window
    that cuts some; each block row sees what the anchor may see and the block up to itself."""
    rng = np.random.default_rng(seed)
    heads, dk = kvh * g, 64
    anchor = int(rng.integers(b + 1, 3 * size))
    q = rng.standard_normal((b, heads * dk)).astype(np.float32)
    k, v, ck, cv = (rng.standard_normal((b, kvh * dk)).astype(np.float32) for _ in range(4))
    kc, vc = (rng.standard_normal((kvh, size, dk)).astype(ml_dtypes.bfloat16) for _ in range(2))
    sp = np.where(rng.random(size) < 0.8, rng.integers(0, anchor + b, size), -1).astype(np.int32)
    cpos = (anchor - b + np.arange(b)).astype(np.int32)
    cpos[0] = -1  # a row with no context
    pos = (anchor + np.arange(b)).astype(np.int32)
    ref = jax.jit(
        functools.partial(OPS["block_attention"].reference, heads=heads, kv_heads=kvh, scale=None, window=window)
    )
    got = ref(q, k, v, ck, cv, kc, vc, sp, cpos, pos)
    want = _attention_oracle(
        q, k, v, ck, cv, kc.astype(np.float64), vc.astype(np.float64), sp, cpos, pos, heads, kvh, window
    )
    out = np.asarray(got[0], np.float64)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(
        out, want[0], rtol=0, atol=ATOL * np.abs(v).max() + ATOL * np.abs(vc.astype(np.float64)).max()
    )
    for got_c, want_c in zip(got[1:3], want[1:3]):
        np.testing.assert_array_equal(np.asarray(got_c).astype(np.float64), want_c)
    np.testing.assert_array_equal(np.asarray(got[3]), want[3])


def _markov_oracle(logits, tokens, w1, w2):
    prev, out = int(tokens[0]), []
    for r in range(logits.shape[0]):
        row = [logits[r, t] + sum(w2[t, j] * w1[prev, j] for j in range(w1.shape[1])) for t in range(logits.shape[1])]
        prev = int(np.argmax(row))
        out.append(prev)
    return np.array(out)


@FEW
@given(seed=SEEDS, b=st.sampled_from([1, 4, 8]), vocab=st.sampled_from([37, 128]), rank=st.sampled_from([4, 16]))
def test_markov_argmax(seed, b, vocab, rank):
    """Each draft is the argmax of its row's logits plus the bias of the draft before it (the
    anchor before the first): a bias strong enough to change the plain argmax in most rows."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((b, vocab)).astype(np.float32)
    w1, w2 = (rng.standard_normal((vocab, rank)).astype(ml_dtypes.bfloat16) for _ in range(2))
    tokens = rng.integers(0, vocab, b).astype(np.int32)
    w1f, w2f = w1.astype(np.float64), w2.astype(np.float64)
    prev = int(tokens[0])
    for r in range(b):  # no near ties (see the docstring)
        row = np.sort(logits[r] + w2f @ w1f[prev])
        assume(row[-1] - row[-2] > 1e-4 * (1 + abs(row[-1])))
        prev = int(np.argmax(logits[r] + w2f @ w1f[prev]))
    (got,) = OPS["markov_argmax"].reference(logits, tokens, w1, w2)
    want = _markov_oracle(logits.astype(np.float64), tokens, w1f, w2f)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_markov_bias_matters():
    """The bias is read from the previous draft, not the anchor, after row 0: a case built so that
    reading the anchor for every row picks other tokens."""
    vocab = 4
    w1 = np.array([[0.0], [0.0], [1.0], [0.0]], ml_dtypes.bfloat16)  # only token 2 carries a bias
    w2 = np.array([[0.0], [0.0], [0.0], [8.0]], ml_dtypes.bfloat16)  # ... towards token 3
    logits = np.array([[0, 0, 5, 0], [1, 0, 0, 0], [1, 0, 0, 0]], np.float32)
    tokens = np.array([0, 9, 9], np.int32)[:3] % vocab
    (got,) = OPS["markov_argmax"].reference(logits, tokens, w1, w2)
    # row 0: anchor 0 has no bias -> 2; row 1: previous 2 biases 3 by 8 -> 3; row 2: previous 3 -> 0
    np.testing.assert_array_equal(np.asarray(got), [2, 3, 0])
    assert jax.numpy.asarray(got).dtype == np.int32


@FEW
@given(seed=SEEDS, b=st.sampled_from([1, 3]), na=st.sampled_from([1, 128]), nb=st.sampled_from([5, 256]))
def test_concat(seed, b, na, nb):
    """Exact: row r is a's row r, then b's, as f32 (bf16 inputs widen exactly)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((b, na)).astype(ml_dtypes.bfloat16)
    c = rng.standard_normal((b, nb)).astype(np.float32)
    (got,) = OPS["concat"].reference(a, c)
    want = np.zeros((b, na + nb))
    for r in range(b):
        want[r, :na], want[r, na:] = a[r].astype(np.float64), c[r]
    assert np.asarray(got).dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
