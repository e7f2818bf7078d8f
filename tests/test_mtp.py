"""Multi-token prediction heads in a target spec (`mtp(h: ..., tokens, positions) { ... }`):
DeepSeek-V3's, in specs/deepseek_v3.mk, against the published equations, and its host drafter.

The oracle (numpy, float64) computes the MTP-specific equations of the DeepSeek-V3 report:
h' = eh_proj · [RMSNorm(Emb(t)); RMSNorm(h)] (the order of `eh_proj`'s name), then one
transformer layer, then the head's RMSNorm and the shared output head. The transformer layer is
"a normal layer" of the model: the oracle runs the spec's own MoE layer (its reference, tested
against its own oracles and the kernel elsewhere) with the MTP layer's weights put in its place.

Tolerance: 3% of the largest magnitude of each result. The oracle rounds `linear`'s inputs to
bf16 as the numeric contract says; where float64 and f32 round an input differently it moves by
one bf16 ulp (2^-8), and a result passes through at most ~8 such products (eh_proj, the layer's
MLA and MoE, the head): <= 8·2^-8 = 3%. Swapping the concatenation's halves, a missing norm or a
wrong head moves the results by O(their magnitude).
"""

from __future__ import annotations

import numpy as np
import pytest

import mkdsl
from mkdsl.lang.diagnostics import SpecError
from mkdsl.run.reference import build_layered_reference, build_mtp_reference
from mkdsl.run.spec_drafters import MtpDrafter, make_drafter

DSV3 = "specs/deepseek_v3.mk"
MTP_LAYER = {  # the MTP layer's weight -> the layers' weight it stands for
    "mtp_attn_norm": "attn_norm",
    "mtp_mlp_norm": "mlp_norm",
    "mtp_wq_a": "wq_a",
    "mtp_q_norm": "q_norm",
    "mtp_wq_b": "wq_b",
    "mtp_wkv_a": "wkv_a",
    "mtp_kv_norm": "kv_norm",
    "mtp_wkv_b": "wkv_b",
    "mtp_wo": "wo",
    "mtp_router": "router",
    "mtp_router_bias": "router_bias",
    "mtp_w_gate": "w_gate",
    "mtp_w_up": "w_up",
    "mtp_w_down": "w_down",
    "mtp_shared_gate": "shared_gate",
    "mtp_shared_up": "shared_up",
    "mtp_shared_down": "shared_down",
}


def _bf16(x) -> np.ndarray:
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _as_layer(model, weights, state, layer):
    """The weights and state with layer `layer`'s slots holding the MTP layer's."""
    from mkdsl.lang.quant import QTensor

    w = dict(weights)
    for mtp, name in MTP_LAYER.items():
        slot = model.tensor(name).slots[layer]
        src, dst = weights[mtp], weights[name]
        if isinstance(dst, QTensor):
            codes, scales = np.array(dst.codes), np.array(dst.scales)
            codes[slot], scales[slot] = src.codes, src.scales
            w[name] = QTensor(codes, scales, dst.fmt, dst.group)
        else:
            w[name] = np.array(dst)
            w[name][slot] = src
    st = dict(state)
    st["kv_cache"] = np.array(state["kv_cache"])
    st["kv_cache"][model.tensor("kv_cache").slots[layer]] = state["mtp_cache"]
    return w, st


