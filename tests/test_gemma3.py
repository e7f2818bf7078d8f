"""specs/gemma3_27b.mk, written from the published config as a new user would: its full-size step
checks and plans on its 4-core mesh; its reference (mini) against an independent numpy decode
written here from the published equations; its mini kernel against the reference in TPU
interpret mode, sharded over 2 devices, with the race detector on.

The numpy decode follows transformers' Gemma3TextModel, not mkdsl's ops: `x = embed[t] *
sqrt(H)`; per layer `h = rms1p(x; input_layernorm)`, `q = rope(rms1p_head(Wq h; q_norm))`,
`k = rope(rms1p_head(Wk h; k_norm))`, `v = Wv h` (rms1p: weights 1 + w; rotate-half RoPE over
the whole head, base 10000 on local layers, base 1e6 with every frequency divided by 8 on global
ones, layer l global when (l + 1) % pattern == 0), attention at scale query_pre_attn_scalar^-0.5
over the cache (local layers: the last `window` tokens, the new one included), `x += rms1p(Wo o;
post_attention_layernorm)`, `h = rms1p(x; pre_feedforward_layernorm)`, `x += rms1p(Wd
(gelu_tanh(Wg h) * Wu h); post_feedforward_layernorm)`; final rms1p, logits by the embedding
table transposed. Tolerances: tests/zoo_oracle.py.

The norm weights are drawn around 0 (Gemma stores them zero-centred), so `1 + w` and `w` differ
by a factor of about 1/|w|; the mini window (32) is shorter than the cache, so local and global
layers see different tokens.
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
SPEC = ROOT / "specs" / "gemma3_27b.mk"
SEQ_LEN = 64
STEPS = 3
STARTS = (40, 0, SEQ_LEN - STEPS, 30)  # rows 0 and 2 (and 3 from its second step) see past the window
NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "pre_ffn_norm", "post_ffn_norm", "final_norm")


class Card:
    def __init__(self, model, weights):
        c = model.const
        self.nh, self.nkv, self.d, self.eps = c["NH"], c["NKV"], c["D"], c["EPS"]
        self.window, self.pattern, self.h = c["WINDOW"], c["PATTERN"], c["H"]
        self.scale = c["QPAS"] ** -0.5
        self.local_freq = zo.inv_freq(self.d, 10000.0)
        self.global_freq = zo.inv_freq(self.d, 1000000.0, 8.0)
        self.w = {k: zo.f64(v) for k, v in weights.items()}


def gemma_params(model, batch, seed):
    weights, state = random_params(model, {"B": batch, "S": SEQ_LEN}, seed=seed)
    rng = np.random.default_rng(seed)
    for name in NORMS:
        weights[name] = rng.uniform(-0.5, 0.5, weights[name].shape).astype(weights[name].dtype)
    return weights, state


def attention_row(card, cache_k, cache_v, x, pos, layer):
    w, n = card.w, lambda v, name: zo.rms(v, w[name][layer], card.eps, offset=1.0)
    is_global = (layer + 1) % card.pattern == 0
    freq = card.global_freq if is_global else card.local_freq
    h = n(x, "attn_norm")
    q = zo.rope(n(zo.mm(h, w["wq"][layer]).reshape(card.nh, card.d), "q_norm"), pos, freq)
    k = zo.rope(n(zo.mm(h, w["wk"][layer]).reshape(card.nkv, card.d), "k_norm"), pos, freq)
    cache_k[:, pos] = zo.bf16(k)
    cache_v[:, pos] = zo.bf16(zo.mm(h, w["wv"][layer]).reshape(card.nkv, card.d))
    first = 0 if is_global else max(0, pos - card.window + 1)
    o = zo.attend(q, cache_k, cache_v, first, pos, card.scale)
    return n(zo.mm(o, w["wo"][layer]), "post_attn_norm")


def mlp_row(card, x, layer):
    w, n = card.w, lambda v, name: zo.rms(v, w[name][layer], card.eps, offset=1.0)
    h = n(x, "pre_ffn_norm")
    a = zo.gelu_tanh(zo.mm(h, w["w_gate"][layer])) * zo.mm(h, w["w_up"][layer])
    return n(zo.mm(a, w["w_down"][layer]), "post_ffn_norm")


def numpy_step(card, layers, state, tokens, positions):
    k_cache, v_cache = state["k_cache"].copy(), state["v_cache"].copy()
    logits = []
    for b, (tok, pos) in enumerate(zip(tokens, positions)):
        x = card.w["embed"][tok] * np.sqrt(card.h)
        for layer in range(layers):
            x = x + attention_row(card, k_cache[layer, b], v_cache[layer, b], x, int(pos), layer)
            x = x + mlp_row(card, x, layer)
        logits.append(zo.mm(zo.rms(x, card.w["final_norm"], card.eps, offset=1.0), card.w["embed"].T))
    logits = np.stack(logits)
    return logits, logits.argmax(axis=-1), {"k_cache": k_cache, "v_cache": v_cache}, []


def test_full_size_spec_is_the_published_model():
    """62 layers, every 6th global (5, 11, ..., 59); the tied head over the 262208-row table split
    4 ways by vocabulary rows; the whole step checks (planner, lowerings, HBM) on its mesh."""
    model = load(str(SPEC), None)
    assert [i for i, kind in enumerate(model.schedule) if kind == "global"] == list(range(5, 62, 6))
    shapes = {t.name: t.full_shape for t in model.tensors}
    assert shapes["embed"] == (262208, 5376) and shapes["wq"] == (62, 5376, 4096)
    assert shapes["wk"] == (62, 5376, 2048) and shapes["w_down"] == (62, 21504, 5376)
    local = check_full_size(SPEC, devices=4)
    assert local.tensor("wq").full_shape == (62, 5376, 1024)


def test_the_4b_profile_is_gemma3_4b_at_head_dim_256():
    """The same body at Gemma 3 4B's published sizes: 34 layers (5 global), 8:4 heads of 256,
    scale 256^-0.5; checks on 2 cores."""
    model = load(str(SPEC), "gemma3_4b")
    assert [i for i, kind in enumerate(model.schedule) if kind == "global"] == [5, 11, 17, 23, 29]
    assert {t.name: t.full_shape for t in model.tensors}["wq"] == (34, 2560, 2048)
    local = check_full_size(SPEC, devices=2, profile="gemma3_4b")
    assert local.tensor("k_cache").full_shape[2:] == (2, "S", 256)


@pytest.fixture(scope="module")
def mini():
    return load(str(SPEC), "mini")


@pytest.mark.parametrize("batch", [1, 4])
def test_reference_matches_an_independent_numpy_decode(batch, mini):
    weights, state = gemma_params(mini, batch, seed=30 + batch)
    card = Card(mini, weights)
    assert card.window < STARTS[0] and card.pattern == 2 and len(mini.schedule) == 2
    tokens = np.random.default_rng(batch).integers(0, 1000, batch).astype(np.int32)
    positions = np.asarray(STARTS[:batch], np.int32)
    oracle = lambda s, t, p: numpy_step(card, len(mini.schedule), s, t, p)  # noqa: E731
    zo.compare_steps(build_reference(mini), oracle, weights, state, tokens, positions, STEPS)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return build_mini_kernel(SPEC, tmp_path_factory.mktemp("gemma3_mini"))


@pytest.mark.timeout(900)
def test_mini_kernel_matches_reference_sharded_interpret(kernel, record_property):
    """Batch 4, three steps, layer by layer (mkdsl.verify.kernel.LayerChecker); no race, no NaN."""
    assert kernel[1].MESH_SHAPE == (2,)
    worst = run_mini_kernel(kernel, 4, SEQ_LEN, STARTS, STEPS, seed=14, vocab=1000)
    record_property("worst_of_bound", round(max(worst.values()), 4))
