"""Kimi K3's KDA and attention-residual ops against independent numpy oracles.

The oracles are written from the equations in facts/kimi_k3.md in float64 with explicit loops
over rows, heads and channels; they never call a jnp reference or an mkdsl helper. Inputs are
random (seeds drawn by Hypothesis), never all zero, and every reference output is checked to
be free of NaN. Tolerances (elementwise |got - want| <= atol + rtol·|want|):

* exact: the conv-state shift (a copy, or a cast to bf16 done by ml_dtypes), res_init and
  res_snapshot (copies);
* `RTOL` = 1e-5 with `ATOL` = 1e-5 scaled by the magnitude the result is formed from: for
  short_conv Σ_t |w_t·x_t| per channel; for l2norm, kda_gate and res_mix the largest input
  magnitude feeding the row (|lower| for the gate); for delta_rule and the multi-step KDA and
  residual sequences the largest magnitude of the compared array (row by row for the
  outputs). f32 rounding is 2^-24 = 6e-8 per operation, and every result here is formed by at
  most ~64 roundings of those magnitudes (sums of <= 64 terms; the KDA state's dk <= 16-term
  products), so a worst case of <= 3.8e-6 of them: 1e-5 is >= 2.6x that, while a wrong formula is
  off by O(1). The multi-step KDA check starts each step's oracle from the reference's states,
  the 30-layer residual-stream check each layer from the reference's stream: nothing compounds.

Observed worst error / tolerance over two draws (`ci`, `dev`): KDA over 4 steps 0.063x,
l2norm 0.019x, delta_rule 0.011x, res_mix 0.014x, short_conv 0.007x, kda_gate
0.006x, the 30-layer toy model 0.024x (0.18x before it was fed layer by layer).

`ORACLES` maps each op to the tests that compare it with an oracle; tests/test_ops_oracle.py
reads it (and `KNOWN_ATTRS`) for its every-op-has-an-oracle check.
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mkdsl.lang.dtypes import BF16, F32, I32, MXFP4
from mkdsl.lang.ir import TensorType
from mkdsl.ops import OPS, REQUIRED, Operand, OpError

RTOL = 1e-5  # >= 2.6x the <= 64 f32 roundings (2^-24 each) of a result here, relative to it
ATOL = 1e-5  # the same, relative to the magnitude the result is formed from (see the docstring)
SEEDS = st.integers(0, 2**32 - 1)
ROWS = st.sampled_from([1, 3, 8])
FEW = settings(max_examples=8, deadline=None)
SOME = settings(max_examples=15, deadline=None)

ORACLES: dict[str, list[str]] = {}  # op name -> tests comparing it with an oracle
KNOWN_ATTRS = {  # the attributes the oracles below pass by name
    "short_conv": {"act"},  # the bias and `act`: tests/test_ops_gdn.py
    "l2norm": {"heads", "scale", "eps"},
    "kda_gate": {"heads", "lower"},
    "recurrent": {"heads", "key_heads", "rule"},  # key_heads, the scalar decay, the rules: tests/test_ops_gdn.py
    "res_init": {"nblocks"},
    "res_mix": {"layer", "block", "after_snapshot", "eps"},
    "res_snapshot": {"layer", "block"},
}


def oracle_for(*ops: str):
    def mark(test):
        for op in ops:
            ORACLES.setdefault(op, []).append(test.__name__)
        return test

    return mark


# ---------------------------------------------------------------- helpers


@functools.cache
def _jitted(name: str, attrs: tuple):
    ref, kw = OPS[name].reference, dict(attrs)
    return jax.jit(lambda *args: ref(*args, **kw))


def run(name: str, *args, **attrs) -> list[np.ndarray]:
    """OPS[name].reference under jit with the registry's defaults for attributes not given."""
    attrs = {k: v for k, v in OPS[name].attrs.items() if v is not REQUIRED} | attrs
    outs = [np.asarray(o) for o in _jitted(name, tuple(sorted(attrs.items())))(*args)]
    assert len(outs) == OPS[name].outputs + len(OPS[name].inout), name
    for o in outs:
        assert not np.isnan(o.astype(np.float64)).any(), f"{name} produced NaN"
    return outs


def close(got, want, atol, rtol=RTOL, what=""):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want)
    bound = np.broadcast_to(atol + rtol * np.abs(want), err.shape)
    bad = err > bound
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    assert not bad.any(), (
        f"{what}: {bad.sum()} of {bad.size} outside tolerance; worst at {i}: "
        f"got {got[i]!r}, want {want[i]!r}, bound {bound[i]:.3g}"
    )


def exact(got, want, what=""):
    got = np.asarray(got)
    assert got.shape == np.shape(want), (what, got.shape, np.shape(want))
    assert np.array_equal(got.astype(np.float64), np.asarray(want, np.float64)), what


