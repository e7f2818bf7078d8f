"""Prefill (mkdsl/run/prefill.py): a prompt at once equals decoding it token by token, through the
reference and through the kernel, caches and recurrent state included; for the Kimi K3 mini
sharded over 8 devices with the state placed as the kernel's STATE_SPLIT says.

Tolerances. Prefill computes every op per token as the decode step does, but over B*T rows at
once, so XLA may sum in another order: f32 noise (~2^-16 relative), which can flip the bf16
rounding of a matmul input, the mechanism mkdsl/verify/kernel.py bounds per layer (STATE_RTOL,
CARRY_RTOL, LOGIT_RTOL, derived there). Here nothing resets the difference between layers:
the state layer l writes is bounded by (l + 1) x STATE_RTOL of its vector's largest |ref| plus
one storage ulp (each layer before it adds at most one layer's bound), and the logits by
(L + 1) x LOGIT_RTOL of the row's largest |ref logit|. A wrong position, a token dropped or a
padding token written changes entries by O(1) of their scale, far above these bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mkdsl
from mkdsl.ops import OPS
from mkdsl.ops.prefill import Rows
from mkdsl.run.prefill import (
    PrefillError,
    build_prefill,
    check_prefill,
    reference_weights,
    run_prefill,
    run_prefill_layer,
)
from mkdsl.run.reference import build_layered_reference, run_layer
from mkdsl.verify.kernel import LOGIT_RTOL, STATE_RTOL, LayerChecker, state_ratio, storage_ulp


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _state_errors(model, want: dict, got: dict, upto: int | None = None) -> list[str]:
    """Entries of one row's state (`_row`) outside the per-layer bound (the module docstring);
    `upto`: only the state of layers before it."""
    bad = []
    for t in model.states:
        for slot in range(t.stack if t.stacked else 1):
            layers = [li for li, s in enumerate(t.slots) if s == slot] if t.stacked else [len(model.schedule)]
            if upto is not None and min(layers) >= upto:
                continue
            w = _f32(want[t.name][slot] if t.stacked else want[t.name])
            g = _f32(got[t.name][slot] if t.stacked else got[t.name])
            scale = np.abs(w).max(axis=-1, keepdims=True)
            bound = storage_ulp(w, np.asarray(want[t.name]).dtype) + (max(layers) + 1) * STATE_RTOL * scale
            ratio = float((np.abs(g - w) / bound).max())
            if not ratio <= 1:
                bad.append(f"{t.name}[{slot}] off by {ratio:.2f}x the bound")
    return bad


def _row(model, state: dict, b: int) -> dict:
    """Row b of every state: stacked [slot, batch, ...] -> [slot, ...], unstacked [batch, ...] -> [...]."""
    return {
        t.name: np.asarray(state[t.name])[:, b] if t.stacked else np.asarray(state[t.name])[b] for t in model.states
    }


def _logit_ok(model, want, got) -> bool:
    scale = np.abs(_f32(want)).max(axis=-1, keepdims=True)
    return bool((np.abs(_f32(got) - _f32(want)) <= (len(model.schedule) + 1) * LOGIT_RTOL * scale).all())


def _decode(step, weights, state, tokens, start, lengths):
    """Decode the prompt token by token; per row, (logits, state) after its last token."""
    batch, steps = tokens.shape
    out = {}
    for t in range(steps):
        logits, _, state = step(weights, state, jnp.asarray(tokens[:, t]), jnp.asarray(start + t, jnp.int32))
        for b in np.flatnonzero(lengths == t + 1):
            out[int(b)] = (np.asarray(logits[b]), {k: np.asarray(v) for k, v in state.items()})
    return out


SPECS = [("specs/tiny.mk", None), ("specs/llama3_8b.mk", "mini")]


@pytest.mark.parametrize("path,profile", SPECS, ids=["tiny", "llama3_mini"])
def test_prefill_equals_decoding_the_prompt_token_by_token(path, profile):
    spec = mkdsl.load(path, profile)
    weights, state = mkdsl.random_inputs(spec, batch=3, seq_len=256, seed=1)  # random caches: earlier tokens
    tokens = np.random.default_rng(2).integers(0, 256, (3, 5)).astype(np.int32)
    start, lengths = np.array([0, 7, 40], np.int32), np.array([5, 2, 4], np.int32)
    decoded = _decode(mkdsl.reference_step(spec), weights, dict(state), tokens, start, lengths)
    logits, next_tokens, new = mkdsl.prefill_step(spec, donate=False)(weights, state, tokens, lengths, start)
    for b, (want_logits, want_state) in decoded.items():
        assert _logit_ok(spec.model, want_logits, logits[b]), f"row {b}: logits"
        assert _state_errors(spec.model, _row(spec.model, want_state, b), _row(spec.model, new, b)) == [], f"row {b}"
    assert (np.asarray(next_tokens) == np.asarray(jnp.argmax(logits, axis=-1))).all()


def test_prefill_in_two_chunks_equals_one_prefill():
    spec = mkdsl.load("specs/tiny.mk")
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=256, seed=3)
    tokens = np.random.default_rng(4).integers(0, 256, (2, 6)).astype(np.int32)
    prefill = mkdsl.prefill_step(spec, donate=False)
    whole_logits, _, whole = prefill(weights, state, tokens)
    _, _, first = prefill(weights, state, tokens[:, :4])
    logits, _, second = prefill(weights, first, tokens[:, 4:], start=np.array([4, 4], np.int32))
    assert _logit_ok(spec.model, whole_logits, logits)
    for b in range(2):
        assert _state_errors(spec.model, _row(spec.model, whole, b), _row(spec.model, second, b)) == []


def test_an_op_that_updates_state_needs_a_prefill_rule(monkeypatch):
    import dataclasses

    spec = mkdsl.load("specs/tiny.mk")
    check_prefill(spec.model)
    monkeypatch.setitem(OPS, "attention", dataclasses.replace(OPS["attention"], prefill=None))
    with pytest.raises(PrefillError, match="no prefill rule for attention"):
        build_prefill(spec.model)


@pytest.mark.parametrize("name", ["kimi_k3", "deepseek_v3"])  # MXFP4 experts; fp8 with block scales
def test_prefill_takes_the_kernels_weight_layout_too(name):
    """A quantised weight given as the kernel's `w_codes`, `w_scales` is the reference's QTensor,
    with its format and group (a block-scaled fp8's `fp8_e4m3:block` and block size)."""
    spec = mkdsl.load(f"specs/{name}.mk", "mini")
    weights, _ = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=5)
    back = reference_weights(spec.model, mkdsl.kernel_weights(weights))
    assert set(back) == set(weights)
    for name, w in weights.items():
        assert jax.tree_util.tree_structure(back[name]) == jax.tree_util.tree_structure(w), name
        for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(back[name]), strict=True):
            assert (np.asarray(a) == np.asarray(b)).all(), name
        assert type(back[name]) is type(w)


