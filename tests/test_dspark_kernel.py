"""Kimi K3's DSpark drafter (specs/kimi_k3_dspark.mk, `mini`: paired with Kimi K3's `mini`, vocabulary
1024, width 256, its context from 5 target layers) as a kernel: TPU interpret mode with the race
detector on, against the reference on random weights and random context states.

What this covers beyond the per-op kernel tests: the step's prologue, `fc` streamed through the
weight ring before layer 0 (its tiles ahead of layer 0's) over the `context` state read as a value
(`read_state`), normed into the second carry every layer reads; the layer stack with its slot
caches; the Markov-biased drafts.

Bounds (mkdsl/verify/kernel.py, derived there): each layer fed the kernel's carries, carries within
2^-6 of the layer's update, the prologue's `c` within 2^-6 of its largest entry, logits 2^-7 of the
row's largest |logit|; each layer's slot caches within one bf16 ulp + 2^-6 of the vector's largest
entry, its slot positions exact. Drafts: each the best of the row's reference logits plus the Markov bias
of the kernel's previous draft, or within twice the logit bound of it (a near tie rounding may tip,
as verify's rule for greedy tokens). At this seed the closest best and runner-up are 0.47% of the
row's largest |logit| apart, the bound 0.78%, the kernel's logits observed within 1e-4 of it.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import mkdsl
from mkdsl.compiler import compile_source
from mkdsl.run.random_params import random_params
from mkdsl.verify import kernel as verify

SPEC = Path(__file__).resolve().parent.parent / "specs" / "kimi_k3_dspark.mk"
BATCH, ANCHOR = 8, 100  # the block: the anchor and 7 mask rows


def inputs(model):
    """Random weights and state; the Markov weights scaled so that the bias moves drafts (its
    random scale leaves it far below the logits). Context rows: absent (-1), below the anchor
    (written, then read by this step), two at one position (the later wins), one a window back
    (its slot's older entry replaced), one at the anchor + W - 1 (written, unseen)."""
    weights, state = random_params(model, {"B": BATCH}, seed=7)
    for name in ("markov_w1", "markov_w2"):
        weights[name] = (np.asarray(weights[name], np.float32) * 8).astype(jnp.bfloat16)
    rng = np.random.default_rng(7)
    state = {k: np.asarray(v) for k, v in state.items()}
    w = model.const["W"]
    state["slot_pos"] = rng.integers(ANCHOR - 2 * w, ANCHOR + 4, state["slot_pos"].shape).astype(np.int32)
    state["slot_pos"][:, ::5] = -1
    state["context"] = rng.standard_normal(state["context"].shape).astype(np.float32)
    cpos = [-1, ANCHOR - 3, ANCHOR - 2, ANCHOR - 1, ANCHOR - 2, -1, ANCHOR - 20, ANCHOR - 1 + w]
    state["context_pos"] = np.array(cpos, np.int32)
    tokens = np.array([17] + [model.const["MASK"]] * (BATCH - 1), np.int32)
    return weights, state, tokens, (ANCHOR + np.arange(BATCH)).astype(np.int32)


def draft_failures(weights, tokens, logits, drafts) -> list[int]:
    """Rows whose draft is neither the best biased reference logit nor a near tie with it (the bias
    `w2 . w1[previous]` read from the kernel's own previous draft, the anchor's for row 0)."""
    w1, w2 = (np.asarray(weights[n], np.float32).astype(np.float64) for n in ("markov_w1", "markov_w2"))
    bound = (verify.LOGIT_RTOL + verify.F32_RTOL) * np.abs(logits).max(axis=-1)
    prev, bad = int(tokens[0]), []
    for r, draft in enumerate(drafts):
        biased = logits[r] + w2 @ w1[prev]
        if biased[draft] < biased.max() - 2 * bound[r]:
            bad.append(r)
        prev = int(draft)
    return bad


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dspark_mini_kernel_matches_the_reference(tmp_path):
    from jax.experimental.pallas import tpu as pltpu

    spec = mkdsl.load(str(SPEC), profile="mini")
    kimi = mkdsl.load(str(SPEC.parent / "kimi_k3.mk"), profile="mini").model
    model = spec.model
    assert (model.const["V"], model.const["H"]) == (kimi.const["V"], kimi.const["H"])  # the pairing
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), "mini")
    assert "PROLOGUE_STREAMS" in out.files["kernel.py"]  # `fc` streams before layer 0
    module = verify.import_generated(out.files["kernel.py"], tmp_path, "dspark_mini")
    weights, state, tokens, positions = inputs(model)
    step = module.build_decode_step(
        BATCH, verify.check_seq_len(module), interpret=verify.interpret_params(), layer_trace=True
    )
    pltpu.reset_tpu_interpret_mode_state()
    got = verify.run_kernel(step, weights, state, tokens, positions, sharded=False)
    assert not verify.races_found(), "the interpreter's race detector reported a race"
    check = verify.LayerChecker(model).check(weights, state, tokens, positions, got)
    assert not check.failures, check.failures
    caches = {"state k_cache", "state v_cache", "state slot_pos"}
    assert {"carries", "logits", *caches} <= set(check.worst), check.worst
    logits, drafts, _ = mkdsl.reference_step(spec)(weights, state, tokens, positions)
    assert not draft_failures(weights, tokens, np.asarray(logits, np.float64), got.next_tokens)
    # the Markov bias moved at least one draft off the plain argmax, so the drafts test it
    assert (np.asarray(drafts) != np.asarray(logits).argmax(-1)).any()
    # the context reached the layers: the second carry is the normed projection, not zeros
    assert np.abs(got.trace["c"][0]).max() > 0.5
    print(f"\nworst error / bound: {check.worst}")
