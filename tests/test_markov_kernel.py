"""`markov_argmax` in the kernel (mkdsl/backends/tpu/lowerings/draft.py), TPU interpret mode with
the race detector on, against a float64 oracle of the drafts read left to right from the kernel's
own logits (so the comparison pins the op, not the layers before it).

The kernel's bias w2 . w1[prev] is a sum of exact products of bf16 weights in f32, as the
reference's; only the order of the sum differs, by at most rank * 2^-24 * sum|w2 * w1[prev]|
(the oracle's own float64 error is far below), so a draft may differ from the oracle's only
where the oracle's two candidates lie within that bound of each other (a near tie). The Markov
matrices are scaled by 8 (exact in bf16) so that the bias moves the argmax: the test checks
that a kernel ignoring the bias, or biasing every row by the anchor, would give other drafts."""

from __future__ import annotations

import numpy as np
import pytest

from mkdsl.compiler import compile_source
from mkdsl.run.random_params import random_params
from mkdsl.verify import kernel as verify

SPEC = """\
model markov_kernel

const L = 1
const H = 128
const F = 256
const V = 512
const MR = 32

dim B in 1 .. 8

weight embed:     bf16[V, H]
weight norm1:     bf16[H]        per layer
weight w_gate:    bf16[H, F]     per layer
weight w_up:      bf16[H, F]     per layer
weight w_down:    bf16[F, H]     per layer
weight out_norm:  bf16[H]
weight lm_head:   bf16[H, V]
weight markov_w1: bf16[V, MR]
weight markov_w2: bf16[V, MR]

layer dense(x) {
  h = rmsnorm(x, norm1)
  return x + linear(swiglu(linear(h, w_gate), linear(h, w_up)), w_down)
}

layers L { dense: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm), lm_head)
  return logits, markov_argmax(logits, tokens, markov_w1, markov_w2)
}
"""
BATCH = 6


def oracle(logits: np.ndarray, anchor: int, w1: np.ndarray, w2: np.ndarray, chained: bool = True):
    """Drafts and, per row, (biased row, its summation bound) in float64; `chained=False`: every
    row biased by the anchor (the bug the test must tell apart)."""
    w1, w2 = w1.astype(np.float64), w2.astype(np.float64)
    prev, drafts, rows = anchor, [], []
    for row in logits.astype(np.float64):
        v = row + w2 @ w1[prev]
        bound = w1.shape[1] * 2.0**-24 * (np.abs(w2) @ np.abs(w1[prev])) * 2 + 1e-30
        d = int(np.argmax(v))
        drafts.append(d)
        rows.append((v, bound))
        prev = d if chained else anchor
    return np.array(drafts), rows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_markov_argmax_kernel_matches_the_oracle(tmp_path):
    out, _ = compile_source(SPEC, "markov_kernel.mk", None)
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "markov_kernel")
    weights, state = random_params(out.model, {"B": BATCH}, seed=3)
    for name in ("markov_w1", "markov_w2"):
        weights[name] = (np.asarray(weights[name], np.float32) * 8).astype(weights[name].dtype)
    tokens = np.random.default_rng(3).integers(0, 512, BATCH).astype(np.int32)
    positions = np.arange(BATCH, dtype=np.int32)
    step = module.build_decode_step(
        BATCH, verify.check_seq_len(module), interpret=verify.interpret_params(), layer_trace=True
    )
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    got = verify.run_kernel(step, weights, state, tokens, positions, sharded=False)
    assert not verify.races_found(), "the interpreter's race detector reported a race"
    assert np.isfinite(got.logits).all()
    w1, w2 = (np.asarray(weights[n], np.float32) for n in ("markov_w1", "markov_w2"))
    want, rows = oracle(got.logits, int(tokens[0]), w1, w2)
    drafts = got.next_tokens.reshape(-1)[:BATCH]
    for r, (d, e) in enumerate(zip(drafts, want, strict=True)):
        v, bound = rows[r]
        assert d == e or abs(v[d] - v[e]) <= bound[d] + bound[e], f"row {r}: kernel {d}, oracle {e}"
        if d != e:  # a near tie: the rows after it follow another previous token
            break
    unbiased = np.argmax(got.logits[:BATCH], axis=1)
    anchored, _ = oracle(got.logits, int(tokens[0]), w1, w2, chained=False)
    assert (unbiased != want).any() and (anchored != want).any(), "the bias must move the drafts"