SAMPLING = mkdsl.Sampling(temperature=0.8, top_k=50, top_p=0.95)


@pytest.fixture(scope="module")
def tiny_kernel():
    """tiny's kernel step (interpret mode) at batch 2, sampling, and its module."""
    spec = mkdsl.load("specs/tiny.mk")
    module = mkdsl.load_kernel(spec)
    return spec, module, mkdsl.build_step(spec, 2, 256, sampling=SAMPLING, module=module)


def _fresh(state: dict) -> dict:
    return {k: jnp.array(v) for k, v in state.items()}  # the kernel donates its state


def test_prefill_then_kernel_decode_equals_kernel_decoding_the_prompt(tiny_kernel):
    """tiny: the kernel decoding the prompt token by token, and after a prefill, one more step."""
    spec, _, step = tiny_kernel
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=256, seed=6)
    tokens = np.random.default_rng(7).integers(0, 256, (2, 4)).astype(np.int32)
    kw = mkdsl.kernel_weights(weights)
    decoded = _decode(step, kw, _fresh(state), tokens, np.zeros(2, np.int32), np.full(2, 4))
    _, _, prefilled = mkdsl.prefill_step(spec)(weights, _fresh(state), tokens[:, :3])
    logits, _, after = step(kw, prefilled, jnp.asarray(tokens[:, 3]), jnp.full((2,), 3, jnp.int32))
    for b, (want_logits, want_state) in decoded.items():
        assert _logit_ok(spec.model, want_logits, logits[b]), f"row {b}: logits"
        assert _state_errors(spec.model, _row(spec.model, want_state, b), _row(spec.model, after, b)) == []