def rows_max(a):
    """Largest magnitude of each row (>= tiny), shaped to broadcast over the row."""
    return np.maximum(np.abs(a).reshape(a.shape[0], -1).max(axis=1), 1e-30).reshape(-1, *([1] * (a.ndim - 1)))


def f32(rng, shape, scale=1.0):
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    assert np.any(x != 0)
    return x


def bf16(rng, shape, scale=1.0):
    """A random bf16 array and its exact value in float64."""
    w = (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)
    assert np.any(w != 0)
    return w, w.astype(np.float64)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


# ---------------------------------------------------------------- oracles (float64, loops)


def short_conv_oracle(x, w, state):
    """y[b, c] = Σ_{t < K-1} w[t, c]·state[b, t, c] + w[K-1, c]·x[b, c]; out silu(y).
    Returns (out, new state as float64 before any cast, Σ|terms| per element)."""
    b, c = x.shape
    k = w.shape[0]
    out, mag = np.empty((b, c)), np.empty((b, c))
    for r in range(b):
        for ch in range(c):
            terms = [w[t, ch] * state[r, t, ch] for t in range(k - 1)] + [w[k - 1, ch] * x[r, ch]]
            y = sum(terms)
            out[r, ch] = y * sigmoid(y)
            mag[r, ch] = sum(abs(t) for t in terms)
    new = np.empty_like(state, dtype=np.float64)
    for r in range(b):
        for t in range(k - 2):
            new[r, t] = state[r, t + 1]
        new[r, k - 2] = x[r]
    return out, new, mag


def l2norm_oracle(x, heads, scale, eps):
    b, n = x.shape
    d = n // heads
    out = np.empty((b, n))
    for r in range(b):
        for h in range(heads):
            seg = x[r, h * d : (h + 1) * d]
            norm2 = sum(float(v) ** 2 for v in seg)
            out[r, h * d : (h + 1) * d] = seg / np.sqrt(norm2 + eps) * scale
    return out


def kda_gate_oracle(f, a_log, dt_bias, heads, lower):
    b, n = f.shape
    d = n // heads
    out = np.empty((b, n))
    for r in range(b):
        for h in range(heads):
            for j in range(d):
                c = h * d + j
                out[r, c] = lower * sigmoid(np.exp(a_log[h]) * (f[r, c] + dt_bias[c]))
    return out


def delta_rule_oracle(q, k, v, g, beta, state, heads, magnitudes=False):
    """Per row and head: S' = exp(g)[:, None]·S; u = beta·(v - S'ᵀk); S = S' + k uᵀ; o = Sᵀq.
    With `magnitudes`, also the sums of |terms| behind each state and output element, the
    scale that f32 rounding errors are relative to when terms cancel."""
    b = q.shape[0]
    dk, dv = state.shape[2], state.shape[3]
    out, out_mag = np.empty((b, heads * dv)), np.empty((b, heads * dv))
    new, new_mag = np.empty(state.shape), np.empty(state.shape)
    for r in range(b):
        for h in range(heads):
            kh, qh, gh = (a[r, h * dk : (h + 1) * dk] for a in (k, q, g))
            vh = v[r, h * dv : (h + 1) * dv]
            s, mag = np.empty((dk, dv)), np.empty((dk, dv))
            for i in range(dk):
                for j in range(dv):
                    s[i, j] = np.exp(gh[i]) * state[r, h, i, j]
            u, umag = np.empty(dv), np.empty(dv)
            for j in range(dv):
                u[j] = beta[r, h] * (vh[j] - sum(s[i, j] * kh[i] for i in range(dk)))
                umag[j] = abs(beta[r, h]) * (abs(vh[j]) + sum(abs(s[i, j] * kh[i]) for i in range(dk)))
            for i in range(dk):
                for j in range(dv):
                    mag[i, j] = abs(s[i, j]) + abs(kh[i]) * umag[j]
                    s[i, j] += kh[i] * u[j]
            for j in range(dv):
                out[r, h * dv + j] = sum(s[i, j] * qh[i] for i in range(dk))
                out_mag[r, h * dv + j] = sum(mag[i, j] * abs(qh[i]) for i in range(dk))
            new[r, h], new_mag[r, h] = s, mag
    return (out, new, out_mag, new_mag) if magnitudes else (out, new)


def mix_oracle(entries, w, eps):
    """mix(V; w) = Σ_i softmax_i((v_i·w)·rsqrt(mean(v_i²)+eps))·v_i for one row."""
    logits = [float(np.dot(v, w)) / np.sqrt(np.mean(v * v) + eps) for v in entries]
    m = max(logits)
    e = [np.exp(z - m) for z in logits]
    total = sum(e)
    return sum((ei / total) * v for ei, v in zip(e, entries))


