"""`rope` and `attention` references against float64 oracles written from the published
equations (facts in /work/shared/facts/models.md): rotate-half and interleaved pairs, partial
rotary at an offset, the linear, llama3 and YaRN frequency tables (DeepSeek-V3 and gpt-oss
figures); attention's sliding window and sink logits (gpt-oss)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mkdsl.ops.attention import attention
from mkdsl.ops.rope import ROPE_ATTRS, inv_freq, rope, yarn_range

ORACLES = {  # op -> tests comparing it with an oracle (merged by tests/test_ops_oracle.py)
    "rope": [
        "test_rope_matches_the_published_rotation",
        "test_yarn_deepseek_v3_table",
        "test_yarn_gpt_oss_table_and_concentration",
        "test_llama3_and_linear_tables",
        "test_llama3_table_without_a_smoothing_band",
    ],
    "attention": ["test_attention_window_and_sinks", "test_attention_chunks"],
}
KNOWN_ATTRS = {
    "rope": set(ROPE_ATTRS),
    "attention": {"heads", "kv_heads", "scale", "window", "chunk", "global_tokens"},
}

# f32 rope vs a float64 oracle: |x| <= ~4, angles <= ~60 rad: the f32 angle carries ~60 * 6e-8
# rad of error, cos/sin ~1e-7 each, so entries agree to ~4 * (4e-6 + 2e-7) < 2e-5.
TOL = 2e-5


def attrs(**kw):
    return ROPE_ATTRS | kw


def oracle(x, pos, heads, freq, rotary, offset, pairing, conc=1.0):
    """The textbook rotation, per head: lanes offset..offset+rotary-1 rotate, the rest pass."""
    b, n = x.shape
    d = n // heads
    out = x.astype(np.float64).reshape(b, heads, d).copy()
    ang = pos[:, None].astype(np.float64) * freq[None, :]  # [b, rotary/2]
    c, s = np.cos(ang)[:, None, :] * conc, np.sin(ang)[:, None, :] * conc
    seg = out[:, :, offset : offset + rotary].copy()
    if pairing == "half":
        x1, x2 = seg[..., : rotary // 2], seg[..., rotary // 2 :]
        rot = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:  # adjacent pairs as complex numbers times e^(i angle)
        z = (seg[..., 0::2] + 1j * seg[..., 1::2]) * np.exp(1j * ang)[:, None, :] * conc
        rot = np.stack([z.real, z.imag], axis=-1).reshape(seg.shape)
    out[:, :, offset : offset + rotary] = rot
    return out.reshape(b, n)


CASES = [  # heads, d, rotary_dim, offset, pairing, theta
    (2, 128, None, 0, "half", 10000.0),  # Llama
    (3, 64, None, 0, "interleaved", 100000.0),  # head dim 64
    (2, 256, 64, 0, "half", 1e7),  # Qwen3-Next: first 64 of 256 rotate, theta 1e7
    (2, 192, 64, 128, "interleaved", 10000.0),  # DeepSeek q: the 64 rope lanes after 128 nope lanes
]


@pytest.mark.parametrize("heads,d,rotary,offset,pairing,theta", CASES)
def test_rope_matches_the_published_rotation(heads, d, rotary, offset, pairing, theta):
    rng = np.random.default_rng(d + offset)
    x = rng.normal(size=(3, heads * d)).astype(np.float32)
    pos = np.array([0, 7, 60], np.int32)
    a = attrs(heads=heads, theta=theta, rotary_dim=rotary, rotary_offset=offset, pairing=pairing)
    r = rotary or d
    freq = theta ** (-np.arange(0, r, 2) / r)
    got = np.asarray(rope(x, pos, **a))
    want = oracle(x, pos, heads, freq, r, offset, pairing)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    if rotary:  # the pass-through lanes are bit-identical
        keep = np.ones(d, bool)
        keep[offset : offset + rotary] = False
        np.testing.assert_array_equal(got.reshape(3, heads, d)[..., keep], x.reshape(3, heads, d)[..., keep])


def test_yarn_deepseek_v3_table():
    """DeepSeek-V3: d=64, base 1e4, factor 40, original 4096, beta 32/1, floored: low 10, high 23."""
    a = attrs(theta=10000.0, scaling="yarn", factor=40.0, original_max_position=4096)
    assert yarn_range(64, 10000.0, a) == (10, 23)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    ramp = np.clip((np.arange(32) - 10) / 13, 0, 1)
    np.testing.assert_allclose(inv_freq(64, a), base * (1 - ramp) + base / 40 * ramp, rtol=1e-12)
    assert inv_freq(64, a)[10] == base[10] and inv_freq(64, a)[23] == base[23] / 40


def test_yarn_gpt_oss_table_and_concentration():
    """gpt-oss: d=64, base 150000, factor 32, truncate=false: low 8.093, high 17.398 (not
    floored), and cos and sin both scaled by 0.1 ln 32 + 1 = 1.346574."""
    conc = 0.1 * math.log(32) + 1
    assert abs(conc - 1.346574) < 1e-6
    a = attrs(heads=2, theta=150000.0, scaling="yarn", factor=32.0, original_max_position=4096, truncate=False)
    low, high = yarn_range(64, 150000.0, a)
    assert abs(low - 8.093) < 5e-4 and abs(high - 17.398) < 5e-4
    base = 150000.0 ** (-np.arange(0, 64, 2) / 64)
    ramp = np.clip((np.arange(32) - low) / (high - low), 0, 1)
    freq = base * (1 - ramp) + base / 32 * ramp
    np.testing.assert_allclose(inv_freq(64, a), freq, rtol=1e-12)
    x = np.random.default_rng(1).normal(size=(2, 128)).astype(np.float32)
    pos = np.array([3, 100], np.int32)
    got = np.asarray(rope(x, pos, **(a | {"concentration": conc})))
    np.testing.assert_allclose(got, oracle(x, pos, 2, freq, 64, 0, "half", conc), atol=TOL * conc, rtol=0)


def test_llama3_and_linear_tables():
    """Llama 3.1 (factor 8, low 1, high 4, original 8192): wavelengths above 8192 are divided by
    8, below 2048 kept, in between blended by (8192/wavelen - 1)/3; linear divides all by the factor."""
    base = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    a = attrs(theta=500000.0, scaling="llama3", factor=8.0, original_max_position=8192)
    want = []
    for f in base:
        wl = 2 * math.pi / f
        if wl < 8192 / 4:
            want.append(f)
        elif wl > 8192 / 1:
            want.append(f / 8)
        else:
            sm = (8192 / wl - 1) / 3
            want.append((1 - sm) * f / 8 + sm * f)
    np.testing.assert_allclose(inv_freq(128, a), want, rtol=1e-12)
    np.testing.assert_allclose(inv_freq(128, attrs(theta=500000.0, scaling="linear", factor=4.0)), base / 4)


def test_llama3_table_without_a_smoothing_band():
    """Llama 4 Scout (factor 16, low 1 = high 1, original 8192): transformers divides the
    frequencies whose wavelength is above 8192 by 16 and keeps the others (the band between the
    two wavelengths is empty, so nothing is blended)."""
    base = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    a = attrs(theta=500000.0, scaling="llama3", factor=16.0, original_max_position=8192)
    a |= {"low_freq_factor": 1.0, "high_freq_factor": 1.0}
    want = [f / 16 if 2 * math.pi / f > 8192 else f for f in base]
    assert want[0] == base[0] and want[-1] == base[-1] / 16  # both sides occur
    np.testing.assert_allclose(inv_freq(128, a), want, rtol=1e-12)


def chunk_oracle(q, kc, vc, pos, heads, kv_heads, scale, chunk, window, global_tokens=None):
    """Chunked attention (Llama 4): a query at p sees keys t <= p with t // chunk == p // chunk
    (and t > p - window with a window too), and the first `global_tokens` keys t <= p whatever
    the chunk and window (prefix-global tokens); softmax(q.k_t * scale) over those."""
    b, _, _, d = kc.shape
    group = heads // kv_heads
    out = np.zeros((b, heads * d))
    for r in range(b):
        t = np.arange(kc.shape[2])
        seen = (t <= pos[r]) & (t // chunk == pos[r] // chunk)
        if window is not None:
            seen &= t > pos[r] - window
        if global_tokens is not None:
            seen |= (t < global_tokens) & (t <= pos[r])
        for h in range(heads):
            keys, values = kc[r, h // group][seen], vc[r, h // group][seen]
            logits = keys @ q[r, h * d : (h + 1) * d] * scale
            e = np.exp(logits - logits.max())
            out[r, h * d : (h + 1) * d] = e @ values / e.sum()
    return out


@pytest.mark.parametrize(
    "chunk, window, g", [(1, None, None), (8, None, None), (16, None, None), (40, None, None), (8, 5, None), (16, 3, 4)]
)
def test_attention_chunks(chunk, window, g):
    """Rows at a chunk's first position (sees itself only, and the global tokens), mid-chunk, and
    its last position."""
    rng = np.random.default_rng(chunk * 100 + (window or 0))
    b, heads, kv_heads, d, s = 4, 4, 2, 8, 40
    q = rng.normal(size=(b, heads * d)).astype(np.float32)
    k = rng.normal(size=(b, kv_heads * d)).astype(np.float32)
    v = rng.normal(size=(b, kv_heads * d)).astype(np.float32)
    kc = jnp.asarray(rng.normal(size=(b, kv_heads, s, d)), jnp.float32)
    vc = jnp.asarray(rng.normal(size=(b, kv_heads, s, d)), jnp.float32)
    pos = np.array([0, 8, 21, 39], np.int32)
    got, new_kc, new_vc = attention(
        q, k, v, kc, vc, pos, heads=heads, kv_heads=kv_heads, scale=0.3, window=window, chunk=chunk, global_tokens=g
    )
    want = chunk_oracle(
        q, np.asarray(new_kc, np.float64), np.asarray(new_vc, np.float64), pos, heads, kv_heads, 0.3, chunk, window, g
    )
    # as test_attention_window_and_sinks: f32 scores of 8 terms through exp, weighted means: 1e-5
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
    if 21 // chunk * chunk > (0 if window is None else 21 - window + 1):  # the chunk hides keys at row 2 (21)
        unmasked = attention(q, k, v, kc, vc, pos, heads=heads, kv_heads=kv_heads, scale=0.3, window=window)[0]
        assert not np.allclose(np.asarray(unmasked)[2], want[2], atol=1e-3)
    if g is not None:  # the global tokens are seen: without them, row 2 differs
        local = attention(q, k, v, kc, vc, pos, heads=heads, kv_heads=kv_heads, scale=0.3, window=window, chunk=chunk)
        assert not np.allclose(np.asarray(local[0])[2], want[2], atol=1e-3)


def attention_oracle(q, kc, vc, pos, heads, kv_heads, scale, window, sinks):
    """gpt-oss: logits l_t = q.k_t * scale over t in p-window+1..p, and
    p_t = e^(l_t) / (sum_u e^(l_u) + e^(S_h)): the sink adds to the denominator only."""
    b, _, _, d = kc.shape
    group = heads // kv_heads
    out = np.zeros((b, heads * d))
    for r in range(b):
        t = np.arange(kc.shape[2])
        seen = (t <= pos[r]) & (t > pos[r] - window)
        for h in range(heads):
            keys, values = kc[r, h // group][seen], vc[r, h // group][seen]
            logits = keys @ q[r, h * d : (h + 1) * d] * scale
            top = max(logits.max(), sinks[h])
            e = np.exp(logits - top)
            out[r, h * d : (h + 1) * d] = e @ values / (e.sum() + np.exp(sinks[h] - top))
    return out


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_attention_window_and_sinks(window):
    rng = np.random.default_rng(window)
    b, heads, kv_heads, d, s = 3, 4, 2, 8, 40
    q = rng.normal(size=(b, heads * d)).astype(np.float32)
    k = rng.normal(size=(b, kv_heads * d)).astype(np.float32)
    v = rng.normal(size=(b, kv_heads * d)).astype(np.float32)
    kc = jnp.asarray(rng.normal(size=(b, kv_heads, s, d)), jnp.float32)
    vc = jnp.asarray(rng.normal(size=(b, kv_heads, s, d)), jnp.float32)
    sinks = (rng.normal(size=heads) * 2).astype(np.float32)
    pos = np.array([0, 9, 39], np.int32)
    got, new_kc, new_vc = attention(
        q, k, v, kc, vc, pos, sinks, heads=heads, kv_heads=kv_heads, scale=0.3, window=window
    )
    want = attention_oracle(
        q,
        np.asarray(new_kc, np.float64),
        np.asarray(new_vc, np.float64),
        pos,
        heads,
        kv_heads,
        0.3,
        window,
        sinks.astype(np.float64),
    )
    # f32 scores of 8 terms of |q k| <= ~16 (~1e-6 each) through exp, then weighted means of |v| <= ~4: 1e-5
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(new_kc)[np.arange(b), :, pos], k.reshape(b, kv_heads, d))


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"theta": 1}, "yarn scaling needs theta != 1"),
        ({"beta_fast": 0.0}, "beta_fast must be a positive number"),
        ({"beta_slow": -1.0}, "beta_slow must be a positive number"),
    ],
)
def test_yarn_attributes_that_have_no_range_are_op_errors(attrs, message):
    """Found by tests/test_fuzz.py on specs/deepseek_v3.mk: `theta = 1` crashed with ZeroDivisionError."""
    from mkdsl.ops.registry import OpError
    from mkdsl.ops.rope import _check_attrs

    a = {**ROPE_ATTRS, "scaling": "yarn", "original_max_position": 4096, **attrs}
    with pytest.raises(OpError, match=message):
        _check_attrs(64, a)