def test_kernel_samples_as_the_reference_and_n_steps_per_call_equal_n_calls(tiny_kernel):
    spec, module, step = tiny_kernel
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=256, seed=9)
    kw = mkdsl.kernel_weights(weights)
    tokens, positions, seed = jnp.array([3, 9], jnp.int32), jnp.array([0, 17], jnp.int32), 1234
    ref_logits, _, _ = mkdsl.reference_step(spec)(weights, state, tokens, positions)
    logits, chosen, _ = step(kw, _fresh(state), tokens, positions, seed)
    # the same code on the same logits: exactly the kernel's token
    assert (np.asarray(chosen) == np.asarray(mkdsl.sample_tokens(logits, positions, np.uint32(seed), SAMPLING))).all()
    # from the reference's logits: the same token unless the perturbed scores are a near tie
    ref_chosen = np.asarray(mkdsl.sample_tokens(ref_logits, positions, np.uint32(seed), SAMPLING))
    assert (np.asarray(chosen) == ref_chosen).all()
    # three steps in one call (each token fed to the next on the device) = three calls
    steps = mkdsl.build_step(spec, 2, 256, sampling=SAMPLING, steps_per_call=3, module=module)
    many_logits, many, many_state = steps(kw, _fresh(state), tokens, positions, seed)
    single, s = [], _fresh(state)
    for i in range(3):
        logits, tokens_i, s = step(kw, s, tokens if i == 0 else single[-1], positions + i, seed)
        single.append(tokens_i)
    assert np.asarray(many).shape == (2, 3)
    assert (np.asarray(many) == np.stack([np.asarray(t) for t in single], axis=1)).all()
    # the same kernel arithmetic, in a loop or not: f32 noise at most (2^-16 of the row's scale),
    # which may move a bf16 cache entry by its storage ulp
    scale = np.abs(np.asarray(logits)).max(axis=-1, keepdims=True)
    assert (np.abs(np.asarray(many_logits) - np.asarray(logits)) <= 2.0**-16 * scale).all()
    for name in s:
        want = _f32(s[name])
        assert (np.abs(_f32(many_state[name]) - want) <= storage_ulp(want, s[name].dtype)).all(), name


def _decode_layers(ref, weights, state, tokens):
    """Decode the prompt token by token through the layered reference: per layer l (and l = L,
    the epilogue) the carries entering it at every token, as prefill rows [B*T, -1]; the state after
    the last token; the last token's logits and greedy tokens."""
    batch, steps = tokens.shape
    seen = [[] for _ in range(len(ref.model.schedule) + 1)]
    for t in range(steps):
        args = (weights, state, jnp.asarray(tokens[:, t]), jnp.full((batch,), t, jnp.int32))
        carries = ref.prologue(*args)
        for index in range(len(ref.model.schedule)):
            seen[index].append(carries)
            carries, state = run_layer(
                ref.model, index, weights, state, *args[2:], carries
            )  # eager: no compile per layer
        seen[-1].append(carries)
        logits, greedy = ref.epilogue(*args, carries)
    rows = [[np.stack([_f32(c[i]) for c in per_t], axis=1) for i in range(len(per_t[0]))] for per_t in seen]
    return [[r.reshape(batch * steps, *r.shape[2:]) for r in carries] for carries in rows], state, logits, greedy


def _carry_ratio(want, got, carries_in) -> float:
    """mkdsl/verify/kernel.py's one-layer carry bound, per prompt token; its worst ratio."""
    flat = lambda cs: [_f32(c).reshape(c.shape[0], -1) for c in cs]  # noqa: E731
    return float(LayerChecker._carry_ratio(flat(want), flat(got), flat(carries_in)).max())


