"""specs/llama4_scout.mk, written from the published config and transformers' Llama4TextModel:
its full-size step checks and plans on its 8-core mesh; its reference (mini) against an
independent numpy decode written here from the published equations; its mini kernel against the
reference in TPU interpret mode, sharded over 4 devices (ep 2 x tp 2), with the race detector on.
(`mkdsl verify --against transformers` runs the spec against transformers itself:
tests/test_oracle_transformers.py.)

The numpy decode follows the model card / transformers, not mkdsl's ops: per layer
`h = rms(x; input_layernorm)`; on RoPE layers (l + 1) % NOPE_EVERY != 0, q and k rotated in
interleaved pairs (2i, 2i + 1) at llama3-scaled frequencies (factor 16, low = high = 1, original
8192: frequencies of wavelength above 8192 divided by 16), then each head divided by its RMS
(weightless, eps 1e-5), attention over the query's own chunk of CHUNK positions; on NoPE layers
no rotation and no norm, the query times 1 + 0.1·log1p(floor((p + 1) / FLOOR_SCALE)), attention
over 0..p; scale D^-0.5; `x += Wo o`; `h' = rms(x; post_attention_layernorm)`; the top-1 router
logit l_e, its score sigmoid(l_e), `x += shared(h') + expert_e(sigmoid(l_e) · h')` with SwiGLU
experts; final rms, untied head. Every matmul input rounded to bf16 (the deployed model's bf16
activations; routed_in = h · score is rounded as the product it is). Tolerances: tests/zoo_oracle.py;
a top-1 choice is only defined up to bf16 flips of a router logit, so a near tie (the two best
logits within ROUTE_TIE of the row's largest |logit|) fails as "pick another seed".
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import zoo_oracle as zo
from zoo_kernel import build_mini_kernel, check_full_size, run_mini_kernel

from mkdsl.lang.elaborate import load
from mkdsl.run.random_params import random_params
from mkdsl.run.reference import build_reference

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "llama4_scout.mk"
SEQ_LEN = 64
STEPS = 3
STARTS = (6, 0, SEQ_LEN - STEPS, 31)  # row 0 crosses a chunk (8) and a temperature step (floor 4)
ROUTE_TIE = 2.0**-10


class Card:
    def __init__(self, model, weights):
        c = model.const
        self.nh, self.nkv, self.d, self.eps = c["NH"], c["NKV"], c["D"], c["EPS"]
        self.chunk, self.every = c["CHUNK"], c["NOPE_EVERY"]
        self.floor_scale, self.attn_scale = c["FLOOR_SCALE"], c["ATTN_SCALE"]
        base = 500000.0 ** (-np.arange(0, self.d, 2) / self.d)
        self.freq = np.where(2 * math.pi / base > 8192, base / 16.0, base)  # llama3, low = high = 1
        self.w = {k: zo.f64(v) for k, v in weights.items()}


def rope_interleaved(x, pos, freq):
    """x [heads, d]: pairs (2i, 2i + 1) rotated by pos · freq[i] (transformers' view_as_complex)."""
    a, b = x[:, 0::2], x[:, 1::2]
    cos, sin = np.cos(pos * freq), np.sin(pos * freq)
    out = np.empty_like(x)
    out[:, 0::2], out[:, 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def weightless_rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def attention_row(card, cache_k, cache_v, x, pos, layer):
    w = card.w
    h = zo.rms(x, w["attn_norm"][layer], card.eps)
    q = zo.mm(h, w["wq"][layer]).reshape(card.nh, card.d)
    k = zo.mm(h, w["wk"][layer]).reshape(card.nkv, card.d)
    if (layer + 1) % card.every != 0:  # RoPE layer: rotate, weightless qk norm, chunked attention
        q = weightless_rms(rope_interleaved(q, pos, card.freq), card.eps)
        k = weightless_rms(rope_interleaved(k, pos, card.freq), card.eps)
        first = pos - pos % card.chunk
    else:  # NoPE layer: attention temperature on the query, global attention
        q = q * (1.0 + card.attn_scale * math.log1p(math.floor((pos + 1) / card.floor_scale)))
        first = 0
    cache_k[:, pos] = zo.bf16(k)
    cache_v[:, pos] = zo.bf16(zo.mm(h, w["wv"][layer]).reshape(card.nkv, card.d))
    return zo.mm(zo.attend(q, cache_k, cache_v, first, pos, card.d**-0.5), w["wo"][layer])


def swiglu_mlp(h, gate, up, down):
    return zo.mm(zo.silu(zo.mm(h, gate)) * zo.mm(h, up), down)


def moe_row(card, x, layer, ties: list):
    w = card.w
    h = zo.rms(x, w["mlp_norm"][layer], card.eps)
    logits = zo.mm(h, w["router"][layer])
    order = np.argsort(-logits, kind="stable")
    if logits[order[0]] - logits[order[1]] < ROUTE_TIE * np.abs(logits).max():
        ties.append(layer)
    e = order[0]
    score = 1.0 / (1.0 + np.exp(-logits[e]))
    routed = swiglu_mlp(score * h, w["w_gate"][layer][e], w["w_up"][layer][e], w["w_down"][layer][e])
    return swiglu_mlp(h, w["ws_gate"][layer], w["ws_up"][layer], w["ws_down"][layer]) + routed


def numpy_step(card, layers, state, tokens, positions):
    k_cache, v_cache = state["k_cache"].copy(), state["v_cache"].copy()
    logits, ties = [], []
    for b, (tok, pos) in enumerate(zip(tokens, positions)):
        x = card.w["embed"][tok]
        for layer in range(layers):
            x = x + attention_row(card, k_cache[layer, b], v_cache[layer, b], x, int(pos), layer)
            x = x + moe_row(card, x, layer, ties)
        logits.append(zo.mm(zo.rms(x, card.w["final_norm"], card.eps), card.w["lm_head"]))
    logits = np.stack(logits)
    return logits, logits.argmax(axis=-1), {"k_cache": k_cache, "v_cache": v_cache}, ties


def test_full_size_spec_is_the_published_model():
    """48 layers, 36 chunked RoPE and 12 NoPE; 16 bf16 experts of width 8192 and a shared expert;
    40:8 heads of 128; 107.77B text-model parameters (the published 109B counts the vision encoder
    too); the whole step checks on its 8-core mesh, 2 experts per core."""
    model = load(str(SPEC), None)
    assert model.schedule.count("nope") == 12 and model.schedule.count("chunked") == 36
    assert [i for i, kind in enumerate(model.schedule) if kind == "nope"][:3] == [3, 7, 11]
    shapes = {t.name: t.full_shape for t in model.tensors}
    assert shapes["w_gate"] == (48, 16, 5120, 8192) and shapes["w_down"] == (48, 16, 8192, 5120)
    assert shapes["wq"] == (48, 5120, 5120) and shapes["wk"] == (48, 5120, 1024)
    assert shapes["lm_head"] == (5120, 202048) and shapes["ws_up"] == (48, 5120, 8192)
    params = sum(int(np.prod(t.full_shape)) for t in model.tensors if t.kind == "weight")
    assert round(params / 1e9, 2) == 107.77
    local = check_full_size(SPEC, devices=8)
    assert local.tensor("w_gate").full_shape == (48, 2, 5120, 8192)


@pytest.fixture(scope="module")
def mini():
    return load(str(SPEC), "mini")


@pytest.mark.parametrize("batch", [4])
def test_reference_matches_an_independent_numpy_decode(batch, mini):
    weights, state = random_params(mini, {"B": batch, "S": SEQ_LEN}, seed=80 + batch)
    card = Card(mini, weights)
    assert (card.chunk, card.every, card.floor_scale, mini.schedule) == (8, 2, 4, ("chunked", "nope"))
    tokens = np.random.default_rng(batch).integers(0, 1000, batch).astype(np.int32)
    positions = np.asarray(STARTS[:batch], np.int32)
    oracle = lambda s, t, p: numpy_step(card, len(mini.schedule), s, t, p)  # noqa: E731
    zo.compare_steps(build_reference(mini), oracle, weights, state, tokens, positions, STEPS)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    return build_mini_kernel(SPEC, tmp_path_factory.mktemp("llama4_mini"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mini_kernel_matches_reference_sharded_interpret(kernel, record_property):
    """Batch 2, two steps from positions 7 and 10 (row 0 crosses into the second chunk and the
    next temperature step), layer by layer (mkdsl.verify.kernel.LayerChecker); no race, no NaN."""
    assert kernel[1].MESH_SHAPE == (2, 2)
    worst = run_mini_kernel(kernel, 2, SEQ_LEN, (7, 10), 2, seed=17, vocab=1000)
    record_property("worst_of_bound", round(max(worst.values()), 4))


@pytest.mark.slow
def test_mini_prefill_per_device_equals_the_whole_prefill():
    """The SPMD prefill rules of the new capabilities (the chunk mask, the temperature from the
    positions, the weightless qk norm over split heads, experts weighted on their input over ep):
    over ep 2 x tp 2, a 12-token prompt (crossing the chunk of 8 and the temperature steps of 4)
    and a 5-token one; the bounds are tests/test_prefill_spmd.py's, derived there."""
    import jax.numpy as jnp
    from test_prefill_spmd import _f32, _mesh, _state_ratio

    import mkdsl
    from mkdsl.run.prefill import build_prefill
    from mkdsl.run.prefill_spmd import build_sharded_prefill
    from mkdsl.verify.kernel import LOGIT_RTOL

    spec = mkdsl.load(str(SPEC), "mini")
    model = spec.model
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=SEQ_LEN, seed=9)
    state = {k: jnp.asarray(v) for k, v in state.items()}
    tokens = np.random.default_rng(9).integers(0, 1000, (2, 12)).astype(np.int32)
    lengths = np.array([12, 5], np.int32)
    want_logits, want_tokens, want = build_prefill(model, donate=False)(weights, state, tokens, lengths)
    logits, next_tokens, got = build_sharded_prefill(model, _mesh(model))(weights, state, tokens, lengths)
    worst = {t.name: _state_ratio(model, t, want[t.name], got[t.name]) for t in model.states}
    scale = np.abs(_f32(want_logits)).max(axis=-1)
    err = np.abs(_f32(logits) - _f32(want_logits)).max(axis=-1)
    worst["logits"] = float((err / ((len(model.schedule) + 1) * LOGIT_RTOL * scale)).max())
    assert {k: round(v, 3) for k, v in worst.items() if not v <= 1} == {}, worst
    assert (np.asarray(next_tokens) == np.asarray(want_tokens)).all()