def test_deepseek_v3_mtp_equals_the_published_equations():
    spec = mkdsl.load(DSV3, profile="mini")
    m = spec.model
    assert m.mtp is not None and [v.name for v in m.mtp_inputs] == ["tokens", "positions"]
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=16, seed=7)
    rng = np.random.default_rng(7)
    h = rng.standard_normal((2, m.const["H"])).astype(np.float32)
    tokens, positions = np.array([11, 700], np.int32), np.array([3, 9], np.int32)
    got_h, got_logits, new = build_mtp_reference(m)(weights, state, h, tokens, positions)

    e = _rms(_f64(weights["embed"])[tokens], _f64(weights["mtp_enorm"]))
    x0 = _bf16(np.concatenate([e, _rms(h.astype(np.float64), _f64(weights["mtp_hnorm"]))], axis=1))
    x0 = x0 @ _f64(weights["mtp_eh_proj"])
    moe = m.schedule.index("moe")
    w, st = _as_layer(m, weights, state, moe)
    (x1,), layer_state = build_layered_reference(m).layer(moe, w, st, tokens, positions, [x0.astype(np.float32)])
    x1 = _f64(x1)
    logits = _bf16(_rms(x1, _f64(weights["mtp_head_norm"]))) @ _f64(weights["lm_head"])

    for got, want in ((got_h, x1), (got_logits, logits)):
        got = _f64(got)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * np.abs(want).max())
    # the head wrote its own cache (the layer's, in the oracle) at the rows' positions, the same
    # bf16 entries up to an ulp (the layer's input differs from the head's by f32 vs float64)
    slot = m.tensor("kv_cache").slots[moe]
    got_c, want_c = (_f64(c)[np.arange(2), positions] for c in (new["mtp_cache"], layer_state["kv_cache"][slot]))
    np.testing.assert_allclose(got_c, want_c, rtol=2**-7, atol=0.03 * np.abs(want_c).max())


def test_mtp_drafter_chains_the_head():
    """Each draft is the argmax of the head's logits, fed the head's own hidden state and the draft
    before it; the prompt's pairs (hidden state, next token) fill the head's cache first."""
    target = mkdsl.load(DSV3, profile="mini")
    d = make_drafter("mtp", target, rows=3, seq_len=32, seed=1)
    assert isinstance(d, MtpDrafter) and d.context_layers == (len(target.model.schedule) - 1,)
    rng = np.random.default_rng(1)
    prompt = [5, 9, 13, 21]
    ctx = rng.standard_normal((4, 1, target.model.const["H"])).astype(np.float32)
    d.start(prompt, ctx)
    drafts = d.propose(40, 4)
    assert len(drafts) == 2 and all(0 <= t < target.model.const["V"] for t in drafts)
    # by hand: a fresh head fed the same pairs
    mtp = d._mtp  # the head's jitted reference (tested above against the equations)
    state = {k: v for k, v in d._empty_state().items()}
    for i in range(3):
        _, _, state = mtp(d.weights, state, ctx[i], np.array([prompt[i + 1]], np.int32), np.array([i + 1], np.int32))
    h1, logits1, state = mtp(d.weights, state, ctx[3], np.array([40], np.int32), np.array([4], np.int32))
    first = int(np.argmax(np.asarray(logits1)[0]))
    _, logits2, _ = mtp(d.weights, state, np.asarray(h1), np.array([first], np.int32), np.array([5], np.int32))
    assert drafts == [first, int(np.argmax(np.asarray(logits2)[0]))]
    d.accept([drafts[0], 77], rng.standard_normal((2, 1, target.model.const["H"])).astype(np.float32))
    assert len(d.propose(77, 6)) == 2


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("mtp(h: f32[B, H], tokens, positions)", "mtp(h: i32[B, H], tokens, positions)", "must be a float [B, width]"),
        ("mtp(h: f32[B, H], tokens, positions)", "mtp(h: f32[H], tokens, positions)", "must be a float [B, width]"),
        (
            "  return x, linear(rmsnorm(x, mtp_head_norm",
            "  return x, x, linear(rmsnorm(x, mtp_head_norm",
            "`mtp` must return",
        ),
        ("x = linear(concat(e, rmsnorm(h,", "x = linear(concat(tokens, rmsnorm(h,", "concat"),
    ],
)
def test_mtp_errors_point_at_the_head(tmp_path, old, new, message):
    text = open(DSV3, encoding="utf-8").read()
    assert old in text
    path = tmp_path / "bad.mk"
    path.write_text(text.replace(old, new), encoding="utf-8")
    with pytest.raises(SpecError) as e:
        mkdsl.load(path, profile="mini")
    assert message in str(e.value)