def test_kimi_mini_sharded_prefill_matches_decode_layer_by_layer():
    """Kimi K3 mini over 8 devices: every layer's prefill (KDA recurrences, short convs, MLA's
    latent cache, MoE routing, attention residuals) fed the carries token-by-token decoding
    enters it with gives decoding's carries at every prompt token and its caches and recurrent
    states, within mkdsl/verify/kernel.py's one-layer bounds; the epilogue so fed gives its logits and
    tokens. Layer by layer because this random-weight stack amplifies f32 noise: an f32 difference
    flips a bf16 rounding (~2^-8 / sqrt(fan_in) of a matmul's output, 1e-4 of the carries by layer
    1), and decoding whose layer-0 output is perturbed by 1e-3 differs by 2e-2 at layer 7 (x25 in 7
    layers; prefill against decoding over the whole stack: 4e-2, each layer adding its flips): no
    bound linear in the depth holds. The prefill's state is placed as the kernel's
    STATE_SPLIT says and passes the kernel step's own input check."""
    spec = mkdsl.load("specs/kimi_k3.mk", "mini")
    model, module = spec.model, mkdsl.load_kernel(spec)
    mesh = module.make_mesh(jax.devices()[:8])
    batch, seq_len, prompt = 1, 256, 3
    weights, state = mkdsl.random_inputs(spec, batch=batch, seq_len=seq_len, seed=8)
    state = {k: jnp.asarray(v) for k, v in state.items()}
    tokens = np.array([[11, 700, 42, 5]], np.int32)
    seen, want_state, want_logits, want_greedy = _decode_layers(
        build_layered_reference(model), weights, state, tokens[:, :prompt]
    )
    worst = {}
    for index in range(len(model.schedule)):
        carries, got = run_prefill_layer(model, index, weights, state, tokens[:, :prompt], seen[index])
        worst[f"layer {index} carries"] = _carry_ratio(seen[index + 1], carries, seen[index])
        for t in (t for t in model.states if t.stacked and t.slots[index] >= 0):
            slot = t.slots[index]
            ratio = state_ratio(_f32(want_state[t.name][slot]), _f32(got[t.name][slot]), got[t.name].dtype)
            worst[f"layer {index} {t.name}"] = float(ratio.max())
    fed = lambda index, carries: [jnp.asarray(c) for c in seen[index]] if index == len(model.schedule) else carries  # noqa: E731
    logits, greedy, _ = run_prefill(model, mkdsl.Sampling(), weights, state, tokens[:, :prompt], feed=fed)
    scale = np.abs(_f32(want_logits)).max(axis=-1)
    worst["logits"] = float((np.abs(_f32(logits) - _f32(want_logits)).max(axis=-1) / (LOGIT_RTOL * scale)).max())
    assert {k: round(v, 3) for k, v in worst.items() if not v <= 1} == {}, worst
    assert (np.asarray(greedy) == np.asarray(want_greedy)).all()
    # the whole prefill, its state placed for the kernel: the kernel step's own input check
    _, _, placed = mkdsl.prefill_step(spec, mesh=mesh, donate=False)(weights, state, tokens[:, :prompt])
    assert {k: v.sharding for k, v in placed.items()} == module.state_shardings(mesh)
    kw = mkdsl.kernel_weights(weights)
    module.check_inputs(kw, placed, jnp.asarray(tokens[:, prompt]), jnp.full((batch,), prompt), batch, seq_len)


