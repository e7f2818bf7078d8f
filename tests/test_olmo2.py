"""specs/olmo2_7b.mk, written from the published config as a new user would: its full-size step
checks and plans on its 2-core mesh, the full-width q/k norms on split rows; its reference (mini)
against an independent numpy decode written here from the published equations; its mini kernel
against the reference in TPU interpret mode, sharded over 2 devices, with the race detector on.

The numpy decode follows transformers' Olmo2ForCausalLM, not mkdsl's ops: per layer, no pre-norm:
`q = rope(rms(Wq x; q_norm))`, `k = rope(rms(Wk x; k_norm))` with each norm over the whole
projection (all heads at once), `v = Wv x` (rotate-half RoPE over the whole head, theta 5e5),
attention at scale 128^-0.5 over the cache with the new token, `x += rms(Wo o;
post_attention_layernorm)`, `x += rms(Wd(silu(Wg x) * Wu x); post_feedforward_layernorm)`; final
rms, untied head. Tolerances: tests/zoo_oracle.py.
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
SPEC = ROOT / "specs" / "olmo2_7b.mk"
SEQ_LEN = 64
STEPS = 3
STARTS = (14, 0, SEQ_LEN - STEPS, 31)


class Card:
    def __init__(self, model, weights):
        c = model.const
        self.nh, self.d, self.eps = c["NH"], c["D"], c["EPS"]
        self.freq = zo.inv_freq(self.d, 500000.0)
        self.w = {k: zo.f64(v) for k, v in weights.items()}


def attention_row(card, cache_k, cache_v, x, pos, layer):
    w = card.w
    q = zo.rms(zo.mm(x, w["wq"][layer]), w["q_norm"][layer], card.eps)  # over all heads at once
    k = zo.rms(zo.mm(x, w["wk"][layer]), w["k_norm"][layer], card.eps)
    q = zo.rope(q.reshape(card.nh, card.d), pos, card.freq)
    cache_k[:, pos] = zo.bf16(zo.rope(k.reshape(card.nh, card.d), pos, card.freq))
    cache_v[:, pos] = zo.bf16(zo.mm(x, w["wv"][layer]).reshape(card.nh, card.d))
    o = zo.mm(zo.attend(q, cache_k, cache_v, 0, pos, card.d**-0.5), w["wo"][layer])
    return zo.rms(o, w["post_attn_norm"][layer], card.eps)


def mlp_row(card, x, layer):
    w = card.w
    y = zo.mm(zo.silu(zo.mm(x, w["w_gate"][layer])) * zo.mm(x, w["w_up"][layer]), w["w_down"][layer])
    return zo.rms(y, w["post_ffn_norm"][layer], card.eps)


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
    """32 layers, 32 heads of 128, full-width q/k norms [4096]; 7,298,617,344 parameters (the
    published 7.3B); checks on its 2-core mesh, each core normalising its half of q and k."""
    model = load(str(SPEC), None)
    shapes = {t.name: t.full_shape for t in model.tensors}
    assert shapes["q_norm"] == (32, 4096) and shapes["k_norm"] == (32, 4096) and shapes["lm_head"] == (4096, 100352)
    params = sum(int(np.prod(t.full_shape)) for t in model.tensors if t.kind == "weight")
    assert params == 7_298_617_344
    local = check_full_size(SPEC, devices=2)
    assert local.tensor("q_norm").full_shape == (32, 2048)
    nodes = local.kind("decoder").nodes
    sums = [n.outputs[0].type.shape[1] for n in nodes if n.op == "all_reduce"]
    assert sums.count(1) == 2 and not [n for n in nodes if n.op == "all_gather"]  # a [B, 1] sum per q/k norm


@pytest.fixture(scope="module")
def mini():
    return load(str(SPEC), "mini")


@pytest.mark.parametrize("batch", [1, 4])
def test_reference_matches_an_independent_numpy_decode(batch, mini):
    weights, state = random_params(mini, {"B": batch, "S": SEQ_LEN}, seed=60 + batch)
    card = Card(mini, weights)
    tokens = np.random.default_rng(batch).integers(0, 1024, batch).astype(np.int32)
    positions = np.asarray(STARTS[:batch], np.int32)
    oracle = lambda s, t, p: numpy_step(card, len(mini.schedule), s, t, p)  # noqa: E731
    zo.compare_steps(build_reference(mini), oracle, weights, state, tokens, positions, STEPS)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return build_mini_kernel(SPEC, tmp_path_factory.mktemp("olmo2_mini"))


@pytest.mark.timeout(900)
def test_mini_kernel_matches_reference_sharded_interpret(kernel, record_property):
    """Batch 4, three steps, layer by layer (mkdsl.verify.kernel.LayerChecker); no race, no NaN."""
    assert kernel[1].MESH_SHAPE == (2,)
    worst = run_mini_kernel(kernel, 4, SEQ_LEN, STARTS, STEPS, seed=14, vocab=1024)
    record_property("worst_of_bound", round(max(worst.values()), 4))