# ---------------------------------------------------------------- KDA ops, one step


@oracle_for("short_conv")
@SOME
@given(
    seed=SEEDS,
    b=ROWS,
    c=st.sampled_from([1, 8, 48]),
    taps=st.sampled_from([2, 4]),
    scale=st.sampled_from([1e-2, 1.0, 6.0]),
    state_dtype=st.sampled_from(["f32", "bf16"]),
)
def test_short_conv(seed, b, c, taps, scale, state_dtype):
    rng = np.random.default_rng(seed)
    x = f32(rng, (b, c), scale)
    w, wv = bf16(rng, (taps, c), 0.5)
    if state_dtype == "bf16":
        state, sv = bf16(rng, (b, taps - 1, c), scale)
    else:
        state = f32(rng, (b, taps - 1, c), scale)
        sv = state.astype(np.float64)
    out, new_state = run("short_conv", x, w, state)
    want, want_state, mag = short_conv_oracle(x.astype(np.float64), wv, sv)
    assert out.dtype == np.float32 and new_state.dtype == state.dtype
    close(out, want, ATOL * mag, RTOL, f"short_conv K={taps}")
    exact(new_state, want_state.astype(np.float32).astype(state.dtype), "conv state shifted, x appended")


@oracle_for("l2norm")
@SOME
@given(
    seed=SEEDS,
    b=ROWS,
    heads=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([1, 8, 64]),
    scale=st.sampled_from([1e-3, 1.0, 8.0]),
    attrs=st.sampled_from(["default", "q", "eps"]),
)
def test_l2norm(seed, b, heads, d, scale, attrs):
    rng = np.random.default_rng(seed)
    x = f32(rng, (b, heads * d), scale)
    kw = {"default": {}, "q": {"scale": d**-0.5}, "eps": {"eps": 0.5}}[attrs]
    (out,) = run("l2norm", x, heads=heads, **kw)
    want = l2norm_oracle(x.astype(np.float64), heads, kw.get("scale", 1.0), kw.get("eps", 1e-6))  # defaults
    close(out, want, 1e-30, RTOL, f"l2norm heads={heads} {kw}")


@oracle_for("kda_gate")
@SOME
@given(
    seed=SEEDS,
    b=ROWS,
    heads=st.sampled_from([1, 3]),
    d=st.sampled_from([1, 16]),
    scale=st.sampled_from([0.1, 1.0, 4.0]),
    lower=st.sampled_from([None, -5.0, -1.0]),
    adt=st.sampled_from(["f32", "bf16"]),
)
def test_kda_gate(seed, b, heads, d, scale, lower, adt):
    rng = np.random.default_rng(seed)
    f = f32(rng, (b, heads * d), scale)
    if adt == "bf16":
        a_log, av = bf16(rng, (heads,))
        dt_bias, dv = bf16(rng, (heads * d,))
    else:
        a_log, dt_bias = f32(rng, (heads,)), f32(rng, (heads * d,))
        av, dv = a_log.astype(np.float64), dt_bias.astype(np.float64)
    kw = {"heads": heads} | ({} if lower is None else {"lower": lower})
    (out,) = run("kda_gate", f, a_log, dt_bias, **kw)
    lo = -5.0 if lower is None else lower  # the documented default
    want = kda_gate_oracle(f.astype(np.float64), av, dv, heads, lo)
    assert np.all(out <= 0) and np.all(out >= lo)
    close(out, want, ATOL * abs(lo), RTOL, f"kda_gate {kw}")


def kda_inputs(rng, b, heads, dk, dv, normalise: bool):
    """q, k, v, g, beta as the layer makes them: g in [lower, 0], beta in (0, 1); with
    `normalise` k has unit norm per head (as after l2norm), else any scale."""
    q = f32(rng, (b, heads * dk), dk**-0.5)
    k = f32(rng, (b, heads * dk))
    if normalise:
        kh = k.reshape(b, heads, dk).astype(np.float64)
        k = (kh / np.linalg.norm(kh, axis=-1, keepdims=True)).reshape(b, heads * dk).astype(np.float32)
    else:
        k *= np.float32(0.5 / np.sqrt(dk))
    v = f32(rng, (b, heads * dv))
    g = (-5.0 * sigmoid(rng.standard_normal((b, heads * dk)))).astype(np.float32)
    beta = sigmoid(rng.standard_normal((b, heads))).astype(np.float32)
    return q, k, v, g, beta


