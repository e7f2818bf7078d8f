"""Kimi K3's DSpark block drafter as a spec (specs/kimi_k3_dspark.mk) and its host drafter
(mkdsl/run/spec_drafters.py): the `context ... from layers` declaration, pairing with Kimi K3,
and drafting through the reference with the context fed in steps."""

from __future__ import annotations

import numpy as np
import pytest

import mkdsl
from mkdsl.api import make_drafter
from mkdsl.lang.diagnostics import SpecError
from mkdsl.run.spec_drafters import DraftSpecError, SpecDrafter, random_drafter_weights

DSPARK = "specs/kimi_k3_dspark.mk"


def test_full_size_declares_the_published_drafter():
    """The sizes the checkpoint's config gives, and the five target layers of its context."""
    m = mkdsl.load(DSPARK).model
    c = m.const
    assert (len(m.schedule), c["H"], c["V"], c["NH"], c["NKV"], c["D"], c["F"]) == (5, 7168, 163840, 96, 16, 64, 14336)
    assert (c["W"], c["MR"], c["MASK"], c["EPS"], c["THETA"]) == (2048, 256, 163837, 1e-5, 10000.0)
    assert m.context == ("context", "context_pos", (24, 48, 72, 88, 92))
    assert m.tensor("context").type.shape[1] == 5 * 7168
    assert m.tensor("fc").type.shape == (5 * 7168, 7168)


def test_mini_pairs_with_kimi_mini():
    """Same vocabulary and width as Kimi K3's mini; its context layers exist there."""
    kimi = mkdsl.load("specs/kimi_k3.mk", profile="mini").model
    draft = mkdsl.load(DSPARK, profile="mini").model
    assert (draft.const["V"], draft.const["H"]) == (kimi.const["V"], kimi.const["H"])
    assert all(lay < len(kimi.schedule) for lay in draft.context[2])


@pytest.mark.parametrize(
    "line, message",
    [
        ("context context at context_pos from layers 1, 1", "name a layer twice"),
        ("context nothing at context_pos from layers 1", "not a declared state tensor"),
        ("context context at slot_pos from layers 1, 2", "must be a state i32[B]"),
        ("context context at context_pos from layers 1, 2, 3", "do not hold 3 layers"),
    ],
)
def test_context_declaration_errors(tmp_path, line, message):
    text = open(DSPARK, encoding="utf-8").read()
    text = text.replace("context context at context_pos from layers C1, C2, C3, C4, C5", line)
    text = text.replace("const NC    = 5", "const NC    = 2")
    path = tmp_path / "bad.mk"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as e:
        mkdsl.load(path, profile="mini")
    assert message in str(e.value)


@pytest.mark.parametrize("profile", [["--profile", "mini"], []])
def test_check_accepts_the_drafter(profile, capsys):
    """`check` runs every check `compile` runs: the context's projection by `fc` before the layer
    stack (the step's prologue streams it), the `context` state read as a value (`read_state`),
    `block_attention` and `markov_argmax`; at full size the shard rules of all of them hold."""
    from mkdsl.cli import main

    assert main(["check", DSPARK, *profile]) == 0, capsys.readouterr().err
    assert "ok: model kimi_k3_dspark" in capsys.readouterr().out


def test_a_state_read_as_a_value_is_one_read_state_node():
    """The elaborator reads `context` through one `read_state` (the kernel's copy into VMEM, the
    planner's charge for its bytes); `block_attention` and `rope` read their states themselves."""
    m = mkdsl.load(DSPARK, profile="mini").model
    reads = [n for n in m.step.nodes if n.op == "read_state"]
    assert [n.inputs[0].name for n in reads] == ["context"]
    fc = next(n for n in m.step.nodes if n.op == "linear")
    assert fc.inputs[0].name == reads[0].outputs[0].name
    assert not any(n.op == "read_state" for k in m.kinds for n in k.nodes)


def test_read_state_prefills_each_token_row_with_its_sequences_row():
    """Over a prompt's B*T rows, row b*T + t reads row b of the state; B*T rows pass through."""
    from mkdsl.ops import OPS
    from mkdsl.ops.prefill import Rows

    rows = Rows(2, 3, np.zeros(6, np.int32), np.ones(6, bool))
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    (got,) = OPS["read_state"].prefill(rows, x)
    np.testing.assert_array_equal(np.asarray(got), x[[0, 0, 0, 1, 1, 1]])
    (same,) = OPS["read_state"].prefill(rows, np.arange(12.0).reshape(6, 2))
    assert np.asarray(same).shape == (6, 2)


def _context(rng, n, layers, width):
    return rng.standard_normal((n, layers, width)).astype(np.float32)


