"""specs/phi3_mini_4k.mk, written from the published config as a new user would: its full-size
step checks and plans on its 2-core mesh (head dim 96, a 2047-token window); its reference (mini)
against an independent numpy decode written here from the published equations; its mini kernel
against the reference in TPU interpret mode, sharded over 2 devices, with the race detector on.

The numpy decode follows transformers' Phi3ForCausalLM, not mkdsl's ops: per layer `h = rms(x;
input_layernorm)`, `q, k, v` the three row blocks of the fused qkv_proj applied to h,
rotate-half RoPE over the whole 96-wide head (theta 1e4), attention at scale 96^-0.5 over the
last `window` tokens (the new one included), `x += Wo o`; `h' = rms(x; post_attention_layernorm)`,
`gate, up` the two halves of the fused gate_up_proj, `x += Wd(silu(gate) * up)`; final rms,
untied head. Tolerances: tests/zoo_oracle.py.
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
SPEC = ROOT / "specs" / "phi3_mini_4k.mk"
SEQ_LEN = 64
STEPS = 3
STARTS = (50, 0, SEQ_LEN - STEPS, 38)  # rows 0 and 2 (and 3 from its third step) see past the window


class Card:
    def __init__(self, model, weights):
        c = model.const
        self.nh, self.d, self.eps, self.window = c["NH"], c["D"], c["EPS"], c["WINDOW"]
        self.freq = zo.inv_freq(self.d, 10000.0)
        w = {k: zo.f64(v) for k, v in weights.items()}
        # the checkpoint's fused projections, [in, out]: q | k | v and gate | up side by side
        w["qkv"] = np.concatenate([w["wq"], w["wk"], w["wv"]], axis=-1)
        w["gate_up"] = np.concatenate([w["w_gate"], w["w_up"]], axis=-1)
        self.w = w


def attention_row(card, cache_k, cache_v, x, pos, layer):
    w, n = card.w, card.nh * card.d
    qkv = zo.mm(zo.rms(x, w["attn_norm"][layer], card.eps), w["qkv"][layer])
    q = zo.rope(qkv[:n].reshape(card.nh, card.d), pos, card.freq)
    cache_k[:, pos] = zo.bf16(zo.rope(qkv[n : 2 * n].reshape(card.nh, card.d), pos, card.freq))
    cache_v[:, pos] = zo.bf16(qkv[2 * n :].reshape(card.nh, card.d))
    first = max(0, pos - card.window + 1)
    return zo.mm(zo.attend(q, cache_k, cache_v, first, pos, card.d**-0.5), w["wo"][layer])


def mlp_row(card, x, layer):
    w = card.w
    gate, up = np.split(zo.mm(zo.rms(x, w["mlp_norm"][layer], card.eps), w["gate_up"][layer]), 2)
    return zo.mm(zo.silu(gate) * up, w["w_down"][layer])


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
    """32 layers, 32 heads of 96, window 2047; 3,821,079,552 parameters (the published 3.8B);
    checks on its 2-core mesh, 16 heads (1536 columns) per core."""
    model = load(str(SPEC), None)
    shapes = {t.name: t.full_shape for t in model.tensors}
    assert shapes["wq"] == (32, 3072, 3072) and shapes["k_cache"][2:] == (32, "S", 96)
    params = sum(int(np.prod(t.full_shape)) for t in model.tensors if t.kind == "weight")
    assert params == 3_821_079_552
    local = check_full_size(SPEC, devices=2)
    assert local.tensor("wk").full_shape == (32, 3072, 1536)


@pytest.fixture(scope="module")
def mini():
    return load(str(SPEC), "mini")


@pytest.mark.parametrize("batch", [1, 4])
def test_reference_matches_an_independent_numpy_decode(batch, mini):
    weights, state = random_params(mini, {"B": batch, "S": SEQ_LEN}, seed=70 + batch)
    card = Card(mini, weights)
    assert card.window < STARTS[0] and card.d == 96
    tokens = np.random.default_rng(batch).integers(0, 1000, batch).astype(np.int32)
    positions = np.asarray(STARTS[:batch], np.int32)
    oracle = lambda s, t, p: numpy_step(card, len(mini.schedule), s, t, p)  # noqa: E731
    zo.compare_steps(build_reference(mini), oracle, weights, state, tokens, positions, STEPS)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return build_mini_kernel(SPEC, tmp_path_factory.mktemp("phi3_mini"))


@pytest.mark.timeout(900)
def test_mini_kernel_matches_reference_sharded_interpret(kernel, record_property):
    """Batch 4, three steps, layer by layer (mkdsl.verify.kernel.LayerChecker); no race, no NaN."""
    assert kernel[1].MESH_SHAPE == (2,)
    worst = run_mini_kernel(kernel, 4, SEQ_LEN, STARTS, STEPS, seed=14, vocab=1000)
    record_property("worst_of_bound", round(max(worst.values()), 4))