@oracle_for("recurrent")
@SOME
@given(
    seed=SEEDS,
    b=ROWS,
    heads=st.sampled_from([1, 2]),
    dk=st.sampled_from([1, 8, 16]),
    dv=st.sampled_from([1, 8, 16]),
    normalise=st.booleans(),
    sscale=st.sampled_from([1e-2, 1.0, 5.0]),
)
def test_delta_rule(seed, b, heads, dk, dv, normalise, sscale):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta = kda_inputs(rng, b, heads, dk, dv, normalise)
    state = f32(rng, (b, heads, dk, dv), sscale)
    o, new_state = run("recurrent", q, k, v, state, g, beta, heads=heads)
    args64 = [a.astype(np.float64) for a in (q, k, v, g, beta, state)]
    want_o, want_s, mag_o, mag_s = delta_rule_oracle(*args64, heads, magnitudes=True)
    assert o.dtype == np.float32 and new_state.dtype == np.float32
    # Errors are relative to the magnitudes of the summed terms (an output can cancel to ~0).
    close(new_state, want_s, ATOL * mag_s, RTOL, "delta_rule state")
    close(o, want_o, ATOL * mag_o, RTOL, "delta_rule output")


# ---------------------------------------------------------------- KDA over several decode steps


@oracle_for("short_conv", "l2norm", "kda_gate", "recurrent")
@FEW
@given(
    seed=SEEDS,
    b=st.sampled_from([1, 3]),
    heads=st.sampled_from([1, 2]),
    d=st.sampled_from([4, 16]),
    taps=st.sampled_from([2, 4]),
)
def test_kda_several_steps(seed, b, heads, d, taps):
    """A KDA layer's recurrent core for 4 decode steps, each op's state fed back: q/k/v through
    their own short convs, q and k L2-normalised per head (q scaled by d^-0.5), the gate from
    a_log/dt_bias, then the delta rule. States and outputs are compared after every step; each
    step the oracle starts from the reference's states (so rounding never compounds over steps)."""
    rng = np.random.default_rng(seed)
    n = heads * d
    conv_w = {s: bf16(rng, (taps, n), 0.5) for s in "qkv"}
    conv_state = {s: f32(rng, (b, taps - 1, n)) for s in "qkv"}
    a_log, dt_bias = f32(rng, (heads,), 0.5), f32(rng, (n,))
    state = f32(rng, (b, heads, d, d), 0.3)
    want_conv = {s: conv_state[s].astype(np.float64) for s in "qkv"}
    want_state = state.astype(np.float64)
    for step in range(4):
        xs = {s: f32(rng, (b, n)) for s in "qkv"}
        f = f32(rng, (b, n))
        beta = sigmoid(rng.standard_normal((b, heads))).astype(np.float32)

        conv_out = {}
        for s in "qkv":
            conv_out[s], conv_state[s] = run("short_conv", xs[s], conv_w[s][0], conv_state[s])
        (q,) = run("l2norm", conv_out["q"], heads=heads, scale=d**-0.5)
        (k,) = run("l2norm", conv_out["k"], heads=heads)
        (g,) = run("kda_gate", f, a_log, dt_bias, heads=heads)
        o, state = run("recurrent", q, k, conv_out["v"], state, g, beta, heads=heads)

        want_out = {}
        for s in "qkv":
            want_out[s], want_conv[s], _ = short_conv_oracle(xs[s].astype(np.float64), conv_w[s][1], want_conv[s])
        wq = l2norm_oracle(want_out["q"], heads, d**-0.5, 1e-6)
        wk = l2norm_oracle(want_out["k"], heads, 1.0, 1e-6)
        wg = kda_gate_oracle(f.astype(np.float64), a_log.astype(np.float64), dt_bias.astype(np.float64), heads, -5.0)
        wo, want_state = delta_rule_oracle(wq, wk, want_out["v"], wg, beta.astype(np.float64), want_state, heads)

        for s in "qkv":
            exact(conv_state[s], want_conv[s], f"step {step}: {s} conv state")
            close(conv_out[s], want_out[s], ATOL * rows_max(want_out[s]), RTOL, f"step {step}: {s} conv")
        close(q, wq, ATOL * rows_max(wq), RTOL, f"step {step}: q")
        close(k, wk, ATOL * rows_max(wk), RTOL, f"step {step}: k")
        close(g, wg, ATOL * 5.0, RTOL, f"step {step}: g")
        close(state, want_state, ATOL * rows_max(want_state), RTOL, f"step {step}: KDA state")
        close(o, wo, ATOL * rows_max(wo), RTOL, f"step {step}: output")
        want_conv = {s: conv_state[s].astype(np.float64) for s in "qkv"}  # the next step starts alike
        want_state = state.astype(np.float64)


# ---------------------------------------------------------------- attention residuals


def snapshots_before(layer: int, block: int, after_snapshot: bool) -> int:
    """How many snapshots the stream holds at this point: one at each l' in 1..layer
    (1..layer-1 before this layer's snapshot) with l' % block == 0."""
    last = layer if after_snapshot else layer - 1
    return sum(1 for lp in range(1, last + 1) if lp % block == 0)


