"""specs/qwen2_5_7b.mk, written from the published config as a new user would: its full-size step
checks and plans on its 4-core mesh (7 query heads and 1 KV head per core); its reference (mini)
against an independent numpy decode written here from the published equations; its mini kernel
against the reference in TPU interpret mode, sharded over 2 devices, with the race detector on.

The numpy decode follows transformers' Qwen2ForCausalLM, not mkdsl's ops: per layer `h = rms(x;
input_layernorm)`, `q = rope(Wq h + bq)`, `k = rope(Wk h + bk)`, `v = Wv h + bv` (rotate-half
RoPE over the whole head, theta 1e6), grouped-query attention (7 query heads per KV head) at
scale 128^-0.5 over the cache with the new token, `x += Wo o` (no bias); `h' = rms(x;
post_attention_layernorm)`, `x += Wd(silu(Wg h') * Wu h')`; final rms, untied head. The biases
are drawn over [-1, 1] (random vectors default to norm-like values near 1). Tolerances:
tests/zoo_oracle.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zoo_oracle as zo
from zoo_kernel import build_mini_kernel, check_full_size, run_mini_kernel

from mkdsl.lang.elaborate import load
from mkdsl.run.random_params import random_params
from mkdsl.run.reference import build_reference

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "qwen2_5_7b.mk"
SEQ_LEN = 64
STEPS = 3
STARTS = (14, 0, SEQ_LEN - STEPS, 31)


class Card:
    def __init__(self, model, weights):
        c = model.const
        self.nh, self.nkv, self.d, self.eps = c["NH"], c["NKV"], c["D"], c["EPS"]
        self.freq = zo.inv_freq(self.d, 1000000.0)
        self.w = {k: zo.f64(v) for k, v in weights.items()}


def qwen_params(model, batch, seed):
    weights, state = random_params(model, {"B": batch, "S": SEQ_LEN}, seed=seed)
    rng = np.random.default_rng(seed)
    for name in ("bq", "bk", "bv"):
        weights[name] = rng.uniform(-1.0, 1.0, weights[name].shape).astype(weights[name].dtype)
    return weights, state


def attention_row(card, cache_k, cache_v, x, pos, layer):
    w = card.w
    h = zo.rms(x, w["attn_norm"][layer], card.eps)
    q = zo.rope((zo.mm(h, w["wq"][layer]) + w["bq"][layer]).reshape(card.nh, card.d), pos, card.freq)
    k = (zo.mm(h, w["wk"][layer]) + w["bk"][layer]).reshape(card.nkv, card.d)
    cache_k[:, pos] = zo.bf16(zo.rope(k, pos, card.freq))
    cache_v[:, pos] = zo.bf16((zo.mm(h, w["wv"][layer]) + w["bv"][layer]).reshape(card.nkv, card.d))
    return zo.mm(zo.attend(q, cache_k, cache_v, 0, pos, card.d**-0.5), w["wo"][layer])


def mlp_row(card, x, layer):
    w = card.w
    h = zo.rms(x, w["mlp_norm"][layer], card.eps)
    return zo.mm(zo.silu(zo.mm(h, w["w_gate"][layer])) * zo.mm(h, w["w_up"][layer]), w["w_down"][layer])


def numpy_step(card, layers, state, tokens, positions):
    k_cache, v_cache = state["k_cache"].copy(), state["v_cache"].copy()
    logits = []
    for b, (tok, pos) in enumerate(zip(tokens, positions)):
        x = card.w["embed"][tok]
        for layer in range(layers):
            x = x + attention_row(card, k_cache[layer, b], v_cache[layer, b], x, int(pos), layer)
            x = x + mlp_row(card, x, layer)
        logits.append(zo.mm(zo.rms(x, card.w["final_norm"], card.eps), card.w["lm_head"]))
    logits = np.stack(logits)
    return logits, logits.argmax(axis=-1), {"k_cache": k_cache, "v_cache": v_cache}, []


def test_full_size_spec_is_the_published_model():
    """28 layers, 28:4 heads of 128, q/k/v biases; 7,615,616,512 parameters (the model card's
    7.61B, 6.53B of them outside the embedding and head); checks on its 4-core mesh."""
    model = load(str(SPEC), None)
    shapes = {t.name: t.full_shape for t in model.tensors}
    assert shapes["wq"] == (28, 3584, 3584) and shapes["bk"] == (28, 512) and shapes["lm_head"] == (3584, 152064)
    params = sum(int(np.prod(t.full_shape)) for t in model.tensors if t.kind == "weight")
    assert params == 7_615_616_512
    local = check_full_size(SPEC, devices=4)
    assert local.tensor("wq").full_shape == (28, 3584, 7 * 128) and local.tensor("wk").full_shape == (28, 3584, 128)


def test_the_32b_profile_is_qwen2_5_32b_on_8_cores():
    """The same body at Qwen2.5-32B's published sizes: 64 layers, 40:8 heads; 32,763,876,352
    parameters from the config's shapes (the model card rounds to 32.5B, 31.0B of them outside
    the embedding and head; the shapes give 31.2B); checks on 8 cores with 5 query heads and 1 KV
    head each."""
    model = load(str(SPEC), "qwen2_5_32b")
    params = sum(int(np.prod(t.full_shape)) for t in model.tensors if t.kind == "weight")
    assert params == 32_763_876_352
    local = check_full_size(SPEC, devices=8, profile="qwen2_5_32b")
    assert local.tensor("wq").full_shape == (64, 5120, 5 * 128) and local.tensor("wk").full_shape == (64, 5120, 128)


@pytest.fixture(scope="module")
def mini():
    return load(str(SPEC), "mini")


@pytest.mark.parametrize("batch", [1, 4])
def test_reference_matches_an_independent_numpy_decode(batch, mini):
    weights, state = qwen_params(mini, batch, seed=50 + batch)
    card = Card(mini, weights)
    assert (card.nh // card.nkv, card.d) == (7, 128)
    tokens = np.random.default_rng(batch).integers(0, 1024, batch).astype(np.int32)
    positions = np.asarray(STARTS[:batch], np.int32)
    oracle = lambda s, t, p: numpy_step(card, len(mini.schedule), s, t, p)  # noqa: E731
    zo.compare_steps(build_reference(mini), oracle, weights, state, tokens, positions, STEPS)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return build_mini_kernel(SPEC, tmp_path_factory.mktemp("qwen2_5_mini"))


@pytest.mark.timeout(900)
def test_mini_kernel_matches_reference_sharded_interpret(kernel, record_property):
    """Batch 4, three steps, layer by layer (mkdsl.verify.kernel.LayerChecker); no race, no NaN."""
    assert kernel[1].MESH_SHAPE == (2,)
    worst = run_mini_kernel(kernel, 4, SEQ_LEN, STARTS, STEPS, seed=14, vocab=1024)
    record_property("worst_of_bound", round(max(worst.values()), 4))
