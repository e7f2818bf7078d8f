"""specs/qwen3_next_80b_a3b.mk (profile `mini`) against an independent decode written from the
published equations (tests/qwen3_next_oracle.py: float64 numpy, no mkdsl op), and its mini kernel
against the reference in TPU interpret mode.

Reference vs the independent decode: 3 decode steps at batch 1 and 4, rows at different cache
positions; each step both start from the reference's state (so nothing compounds over steps).
Both round every matmul input to bf16 and new cache entries to bf16, so they differ only by f32
vs float64 arithmetic — until an f32 difference flips one bf16 rounding of a matmul input, which
moves that input by 2^-8 relative and the layer's output by ~2^-8 / sqrt(fan_in) of its scale per
flip (mkdsl/verify/kernel.py's argument). Through the mini's 4 layers and the head, a few flips per
layer give well under 2^-6 of the row's largest logit: the bound is LOGIT_RTOL = 2^-6 x the row's
largest |logit|; states within STATE_RTOL = 2^-6 x the largest |entry| of their head's recurrent
matrix, cache vector or conv tap (plus one bf16 ulp for the caches). The recurrent state is
scaled per head, not per row of the matrix: a row k_i d^T + alpha S_i with small k_i and alpha is
a near-cancelling difference d = beta (v - S^T k) times k_i, whose error is relative to |v|,
not to the row (observed 3% of a tiny row from one flip, 1e-5 of its head's scale). A wrong equation (a missing decay, q unscaled, a (1 + w) norm read as w, the
gate on the wrong side of the norm, a wrong key-head grouping) moves the logits by 0.1 .. 1 of
their scale. A routing near tie (the k-th expert's probability within 2^-8 of the runner-up's,
relatively) may go either way under those rounding differences: such a row is left out of that
step's comparison (and at least one row must be compared each step). The greedy tokens must
agree unless the reference scores the oracle's token within the logit bound of its best.

The kernel test (slow) runs the mini kernel (sharded over its 2 devices) for 3 steps at batch 1
and 4 with `mkdsl.verify.kernel` (race detector on; layer-by-layer bounds derived there).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import qwen3_next_oracle as oracle
from checkpoint_writers import through_checkpoint

from mkdsl.compiler import compile_source
from mkdsl.run.random_params import random_params
from mkdsl.run.reference import build_reference
from mkdsl.verify import kernel as verify

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "qwen3_next_80b_a3b.mk"
STEPS = 3
SEQ_LEN = 32
LOGIT_RTOL = 2.0**-6
STATE_RTOL = 2.0**-6
RECURRENT = {"gdn_state"}  # [B, heads, dk, dv]: a [dk, dv] matrix per head
ROUTE_TIE = 2.0**-8  # relative gap between the k-th routing probability and the runner-up


@pytest.fixture(scope="module")
def mini():
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), "mini", None)
    return out


@pytest.fixture(scope="module")
def mini_kv16():
    """The mini with 16-token KV tiles, so the interpreted kernel's cache (two tiles) is short."""
    assert "hints" not in SPEC.read_text(encoding="utf-8"), "merge the kv_tile override into the spec's hints"
    text = SPEC.read_text(encoding="utf-8") + "\nhints { kv_tile = 16 }\n"
    out, _ = compile_source(text, str(SPEC), "mini", None)
    return out


def sizes(model) -> oracle.Sizes:
    c = model.const
    return oracle.Sizes(
        hidden=c["H"],
        key_heads=c["NK"],
        value_heads=c["NV"],
        head_k=c["DK"],
        head_v=c["DV"],
        heads=c["NH"],
        kv_heads=c["NKV"],
        head_dim=c["HD"],
        rotary=c["ROT"],
        theta=float(c["THETA"]),
        topk=c["TOPK"],
    )


def test_published_sizes():
    """The full spec at the sizes of the config (facts §3)."""
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), None, None)
    m = out.model
    c = m.const
    assert (c["L"], c["H"], c["V"], c["E"], c["TOPK"], c["FE"], c["FS"]) == (48, 2048, 151936, 512, 10, 512, 512)
    assert (c["NK"], c["NV"], c["DK"], c["DV"], c["CONV"]) == (16, 32, 128, 128, 4)
    assert (c["NH"], c["NKV"], c["HD"], c["ROT"], c["THETA"], c["EPS"]) == (16, 2, 256, 64, 1e7, 1e-6)
    assert [i for i, k in enumerate(m.schedule) if k == "full_attn"] == list(range(3, 48, 4))