@oracle_for("res_init")
@SOME
@given(seed=SEEDS, b=ROWS, h=st.sampled_from([1, 8, 32]), nblocks=st.integers(1, 5))
def test_res_init(seed, b, h, nblocks):
    x = f32(np.random.default_rng(seed), (b, h))
    blocks, prefix = run("res_init", x, nblocks=nblocks)
    want = np.zeros((b, nblocks * h))
    want[:, :h] = x
    exact(blocks, want, "blocks: x then zeros")
    exact(prefix, np.zeros((b, h)), "prefix starts at zero")
    assert blocks.dtype == prefix.dtype == np.float32


@oracle_for("res_mix")
@settings(max_examples=25, deadline=None)
@given(
    seed=SEEDS,
    b=ROWS,
    h=st.sampled_from([1, 8, 32]),
    layer=st.integers(0, 30),
    block=st.sampled_from([1, 4, 12]),
    after=st.booleans(),
    wscale=st.sampled_from([0.1, 1.0, 3.0]),
    wdt=st.sampled_from(["f32", "bf16"]),
    eps=st.sampled_from([None, 1e-6, 0.5]),
)
def test_res_mix(seed, b, h, layer, block, after, wscale, wdt, eps):
    """Every block holds random data, so mixing a block that is not valid yet (or the prefix at
    layer 0's attention input) changes the result."""
    rng = np.random.default_rng(seed)
    nb = 1 + snapshots_before(layer, block, True) + 1  # one spare block beyond the last valid one
    blocks = f32(rng, (b, nb * h), 2.0)
    prefix = f32(rng, (b, h))
    if wdt == "bf16":
        w, wv = bf16(rng, (h,), wscale / np.sqrt(h))
    else:
        w = f32(rng, (h,), wscale / np.sqrt(h))
        wv = w.astype(np.float64)
    kw = (
        {"layer": layer, "block": block}
        | ({"after_snapshot": True} if after else {})
        | ({} if eps is None else {"eps": eps})
    )
    (out,) = run("res_mix", blocks, prefix, w, **kw)
    e = 1e-5 if eps is None else eps  # the documented default
    valid = 1 + snapshots_before(layer, block, after)
    with_prefix = after or layer > 0
    want = np.empty((b, h))
    for r in range(b):
        entries = [blocks[r, i * h : (i + 1) * h].astype(np.float64) for i in range(valid)]
        if with_prefix:
            entries.append(prefix[r].astype(np.float64))
        want[r] = mix_oracle(entries, wv, e)
    if layer == 0 and not after:
        exact(out, blocks[:, :h], "layer 0's attention input is the embedding")
    close(out, want, ATOL * rows_max(np.concatenate([blocks, prefix], 1)), RTOL, f"res_mix {kw}")


@oracle_for("res_snapshot")
@SOME
@given(seed=SEEDS, b=ROWS, h=st.sampled_from([1, 8]), layer=st.integers(0, 30), block=st.sampled_from([1, 4, 12]))
def test_res_snapshot(seed, b, h, layer, block):
    rng = np.random.default_rng(seed)
    nb = 2 + layer // block
    blocks, prefix = f32(rng, (b, nb * h)), f32(rng, (b, h))
    new_blocks, new_prefix = run("res_snapshot", blocks, prefix, layer=layer, block=block)
    want_blocks, want_prefix = blocks.copy(), prefix.copy()
    if layer > 0 and layer % block == 0:  # a block boundary: the prefix becomes block number layer // block
        j = snapshots_before(layer, block, True)
        want_blocks[:, j * h : (j + 1) * h] = prefix
        want_prefix[:] = 0.0
    exact(new_blocks, want_blocks, f"blocks after layer {layer}'s snapshot")
    exact(new_prefix, want_prefix, f"prefix after layer {layer}'s snapshot")


def toy_sublayer(x, wmat):
    """A stand-in for attention or the MLP in the oracle: rms-normalise, project, tanh."""
    return np.tanh((x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)) @ wmat)


