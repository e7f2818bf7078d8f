"""The reference decode of specs/llama3_8b.mk (mini profile) against a Llama decode written here.

`llama_step` below is a straightforward JAX Llama 3 decode step that uses nothing from mkdsl:
embedding, RMSNorm, rotary embedding (rotate-half), grouped-query attention over a KV cache,
SwiGLU MLP, lm_head and argmax, under the same numeric contract as the reference: the input of
every matmul rounded to bf16, f32 accumulation, caches stored in bf16. Both run several
consecutive greedy decode steps from random weights (mkdsl.random_params) and a random cache,
each row starting at its own position, feeding back the reference's next tokens.

Tolerances. Both sides compute in f32 in different orders, so their f32 values differ by a few
ulps, and now and then a value lands on the other side of a bf16 rounding boundary when it is
rounded for a matmul or the cache: one bf16 ulp (2^-8 relative) in one element, which moves
the logits by up to ~1e-2 (measured: 80% of rows agree to < 1e-5, the worst of ~800 rows
differs by 1.3e-2, on logits of magnitude ~4). Hence:
* logits: |ref - here| <= LOGIT_ATOL = 3e-2, and (batch >= 3) at least half of all rows over
  all steps agree to TIGHT = 1e-5, so that a systematic error of any size cannot hide below
  LOGIT_ATOL;
* next tokens: equal, except in rows whose two largest logits are within 2·LOGIT_ATOL (near ties);
* caches: bitwise equal to the initial cache wherever no step wrote; where a step wrote,
  >= 99% of entries bitwise equal to this decode's and all within one bf16 ulp (2^-7·|v|)
  + CACHE_ATOL = 2e-2 (entries are O(1); a layer-1 flip moves layer-2 entries slightly).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mkdsl.elaborate import load
from mkdsl.quant import QTensor
from mkdsl.random_params import random_params
from mkdsl.reference import build_reference

SPEC = Path(__file__).resolve().parent.parent / "specs" / "llama3_8b.mk"
LOGIT_ATOL = 3e-2
TIGHT = 1e-5
CACHE_ATOL = 2e-2
STEPS = 4
S = 32  # KV cache length
HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------- an independent Llama decode


def matmul(x, w):
    """bf16(x) @ w, accumulated in f32. bf16 weights: a bf16 x bf16 -> f32 dot; other formats
    arrive decoded to f32 (exactly) and x is rounded to bf16 first."""
    if w.dtype == jnp.bfloat16:
        return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    return jnp.dot(x.astype(jnp.bfloat16).astype(jnp.float32), w, precision=HIGHEST)


def rms_norm(x, w, eps):
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, positions, heads, theta):
    b, width = x.shape
    d = width // heads
    inv_freq = jnp.asarray(1.0 / theta ** (np.arange(0, d, 2) / d), jnp.float32)  # [d/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [b, 1, d]
    xh = x.reshape(b, heads, d)
    return (xh * jnp.cos(emb) + rotate_half(xh) * jnp.sin(emb)).reshape(b, width)


def llama_step(w, k_cache, v_cache, tokens, positions, cfg):
    """One greedy decode step. k_cache/v_cache: bf16 [L, B, NKV, S, D]."""
    L, NH, NKV, D, eps, theta = (cfg[k] for k in ("L", "NH", "NKV", "D", "EPS", "THETA"))
    b, s = tokens.shape[0], k_cache.shape[3]
    x = w["embed"][tokens].astype(jnp.float32)
    slot = jnp.arange(s)[None, :] == positions[:, None]  # [B, S]: this step's cache slot
    visible = jnp.arange(s)[None, None, :] <= positions[:, None, None]  # [B, 1, S]
    for layer in range(L):
        h = rms_norm(x, w["attn_norm"][layer], eps)
        q = apply_rope(matmul(h, w["wq"][layer]), positions, NH, theta)
        k = apply_rope(matmul(h, w["wk"][layer]), positions, NKV, theta)
        v = matmul(h, w["wv"][layer])
        new_k = jnp.where(slot[:, None, :, None], k.astype(jnp.bfloat16).reshape(b, NKV, 1, D), k_cache[layer])
        new_v = jnp.where(slot[:, None, :, None], v.astype(jnp.bfloat16).reshape(b, NKV, 1, D), v_cache[layer])
        k_cache, v_cache = k_cache.at[layer].set(new_k), v_cache.at[layer].set(new_v)
        keys = jnp.repeat(new_k, NH // NKV, axis=1).astype(jnp.float32)  # query head h reads KV head h // (NH/NKV)
        values = jnp.repeat(new_v, NH // NKV, axis=1).astype(jnp.float32)
        scores = jnp.einsum("bhd,bhsd->bhs", q.reshape(b, NH, D), keys, precision=HIGHEST) / np.sqrt(D)
        scores = jnp.where(visible, scores, -jnp.inf)
        e = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
        attn = jnp.einsum("bhs,bhsd->bhd", p, values, precision=HIGHEST).reshape(b, NH * D)
        x = x + matmul(attn, w["wo"][layer])
        h = rms_norm(x, w["mlp_norm"][layer], eps)
        gate, up = matmul(h, w["w_gate"][layer]), matmul(h, w["w_up"][layer])
        x = x + matmul(gate / (1.0 + jnp.exp(-gate)) * up, w["w_down"][layer])
    logits = matmul(rms_norm(x, w["final_norm"], eps), w["lm_head"])
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), k_cache, v_cache


# ---------------------------------------------------------------- weights for it


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def decode_weight(a):
    """A stored weight as a jnp array: bf16 kept as is, every other format decoded to f32."""
    if isinstance(a, QTensor):
        codes = np.asarray(a.codes).astype(np.uint64)
        nib = (codes[..., :, None, :] >> (4 * np.arange(8, dtype=np.uint64))[:, None]) & 0xF
        nib = nib.reshape(*codes.shape[:-2], codes.shape[-2] * 8, codes.shape[-1]).astype(np.int64)
        if a.fmt == "mxfp4":
            vals, scale = E2M1[nib], 2.0 ** (np.asarray(a.scales).astype(np.float64) - 127)
        else:
            vals, scale = np.where(nib >= 8, nib - 16, nib), np.asarray(a.scales).astype(np.float64)
        return jnp.asarray(vals * np.repeat(scale, a.group, axis=-2), jnp.float32)  # exact in f32
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return jnp.asarray(a)
    return jnp.asarray(a.astype(np.float32))


# ---------------------------------------------------------------- the comparison


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def run_and_compare(model, batch: int, seed: int):
    cfg = model.const
    assert model.tensor("k_cache").full_shape == (cfg["L"], "B", cfg["NKV"], "S", cfg["D"])
    weights, state = random_params(model, {"B": batch, "S": S}, seed)
    mine = {name: decode_weight(a) for name, a in weights.items()}
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg["V"], batch).astype(np.int32)
    start = rng.permutation(S - STEPS)[:batch].astype(np.int32)  # a different start per row
    if batch > 1:
        start[0] = 0

    ref_step = build_reference(model)
    my_step = jax.jit(lambda w, kc, vc, t, p: llama_step(w, kc, vc, t, p, cfg))
    ref_state = dict(state)
    my_k, my_v = jnp.asarray(state["k_cache"]), jnp.asarray(state["v_cache"])
    near_ties, row_errors = 0, []
    for step in range(STEPS):
        positions = start + step
        logits, next_tokens, ref_state = ref_step(weights, ref_state, tokens, positions)
        want, want_tokens, my_k, my_v = my_step(mine, my_k, my_v, tokens, positions)
        logits, want = np.asarray(logits), np.asarray(want)
        assert logits.shape == (batch, cfg["V"]) and logits.dtype == np.float32
        assert np.isfinite(logits).all()
        err = np.abs(logits - want)
        row_errors.extend(err.max(axis=1))
        assert err.max() <= LOGIT_ATOL, f"step {step}: logits differ by {err.max():.3g} (row {err.max(1).argmax()})"
        next_tokens, want_tokens = np.asarray(next_tokens), np.asarray(want_tokens)
        for r in np.nonzero(next_tokens != want_tokens)[0]:
            top2 = np.sort(logits[r])[-2:]
            assert top2[1] - top2[0] <= 2 * LOGIT_ATOL, (
                f"step {step} row {r}: token {next_tokens[r]} vs {want_tokens[r]}, top-2 gap {top2[1] - top2[0]:.3g}"
            )
            near_ties += 1
        tokens = next_tokens  # both sides continue from the reference's tokens

    written = np.zeros((batch, S), bool)  # [B, S]: slots some step wrote
    for r in range(batch):
        written[r, start[r] : start[r] + STEPS] = True
    for name, my_cache in (("k_cache", my_k), ("v_cache", my_v)):
        init, got, here = bits(state[name]), bits(ref_state[name]), bits(my_cache)
        assert got.shape == init.shape == (cfg["L"], batch, cfg["NKV"], S, cfg["D"])
        w = np.broadcast_to(written[None, :, None, :, None], init.shape)
        assert np.array_equal(got[~w], init[~w]), f"{name}: entries no step wrote changed"
        assert np.mean(got[w] != init[w]) > 0.9, f"{name}: written slots still hold the old entries"
        g, h = np.asarray(ref_state[name])[w].astype(np.float64), np.asarray(my_cache)[w].astype(np.float64)
        worst = np.max(np.abs(g - h) - 2.0**-7 * np.abs(h))
        assert worst <= CACHE_ATOL, f"{name}: written entries differ by {worst:.3g} beyond one bf16 ulp"
        assert np.mean(got[w] == here[w]) >= 0.99, f"{name}: {np.mean(got[w] != here[w]):.2%} of written entries differ"
    assert near_ties <= max(1, batch * STEPS // 4), f"{near_ties} near-tie token mismatches: suspicious"
    if batch >= 3:
        agree = np.mean(np.array(row_errors) <= TIGHT)
        assert agree >= 0.5, f"only {agree:.0%} of rows agree to {TIGHT}: a systematic difference?"


@pytest.fixture(scope="module")
def llama_mini():
    return load(str(SPEC), "mini")


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_llama_mini_reference_matches_independent_decode(llama_mini, batch):
    run_and_compare(llama_mini, batch, seed=100 + batch)


QUANTISED = {  # the same model with its matrices in the other weight formats
    "wq:         bf16[": "wq:         mxfp4[",
    "wk:         bf16[": "wk:         mxfp4[",
    "wv:         bf16[": "wv:         int4(group=32)[",
    "wo:         bf16[": "wo:         mxfp4[",
    "w_gate:     bf16[": "w_gate:     int4(group=64)[",
    "w_up:       bf16[": "w_up:       fp8_e4m3[",
    "w_down:     bf16[": "w_down:     mxfp4[",
    "lm_head:    bf16[": "lm_head:    int4(group=128)[",
}


def test_llama_mini_quantised_weights(tmp_path):
    """mxfp4, int4 and fp8 matrices through the jitted reference (QTensors as jit arguments)."""
    src = SPEC.read_text()
    for old, new in QUANTISED.items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    path = tmp_path / "llama3_8b_quantised.mk"
    path.write_text(src)
    model = load(str(path), "mini")
    assert {t.type.dtype.name for t in model.weights} == {"bf16", "mxfp4", "int4", "fp8_e4m3"}
    run_and_compare(model, batch=3, seed=7)