def test_drafts_from_context_fed_in_steps():
    """A prompt longer than the block goes in several steps: the block's rows are causal and the
    Markov bias reads left to right, so a 4-row drafter's 3 drafts equal the first 3 of a 16-row
    drafter that takes the whole prompt in one step. Then accepted rows move the context on."""
    target = mkdsl.load("specs/kimi_k3.mk", profile="mini")
    spec = mkdsl.load(DSPARK, profile="mini")
    weights = random_drafter_weights(spec, seed=3)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 1000, 13)]
    ctx = _context(rng, 13, 5, 256)
    small, big = SpecDrafter(spec, weights, 4, target.model), SpecDrafter(spec, weights, 16, target.model)
    for d in (small, big):
        d.start(prompt, ctx)
    got = small.propose(7, 13)
    want = big.propose(7, 13)
    assert len(got) == 3 and len(want) == 15
    assert got == want[:3]
    assert all(0 <= t < 1024 for t in want)
    # the target kept 2 drafts: 3 rows of context (the anchor and the 2), the next anchor at 16
    more = _context(rng, 3, 5, 256)
    for d in (small, big):
        d.accept([got[0], got[1], 5], more)
    again = small.propose(5, 16)
    assert again == big.propose(5, 16)[:3]
    # the drafts read the context: another prompt context changes the slot caches and the logits
    other = SpecDrafter(spec, weights, 4, target.model)
    other.start(prompt, _context(rng, 13, 5, 256))
    other.propose(7, 13)
    assert not np.array_equal(np.asarray(other.state["k_cache"]), np.asarray(small.state["k_cache"]))


def test_make_drafter_checks_pairing_first():
    target = mkdsl.load("specs/qwen3_30b_a3b.mk", profile="mini")
    with pytest.raises(DraftSpecError, match="vocabulary|wide|layers"):
        make_drafter(DSPARK, target, rows=4, profile="mini")
    d = make_drafter(DSPARK, mkdsl.load("specs/kimi_k3.mk", profile="mini"), rows=4)
    assert (d.rows, d.context_layers) == (4, (2, 3, 5, 6, 7))


# ---------------------------------------------------------------- the spec against the facts