@functools.cache
def toy_model(layers: int, block: int):
    """The toy model through mkdsl's references, jitted as a whole as the reference evaluator
    jits a step: (emb, w_attn [L, H], w_mlp [L, H], m_attn [L, H, H], m_mlp [L, H, H], w_out) ->
    (attention inputs [L, B, H], MLP inputs [L, B, H], blocks and prefix after each layer
    [L, B, NB·H] and [L, B, H], output)."""
    import jax.numpy as jnp

    def sub(x, wmat):
        return jnp.tanh(x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) @ wmat)

    mix, snap = OPS["res_mix"].reference, OPS["res_snapshot"].reference

    def model(emb, w_attn, w_mlp, m_attn, m_mlp, w_out):
        blocks, prefix = OPS["res_init"].reference(emb, nblocks=1 + (layers - 1) // block)
        hs, ms, bs, ps = [], [], [], []
        for layer in range(layers):
            (h,) = mix(blocks, prefix, w_attn[layer], layer=layer, block=block, after_snapshot=False, eps=1e-5)
            blocks, prefix = snap(blocks, prefix, layer=layer, block=block)
            prefix = prefix + sub(h, m_attn[layer])
            (m,) = mix(blocks, prefix, w_mlp[layer], layer=layer, block=block, after_snapshot=True, eps=1e-5)
            prefix = prefix + sub(m, m_mlp[layer])
            hs.append(h)
            ms.append(m)
            bs.append(blocks)
            ps.append(prefix)
        (out,) = mix(blocks, prefix, w_out, layer=layers - 1, block=block, after_snapshot=True, eps=1e-5)
        return jnp.stack(hs), jnp.stack(ms), jnp.stack(bs), jnp.stack(ps), out

    return jax.jit(model)


@oracle_for("res_init", "res_mix", "res_snapshot")
@settings(max_examples=8, deadline=None)
@given(seed=SEEDS)
def test_residual_stream_toy_model(seed):
    """A toy model of 30 layers with block = 4 through res_init/res_mix/res_snapshot, against an
    oracle that keeps a Python list of blocks and the prefix exactly as facts/kimi_k3.md says:
    h = mix(attn_res[l]) over [blocks..., prefix] (no prefix yet at l = 0); if l % block == 0
    (l > 0) the prefix becomes a new block and restarts at a, else prefix + a; then
    m = MLP(mix(mlp_res[l])); prefix += m; finally the output mix after the last layer.
    Layer by layer, the oracle starts from the reference's own stream before the layer (its valid
    blocks, as the oracle's list says, and its prefix): rounding never compounds over the layers,
    while which block a snapshot fills, and what each mix reads, is still the oracle's."""
    b, h, layers, block = 3, 16, 30, 4
    rng = np.random.default_rng(seed)
    emb = f32(rng, (b, h))
    w_attn, w_mlp, w_out = (f32(rng, shape, 1.0 / np.sqrt(h)) for shape in ((layers, h), (layers, h), (h,)))
    m_attn, m_mlp = (f32(rng, (layers, h, h), 1.0 / np.sqrt(h)) for _ in range(2))
    outs = toy_model(layers, block)(emb, w_attn, w_mlp, m_attn, m_mlp, w_out)
    got_h, got_m, got_blocks, got_prefix, out = (np.asarray(o) for o in outs)
    for o in (got_h, got_m, got_blocks, got_prefix, out):
        assert np.isfinite(o).all()
    nblocks = 1 + (layers - 1) // block
    assert got_blocks.shape == (layers, b, nblocks * h)
    wa, wm, ma, mm = (a.astype(np.float64) for a in (w_attn, w_mlp, m_attn, m_mlp))
    exact(got_h[0], emb, "layer 0 attends to the embedding alone")
    exact(got_blocks[0, :, :h], emb, "blocks[0] is the embedding")

    # the oracle, row by row and layer by layer from the reference's stream before the layer
    for r in range(b):
        valid = 1  # blocks holding a value: the embedding, then one per snapshot
        for layer in range(layers):
            if layer == 0:
                stream, pre = [emb[r].astype(np.float64)], None  # no layer output yet
            else:
                blocks_before = got_blocks[layer - 1, r].astype(np.float64)
                stream = [blocks_before[i * h : (i + 1) * h] for i in range(valid)]
                pre = got_prefix[layer - 1, r].astype(np.float64)
            hin = mix_oracle(stream + ([] if pre is None else [pre]), wa[layer], 1e-5)
            a = toy_sublayer(hin, ma[layer])
            if layer % block == 0 and layer > 0:
                stream.append(pre)  # snapshot
                valid += 1
                pre = a
            else:
                pre = a if pre is None else pre + a
            m = mix_oracle(stream + [pre], wm[layer], 1e-5)
            pre = pre + toy_sublayer(m, mm[layer])
            scale = max(np.abs(v).max() for v in [*stream, pre])  # the largest magnitude mixed
            what = f"row {r} layer {layer}"
            close(got_h[layer, r], hin, ATOL * scale, RTOL, f"{what}: attention input")
            close(got_m[layer, r], m, ATOL * scale, RTOL, f"{what}: MLP input")
            close(got_prefix[layer, r], pre, ATOL * scale, RTOL, f"{what}: prefix")
            close(got_blocks[layer, r, : valid * h], np.concatenate(stream), ATOL * scale, RTOL, f"{what}: blocks")
        assert valid == nblocks
        final = [got_blocks[-1, r, i * h : (i + 1) * h].astype(np.float64) for i in range(nblocks)]
        want_out = mix_oracle([*final, got_prefix[-1, r].astype(np.float64)], w_out.astype(np.float64), 1e-5)
        close(out[r], want_out, ATOL * scale, RTOL, f"row {r}: output mix")


# ---------------------------------------------------------------- shape rules


def val(shape, dtype=F32, name="x"):
    return Operand(TensorType(dtype, tuple(shape)), "value", name)


def weight(shape, dtype=BF16, name="w"):
    return Operand(TensorType(dtype, tuple(shape)), "tensor", name)


def state(shape, dtype=F32, name="s"):
    return Operand(TensorType(dtype, tuple(shape)), "tensor", name, is_state=True)


def infer(op, args, **attrs):
    return OPS[op].infer(args, {k: v for k, v in OPS[op].attrs.items() if v is not REQUIRED} | attrs)


def test_shape_rules_accept_kimi_shapes():
    b, n = "B", 96 * 128
    assert infer("short_conv", [val((b, n)), weight((4, n)), state((b, 3, n))]) == (TensorType(F32, (b, n)),)
    assert infer("l2norm", [val((b, n))], heads=96, scale=128**-0.5) == (TensorType(F32, (b, n)),)
    assert infer("kda_gate", [val((b, n)), weight((96,), F32), weight((n,), F32)], heads=96) == (
        TensorType(F32, (b, n)),
    )
    st4 = state((b, 96, 128, 128))
    assert infer("recurrent", [val((b, n))] * 3 + [st4, val((b, n)), val((b, 96))], heads=96) == (
        TensorType(F32, (b, n)),
    )
    assert infer("res_init", [val((b, 7168))], nblocks=8) == (
        TensorType(F32, (b, 8 * 7168)),
        TensorType(F32, (b, 7168)),
    )
    stream = [val((b, 8 * 7168), name="blocks"), val((b, 7168), name="prefix")]
    assert infer("res_mix", [*stream, weight((7168,))], layer=92, block=12, after_snapshot=True) == (
        TensorType(F32, (b, 7168)),
    )
    assert infer("res_snapshot", stream, layer=84, block=12) == (
        TensorType(F32, (b, 8 * 7168)),
        TensorType(F32, (b, 7168)),
    )


BAD = [
    # (op, operands, attrs, blamed arg, message fragment)
    ("short_conv", [val(("B", 8)), val((4, 8)), state(("B", 3, 8))], {}, 1, "must be a declared weight"),
    ("short_conv", [val(("B", 8)), weight((4, 6)), state(("B", 3, 8))], {}, 1, "has 8 channels"),
    ("short_conv", [val(("B", 8)), weight((4, 8)), state(("B", 2, 8))], {}, 2, "expected [B, 3, 8]"),
    ("short_conv", [val(("B", 8)), weight((4, 8)), val(("B", 3, 8), name="s")], {}, 2, "must be a state tensor"),
    ("short_conv", [val(("B", 8)), weight((4, 8)), state(("B", 3, 8), I32)], {}, 2, "expected one of: f32, bf16"),
    ("short_conv", [val(("B", 8)), weight((1, 8)), state(("B", 0, 8))], {}, 1, "at least 2 taps"),
    ("short_conv", [val(("B", 8, 1)), weight((4, 8)), state(("B", 3, 8))], {}, 0, "must have rank 2"),
    ("l2norm", [val(("B", 10))], {"heads": 4}, "heads", "10 is not divisible by 4"),
    ("l2norm", [val(("B", 8), I32)], {}, 0, "floating-point"),
    ("l2norm", [val(("B", 8))], {"heads": 0}, "heads", "positive integer"),
    ("kda_gate", [val(("B", 8)), weight((3,)), weight((8,))], {"heads": 2}, 1, "a_log (one per head, heads=2)"),
    ("kda_gate", [val(("B", 8)), weight((2,)), weight((4,))], {"heads": 2}, 2, "dt_bias (one per channel"),
    ("kda_gate", [val(("B", 8)), weight((2,), MXFP4), weight((8,))], {"heads": 2}, 1, "must not be quantised"),
    (
        "recurrent",
        [val(("B", 8))] * 3 + [state(("B", 2, 4, 4), name="S"), val(("B", 8)), val(("B", 2))],
        {"heads": 1},
        3,
        "heads=1: dimension 2 must be 1",
    ),
    (
        "recurrent",
        [val(("B", 8)), val(("B", 6)), val(("B", 8)), state(("B", 2, 4, 4)), val(("B", 8)), val(("B", 2))],
        {"heads": 2},
        1,
        "k `x` has 6 columns, expected 8",
    ),
    (
        "recurrent",
        [val(("B", 8))] * 3 + [state(("B", 2, 4, 4)), val(("B", 8)), val(("B", 3))],
        {"heads": 2},
        5,
        "beta `x` has 3 columns, expected 2",
    ),
    (
        "recurrent",
        [val(("B", 8))] * 3 + [state(("B", 2, 4, 4), BF16), val(("B", 8)), val(("B", 2))],
        {"heads": 2},
        3,
        "expected one of: f32",
    ),
    (
        "recurrent",
        [val(("B", 8))] * 3 + [state(("B", 2, 4, 4)), val(("B", 8)), val(("C", 2))],
        {"heads": 2},
        5,
        "has C rows",
    ),
    ("res_init", [val(("B", 8))], {"nblocks": 0}, "nblocks", "integer >= 1"),
    (
        "res_mix",
        [val(("B", 20)), val(("B", 8)), weight((8,))],
        {"layer": 1, "block": 4},
        0,
        "not a whole number of blocks of the prefix width 8",
    ),
    (
        "res_mix",
        [val(("B", 16)), val(("B", 8)), weight((8,))],
        {"layer": 9, "block": 4},
        "layer",
        "mixes 3 blocks, but `x` holds only 2",
    ),
    ("res_mix", [val(("B", 16)), val(("B", 8)), weight((4,))], {"layer": 1, "block": 4}, 2, "the prefix is 8 wide"),
    (
        "res_mix",
        [val(("B", 16)), val(("B", 8)), val((8,), name="w")],
        {"layer": 1, "block": 4},
        2,
        "must be a declared weight",
    ),
    ("res_mix", [val(("B", 16)), val(("C", 8)), weight((8,))], {"layer": 1, "block": 4}, 1, "has C rows"),
    ("res_mix", [val(("B", 16)), val(("B", 8)), weight((8,))], {"layer": -1, "block": 4}, "layer", "integer >= 0"),
    ("res_mix", [val(("B", 16)), val(("B", 8)), weight((8,))], {"layer": 1, "block": 0}, "block", "integer >= 1"),
    (
        "res_snapshot",
        [val(("B", 16)), val(("B", 8))],
        {"layer": 8, "block": 4},
        "layer",
        "writes block 2, but `x` holds only 2 blocks",
    ),
]


@pytest.mark.parametrize("op, args, attrs, arg, message", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_shape_rules_reject_bad_operands(op, args, attrs, arg, message):
    with pytest.raises(OpError) as err:
        infer(op, args, **attrs)
    assert message in str(err.value), str(err.value)
    assert err.value.arg == arg, (err.value.arg, str(err.value))


def test_costs():
    b, heads, dk, dv, n = 2, 3, 16, 8, 48
    t = lambda *s, dt=F32: TensorType(dt, s)  # noqa: E731
    c = OPS["recurrent"].cost(
        [t(b, heads * dk)] * 3 + [t(b, heads, dk, dv), t(b, heads * dk), t(b, heads)],
        [t(b, heads * dv)],
        {"heads": heads},
    )
    assert c.state_bytes == 2 * b * heads * dk * dv * 4 and c.weight_bytes == 0 and c.flops == 7 * b * heads * dk * dv
    c = OPS["short_conv"].cost([t(b, n), t(4, n, dt=BF16), t(b, 3, n)], [t(b, n)], {})
    assert c.weight_bytes == 4 * n * 2 and c.state_bytes == 2 * b * 3 * n * 4
    c = OPS["kda_gate"].cost([t(b, n), t(heads), t(n)], [t(b, n)], {"heads": heads, "lower": -5.0})
    assert c.weight_bytes == (heads + n) * 4 and c.state_bytes == 0
    c = OPS["res_mix"].cost(
        [t(b, 4 * n), t(b, n), t(n, dt=BF16)], [t(b, n)], {"layer": 5, "block": 4, "after_snapshot": False, "eps": 1e-5}
    )
    assert c.weight_bytes == n * 2 and c.state_bytes == 0 and c.flops == 6 * 3 * b * n  # blocks 0, 1 and the prefix
    for op in ("l2norm", "res_init", "res_snapshot"):
        assert OPS[op].cost([t(b, 2 * n), t(b, n)], [t(b, n)], {"heads": 1, "layer": 4, "block": 4}).weight_bytes == 0


def test_oracle_table_is_consistent():
    kimi = set(KNOWN_ATTRS)
    assert kimi <= set(OPS) and kimi <= set(ORACLES), sorted(kimi - set(ORACLES))
    for op, names in ORACLES.items():
        assert set(OPS[op].attrs) == KNOWN_ATTRS[op], f"{op} attributes changed: update its oracle"
        for name in names:
            assert name.startswith("test_") and callable(globals().get(name)), name