def _rand(rng, *shape, scale=1.0, dtype=np.float32):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _op_case(name: str, rng, n: int, batch: int, size: int):
    """(operands, attrs, per-token operand indices, state operand indices) of a small instance."""
    bf16 = jnp.bfloat16
    if name == "attention":
        ops = [_rand(rng, n, 64), _rand(rng, n, 32), _rand(rng, n, 32)]
        ops += [jnp.asarray(_rand(rng, batch, 2, size, 16), bf16), jnp.asarray(_rand(rng, batch, 2, size, 16), bf16)]
        return ops, {"heads": 4, "kv_heads": 2}, (0, 1, 2), (3, 4)
    if name == "mla_attention":
        ops = [
            _rand(rng, n, 24),
            _rand(rng, n, 16),
            _rand(rng, n, 4),
            jnp.asarray(_rand(rng, 16, 32, scale=0.25), bf16),
        ]
        ops += [jnp.asarray(_rand(rng, batch, size, 20), bf16)]
        return ops, {"heads": 2, "nope": 8, "extra": 4, "vdim": 8}, (0, 1, 2), (4,)
    if name == "short_conv":
        return [_rand(rng, n, 8), _rand(rng, 4, 8), _rand(rng, batch, 3, 8)], {}, (0,), (2,)
    assert name == "recurrent"
    q, k = (np.asarray(jnp.asarray(_rand(rng, n, 8)).reshape(n, 2, 4) / 2).reshape(n, 8) for _ in range(2))
    g = -np.abs(_rand(rng, n, 8))
    beta = 1 / (1 + np.exp(-_rand(rng, n, 2)))
    return [q, k, _rand(rng, n, 8), _rand(rng, batch, 2, 4, 4), g, beta], {"heads": 2}, (0, 1, 2, 4, 5), (3,)


@pytest.mark.parametrize("name", ["attention", "mla_attention", "short_conv", "recurrent"])
def test_prefill_rules_equal_their_op_token_by_token(name):
    """Each op's prefill rule over a ragged prompt equals its decode reference token by token
    (state kept past a row's length). One op, the same arithmetic per token in another order:
    f32 noise, bounded by 2^-16 of the scale (plus a storage ulp of a bf16 cache entry)."""
    op, rng = OPS[name], np.random.default_rng(10)
    batch, length, size = 2, 4, 16
    start, lengths = np.array([0, 5], np.int32), np.array([4, 2], np.int32)
    operands, attrs, per_token, states = _op_case(name, rng, batch * length, batch, size)
    positions = (start[:, None] + np.arange(length)[None, :]).reshape(-1).astype(np.int32)
    valid = (np.arange(length)[None, :] < lengths[:, None]).reshape(-1)
    takes_positions = "positions" in op.operands
    args = (
        [*operands[: op.operands.index("positions")], positions, *operands[op.operands.index("positions") :]]
        if takes_positions
        else operands
    )
    shift = lambda i: i + 1 if takes_positions and i >= op.operands.index("positions") else i  # noqa: E731
    states = tuple(shift(i) for i in states)
    got = op.prefill(Rows(batch, length, jnp.asarray(positions), jnp.asarray(valid)), *map(jnp.asarray, args), **attrs)
    carried = [jnp.asarray(args[i]) for i in states]
    outs = np.zeros_like(np.asarray(got[0]))
    for t in range(length):
        now = list(args)
        for i in [*per_token, *((op.operands.index("positions"),) if takes_positions else ())]:
            now[i] = np.asarray(args[i]).reshape(batch, length, *np.shape(args[i])[1:])[:, t]
        for i, c in zip(states, carried):
            now[i] = c
        res = op.reference(*map(jnp.asarray, now), **attrs)
        ok = t < lengths
        for j in range(len(states)):
            new = res[op.outputs + j]
            carried[j] = jnp.where(ok.reshape(-1, *[1] * (new.ndim - 1)), new, carried[j])
        outs.reshape(batch, length, -1)[:, t] = np.asarray(res[0])
    want = outs[valid]
    scale = np.abs(want).max(axis=-1, keepdims=True)
    assert (np.abs(np.asarray(got[0])[valid] - want) <= 2.0**-16 * scale).all()
    for new, ref in zip(got[op.outputs :], carried, strict=True):
        w = _f32(ref)
        bound = storage_ulp(w, ref.dtype) + 2.0**-16 * np.abs(w).max(axis=-1, keepdims=True)
        assert (np.abs(_f32(new) - w) <= bound).all()