def _bf16(x) -> np.ndarray:
    """Nearest bf16 (ties to even) as float64: what `linear` feeds the MXU."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def _rms(x, g, n=1, eps=1e-5):
    x = x.reshape(x.shape[0], n, -1)
    return (x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * g).reshape(x.shape[0], -1)


def _lin(x, m):
    return _bf16(x) @ m


def _rope(x, pos, n, d, theta=10000.0):
    """Rotate-half: lane i pairs with i + d/2, angle position · theta^(-2i/d)."""
    x = x.reshape(x.shape[0], n, d).copy()
    ang = np.asarray(pos, np.float64)[:, None, None] * theta ** (-2.0 * np.arange(d // 2) / d)
    a, b = x[..., : d // 2].copy(), x[..., d // 2 :].copy()
    x[..., : d // 2], x[..., d // 2 :] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    return x.reshape(x.shape[0], -1)


def _attend(q, k, v, kc, vc, sp, anchor, heads, kvh, d, window):
    """Row r, head hq: softmax over the slots below the anchor within the window and the block's
    rows 0..r (KV head hq // (heads / kvh))."""
    y, g = np.zeros((q.shape[0], heads * d)), heads // kvh
    seen = [t for t in range(kc.shape[1]) if 0 <= sp[t] < anchor and sp[t] > anchor - window]
    for r in range(q.shape[0]):
        for hq in range(heads):
            hk = hq // g
            keys = [kc[hk, t] for t in seen] + [_bf16(k[j, hk * d : (hk + 1) * d]) for j in range(r + 1)]
            vals = [vc[hk, t] for t in seen] + [_bf16(v[j, hk * d : (hk + 1) * d]) for j in range(r + 1)]
            s = np.array([q[r, hq * d : (hq + 1) * d] @ kk for kk in keys]) * d**-0.5
            p = np.exp(s - s.max())
            y[r, hq * d : (hq + 1) * d] = p @ np.array(vals) / p.sum()
    return y


def _dspark_oracle(w, st, tokens, positions, heads, kvh, d, window):
    """The DSpark step from facts/kimi_k3.md in float64: fc + hidden_norm on the context; per layer
    pre-norm attention (per-head q/k RMSNorm, rotate-half RoPE, the context's keys and values
    written at slot position mod W, the block attending to slots below the anchor within the
    window and causally to itself), pre-norm SwiGLU, residual adds; final norm, output head."""

    def f(name, layer=None):
        a = np.asarray(w[name]).astype(np.float64)
        return a if layer is None else a[layer]

    ctx_pos = np.asarray(st["context_pos"])
    ctx = _rms(_lin(np.asarray(st["context"], np.float64), f("fc")), f("hidden_norm"))
    x = f("embed")[tokens]
    kc_all, vc_all = (np.asarray(st[n]).astype(np.float64) for n in ("k_cache", "v_cache"))
    sp_all = np.asarray(st["slot_pos"]).copy()
    for layer in range(kc_all.shape[0]):
        h = _rms(x, f("attn_norm", layer))
        q = _rope(_rms(_lin(h, f("wq", layer)), f("q_norm", layer), heads), positions, heads, d)
        k = _rope(_rms(_lin(h, f("wk", layer)), f("k_norm", layer), kvh), positions, kvh, d)
        ck = _rope(_rms(_lin(ctx, f("wk", layer)), f("k_norm", layer), kvh), ctx_pos, kvh, d)
        cv = _lin(ctx, f("wv", layer))
        kc, vc, sp = kc_all[layer], vc_all[layer], sp_all[layer]
        for i, p in enumerate(ctx_pos):  # in order: a later row wins a shared slot
            if p >= 0:
                kc[:, p % window], vc[:, p % window] = _bf16(ck[i].reshape(kvh, d)), _bf16(cv[i].reshape(kvh, d))
                sp[p % window] = p
        y = _attend(q, k, _lin(h, f("wv", layer)), kc, vc, sp, positions[0], heads, kvh, d, window)
        x = x + _lin(y, f("wo", layer))
        h = _rms(x, f("mlp_norm", layer))
        gate, up = _lin(h, f("w_gate", layer)), _lin(h, f("w_up", layer))
        x = x + _lin(gate / (1 + np.exp(-gate)) * up, f("w_down", layer))
    return _lin(_rms(x, f("final_norm")), f("lm_head")), sp_all


def test_mini_step_equals_the_published_equations():
    """The mini profile's reference step against a float64 oracle of the DSpark equations, with
    context rows to write (two at one position: the later wins), older slots to read and one
    outside the window. Tolerance: 3% of the largest logit. The oracle rounds `linear`'s inputs to
    bf16 as the numeric contract says; where float64 and f32 round an input differently it moves
    by one bf16 ulp (2^-8), and a logit is formed through ~8 such products in 2 layers: <= 8·2^-8
    = 3% of its magnitude. A wrong pairing, norm, mask or slot moves logits by O(their
    magnitude); observed 0.43% (0.14x the tolerance)."""
    spec = mkdsl.load(DSPARK, profile="mini")
    m = spec.model
    b, window = 8, m.const["W"]
    weights = random_drafter_weights(spec, seed=5)
    rng = np.random.default_rng(5)
    _, st = mkdsl.random_inputs(spec, batch=b, seq_len=1, seed=5)
    st = {k: np.asarray(v) for k, v in st.items()}
    anchor = 100
    st["slot_pos"][:] = -1
    older = np.array([20, 40, 70, 90, 95, 97])  # 20 is outside the 64-slot window of anchor 100
    st["slot_pos"][:, older % window] = older
    st["context"] = rng.standard_normal((b, m.tensor("context").type.shape[1])).astype(np.float32)
    st["context_pos"] = np.array([-1, -1, -1, 98, 98, 99, -1, -1], np.int32)
    tokens = np.array([17] + [m.const["MASK"]] * (b - 1), np.int32)
    positions = np.arange(anchor, anchor + b, dtype=np.int32)
    logits, drafts, new = mkdsl.reference_step(spec)(weights, st, tokens, positions)
    want, slot_pos = _dspark_oracle(
        weights, st, tokens, positions, m.const["NH"], m.const["NKVR"], m.const["D"], window
    )
    got = np.asarray(logits, np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=0, atol=0.03 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(new["slot_pos"]), slot_pos)
    assert np.asarray(drafts).shape == (b,)


def test_drafter_floor_counts_what_a_step_must_read():
    """Modeled HBM floor of the full-size drafter at 8 rows, per device: counted here from the
    facts' sizes and the spec's TP32 layout (bf16 everywhere; `wk`, `wv` and `k_norm` are read for
    the block and again for the context rows; one KV head per device; the slot caches read and
    written whole; the embedding and markov_w1 read one row per block row; the context state read)."""
    from mkdsl.run.spec_drafters import drafter_floor_us

    h, v, nh, d, f, w, mr, nc, tp, b, layers = 7168, 163840, 96, 64, 14336, 2048, 256, 5, 32, 8, 5
    kv = 32 // tp  # KV heads per device (16 stored twice)
    per_layer = 2 * (2 * h + h * nh * d // tp * 2 + 2 * 2 * h * kv * d + d + 2 * d + 3 * h * f // tp)
    per_layer += 2 * (kv * w * 2 * d * 2 + w * 4)  # slot caches and slot positions, read and written
    weights = 2 * (b * h + nc * h // tp * h + h + h + h * v // tp + v // tp * mr + b * mr)
    weights += b * nc * h // tp * 4  # the block's context rows (f32 state, read as a value)
    us, moved = drafter_floor_us(mkdsl.load(DSPARK).model, b)
    assert moved == weights + layers * per_layer
    assert us == pytest.approx(moved / 3.05e12 * 1e6)