def draw_params(model, batch: int, seed: int):
    """random_params, except the shared expert's gate vector, drawn as the [H] -> 1 projection it
    is (~ N(0, 1/H)) rather than near one like a norm gain: near one, sigmoid(h . w) saturates and
    the gate would be invisible."""
    weights, state = random_params(model, {"B": batch, "S": SEQ_LEN}, seed)
    w = weights["shared_egate"]
    rng = np.random.default_rng([seed, 1])
    weights["shared_egate"] = (rng.standard_normal(w.shape, np.float32) / np.sqrt(w.shape[-1])).astype(w.dtype)
    return weights, state


def close_rows(got, want, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).reshape(want.shape[0], -1).max(axis=1)
    err = np.abs(got - want).reshape(want.shape[0], -1).max(axis=1)
    ratio = err / (rtol * scale + 1e-30)
    assert (ratio <= 1).all(), f"{what}: worst row error / bound {ratio.max():.2f}"
    return float(ratio.max())


def ulp_bf16(x):
    return np.abs(np.asarray(x, np.float64)) * 2.0**-7


def check_state(name, got, want, model):
    """Every state entry within STATE_RTOL of the largest entry of what it is part of: a recurrent
    state's head matrix (a row of it can be a near-cancelling sum, so its own largest entry is
    no scale), a cache entry's vector, a conv tap's channels."""
    t = model.tensor(name)
    axes = (-2, -1) if name in RECURRENT else (-1,)
    for layer, slot in enumerate(t.slots):
        if slot < 0:
            continue
        g, w = np.asarray(got[slot], np.float64), np.asarray(want[slot], np.float64)
        scale = np.abs(w).max(axis=axes, keepdims=True)
        bound = STATE_RTOL * scale + (ulp_bf16(w) if t.type.dtype.name == "bf16" else 0.0)
        bad = np.abs(g - w) > bound
        assert not bad.any(), f"{name}, layer {layer}: {int(bad.sum())} entries off, first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize("batch", [1, 4])
def test_reference_matches_independent_decode(batch, mini):
    model = mini.model
    z = sizes(model)
    weights, state = draw_params(model, batch, seed=batch)
    step = build_reference(model)
    rng = np.random.default_rng(batch)
    tokens = rng.integers(0, model.const["V"], batch).astype(np.int32)
    positions = np.array([0, SEQ_LEN - STEPS, 7, 18][:batch], np.int32)
    for i in range(STEPS):
        logits, next_tokens, new_state = step(weights, state, tokens, positions)
        logits, next_tokens = np.asarray(logits), np.asarray(next_tokens)
        new_state = {k: np.asarray(v) for k, v in new_state.items()}
        want_logits, want_next, want_state, margin = oracle.decode(model, z, weights, state, tokens, positions)
        rows = margin >= ROUTE_TIE  # rows whose every routing is clear of a near tie
        assert rows.any(), f"step {i}: every row has a routing near tie; pick another seed"
        close_rows(logits[rows], want_logits[rows], LOGIT_RTOL, f"step {i}: logits")
        for name in new_state:
            check_state(name, new_state[name][:, rows], want_state[name][:, rows], model)
        for b in np.flatnonzero(rows):
            if next_tokens[b] != want_next[b]:  # a near tie: the reference must score the oracle's token as its best
                gap = logits[b].max() - logits[b, want_next[b]]
                assert gap <= LOGIT_RTOL * np.abs(logits[b]).max(), f"step {i}, row {b}: tokens differ by {gap}"
        state, tokens, positions = new_state, next_tokens.astype(np.int32), positions + 1


# Batch 4 covers rows with distinct experts and positions; MKDSL_QWEN3_NEXT_BATCHES=1,4 adds batch 1
# (several minutes more in interpret mode: CI runs batch 4 only).
KERNEL_BATCHES = tuple(int(b) for b in os.environ.get("MKDSL_QWEN3_NEXT_BATCHES", "4").split(","))


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("batch", KERNEL_BATCHES)
def test_mini_kernel_matches_reference(batch, mini_kv16, tmp_path):
    out = mini_kv16
    module = verify.import_generated(out.files["kernel.py"], tmp_path, f"qwen3_next_mini_{batch}")
    assert module.KV_TILE == 16 and int(np.prod(module.MESH_SHAPE)) >= 2, "the mini runs sharded, 16-token tiles"
    # the weights come through a synthetic checkpoint in the published layout (fused per key head)
    load = partial(through_checkpoint, out.model, root=tmp_path)
    result = verify.check_batch(out.model, module, verify.LayerChecker(out.model), batch, STEPS, batch, load=load)
    assert not result.failures, result.failures
    print(f"\nqwen3_next mini batch {batch}: worst error / bound {result.worst} ({result.seconds:.0f} s)")
