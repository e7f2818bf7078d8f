"""Independent numpy decoding for the specs written as a new user would (Gemma 3, Mixtral,
Qwen2.5, ...), and the numpy helpers the other model oracles share (bf16 rounding, the deployed
matmul, the bf16-MXU attention of `attend`; Qwen3-30B, gpt-oss, DeepSeek-V3): the published equations in float64, rounded where the deployed model feeds or stores
bf16 (every matmul input, attention's query and softmax weights against the bf16 caches included,
the KV cache entries, an expert's activation before its down projection: docs/language.md's
numeric contract). Nothing here uses mkdsl's ops.

Tolerances (numpy vs reference), as in tests/test_qwen3.py: both round the same values to bf16,
so they differ by f32 rounding (~2^-24 relative per op) until that flips the bf16 rounding of one
matmul input (2^-8 relative of one entry, ~2^-8/sqrt(fan_in) of the matmul's output scale); a few
flips over two layers and three steps stay well below 2^-7 of a row's largest logit (LOGIT_RTOL,
the bound mkdsl/verify/kernel.py derives for one layer's epilogue), and the bf16 caches within one bf16
ulp plus 2^-7 of the largest entry of each cache vector (CACHE_RTOL).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

LOGIT_RTOL = 2.0**-7
CACHE_RTOL = 2.0**-7


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def bf16(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def mm(x, w) -> np.ndarray:
    """A matmul as deployed: the activation rounded to bf16, the bf16 weight exact, f64 sums."""
    return bf16(x) @ f64(w)


def rms(x, w, eps, offset=0.0):
    """RMSNorm over the last axis with weights `offset + w` (Gemma's zero-centred: offset 1)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + f64(w))


def inv_freq(d, theta, factor=1.0):
    """theta^(-2i/d), i < d/2; linear scaling divides every frequency by `factor`."""
    return theta ** (-np.arange(d // 2) * 2.0 / d) / factor


def rope(x, pos, freq):
    """x [heads, d] at position pos, rotate-half pairs (i, i + d/2) by pos * freq[i]."""
    d = x.shape[-1]
    cos, sin = np.cos(pos * freq), np.sin(pos * freq)
    a, b = x[:, : d // 2], x[:, d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def attend(q, cache_k, cache_v, first, pos, scale):
    """Grouped-query softmax attention of q [heads, d] over cached tokens first..pos of
    cache_k, cache_v [kv_heads, S, d]; query head h reads KV head h // (heads / kv_heads). Both
    products are MXU matmuls against the bf16 cache, so their other inputs are rounded to bf16:
    the query, and the softmax's unnormalised weights exp(s - max), divided by their f64 sum
    after (docs/architecture.md, "Attention numerics")."""
    group = q.shape[0] // cache_k.shape[0]
    out = np.zeros_like(q)
    for head in range(q.shape[0]):
        j = head // group
        s = cache_k[j, first : pos + 1] @ bf16(q[head]) * scale
        e = np.exp(s - s.max())
        out[head] = bf16(e) @ cache_v[j, first : pos + 1] / e.sum()
    return out.reshape(-1)


def compare_steps(step: Callable, numpy_step: Callable, weights, state, tokens, positions, steps: int):
    """`steps` greedy steps of the reference `step` against `numpy_step(state64, tokens, positions)`
    -> (logits, next tokens, new caches, near ties), each from the reference's own state."""
    ours = {k: f64(v) for k, v in state.items()}
    for i in range(steps):
        logits, next_tokens, new_state = step(weights, {k: jnp.asarray(v) for k, v in state.items()}, tokens, positions)
        want, want_next, ours, ties = numpy_step(ours, tokens, positions)
        assert not ties, f"step {i}: a top-k near tie in layers {ties}: pick another seed"
        logits = f64(logits)
        bound = LOGIT_RTOL * np.abs(want).max(axis=-1, keepdims=True)
        assert (np.abs(logits - want) <= bound).all(), f"step {i}: logits off by {np.abs(logits - want).max()}"
        assert np.array_equal(np.asarray(next_tokens), want_next), f"step {i}: greedy tokens differ"
        for name in ours:
            got = f64(new_state[name])
            scale = np.abs(ours[name]).max(axis=-1, keepdims=True)
            ulp = np.ldexp(1.0, np.frexp(ours[name])[1] - 8)  # one bf16 ulp (8 significant bits)
            assert (np.abs(got - ours[name]) <= ulp + CACHE_RTOL * scale).all(), f"step {i}: {name}"
        ours = {k: bf16(v) for k, v in ours.items()}  # the cache holds bf16
        state = {k: np.asarray(v) for k, v in new_state.items()}
        tokens, positions = np.asarray(next_tokens, np.int32), positions + 1
