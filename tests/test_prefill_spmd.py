"""Prefill per device under shard_map (mkdsl/run/prefill_spmd.py) equals the whole model's prefill
on one device (mkdsl/run/prefill.py, itself checked against decoding in tests/test_prefill.py).

Tolerances. Both compute the same ops on the same values; the per-device model only splits
matmuls over heads, columns or experts and sums row-parallel partials by psum, so XLA may sum in
another order: f32 noise (~2^-16 relative) that can flip the bf16 rounding of a matmul input,
the mechanism mkdsl/verify/kernel.py bounds per layer (STATE_RTOL, CARRY_RTOL, LOGIT_RTOL, derived
there). Over the whole stack nothing resets the difference between layers, so the state layer l
writes is bounded by (l + 1) x STATE_RTOL of its vector's largest |whole| plus one storage ulp and
the logits by (L + 1) x LOGIT_RTOL of the row's largest |whole logit| (tests/test_prefill.py's
bound). A device writing another's block, a wrong psum or gather order, or an expert taken
from the wrong device changes entries by O(1) of their scale, far above these bounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mkdsl
from mkdsl.run.prefill import build_prefill, reference_weights, run_prefill_layer
from mkdsl.run.prefill_spmd import build_sharded_prefill, tensor_spec
from mkdsl.run.reference import build_layered_reference
from mkdsl.spmd.shard import shard
from mkdsl.verify.kernel import LOGIT_RTOL, STATE_RTOL, LayerChecker, state_ratio, storage_ulp


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _state_ratio(model, t, want, got) -> float:
    """The worst error / the (l + 1)-layer bound over the state tensor `t` (module docstring)."""
    worst = 0.0
    for slot in range(t.stack if t.stacked else 1):
        layers = [li for li, s in enumerate(t.slots) if s == slot] if t.stacked else [len(model.schedule)]
        w = _f32(want[slot] if t.stacked else want)
        g = _f32(got[slot] if t.stacked else got)
        bound = storage_ulp(w, np.asarray(want).dtype) + (max(layers) + 1) * STATE_RTOL * np.abs(w).max(
            -1, keepdims=True
        )
        worst = max(worst, float((np.abs(g - w) / (bound + np.finfo(np.float32).tiny)).max()))
    return worst


def _mesh(model):
    sizes = dict(model.mesh)
    devices = np.array(jax.devices()[: int(np.prod(list(sizes.values())))]).reshape(tuple(sizes.values()))
    return jax.sharding.Mesh(devices, tuple(sizes))


def test_qwen3_mini_prefill_per_device_equals_the_whole_prefill():
    """Qwen3-30B-A3B mini over ep 2 x tp 2: attention heads and the KV cache split over tp,
    experts over ep, the vocabulary over both; two prompt rows, one shorter (its padding writes
    nothing on any device). The state comes back split as the kernel's STATE_SPLIT says."""
    spec = mkdsl.load("specs/qwen3_30b_a3b.mk", "mini")
    model = spec.model
    mesh = _mesh(model)
    weights, state = mkdsl.random_inputs(spec, batch=2, seq_len=64, seed=3)
    state = {k: jnp.asarray(v) for k, v in state.items()}
    tokens, lengths = np.array([[11, 70, 42, 5, 9], [3, 4, 5, 6, 7]], np.int32), np.array([5, 3], np.int32)
    want_logits, want_tokens, want = build_prefill(model, donate=False)(weights, state, tokens, lengths)
    logits, next_tokens, got = build_sharded_prefill(model, mesh)(weights, state, tokens, lengths)
    worst = {t.name: _state_ratio(model, t, want[t.name], got[t.name]) for t in model.states}
    scale = np.abs(_f32(want_logits)).max(axis=-1)
    err = np.abs(_f32(logits) - _f32(want_logits)).max(axis=-1)
    worst["logits"] = float((err / ((len(model.schedule) + 1) * LOGIT_RTOL * scale)).max())
    assert {k: round(v, 3) for k, v in worst.items() if not v <= 1} == {}, worst
    assert (np.asarray(next_tokens) == np.asarray(want_tokens)).all()
    for name, sharding in mkdsl.state_shardings(spec, mesh).items():
        assert got[name].sharding.is_equivalent_to(sharding, got[name].ndim), name
    assert any(not s.is_fully_replicated for s in (got[n].sharding for n in got)), "some state is split"
    # sampled (temperature, top-k) from the gathered logits, through mkdsl.prefill_step's default
    # for a sharded spec with a mesh; the logits agree within the bound above, far from the
    # Gumbel-max draw's ties for this seed, so the tokens are equal
    sampling = mkdsl.Sampling(temperature=0.8, top_k=8)
    want_drawn = build_prefill(model, sampling=sampling, donate=False)(weights, state, tokens, lengths, seed=5)[1]
    _, drawn, placed = mkdsl.prefill_step(spec, sampling=sampling, mesh=mesh, donate=False)(
        weights, state, tokens, lengths, seed=5
    )
    assert (np.asarray(drawn) == np.asarray(want_drawn)).all() and not (
        np.asarray(drawn) == np.asarray(want_tokens)
    ).all()
    assert {k: v.sharding for k, v in placed.items()} == mkdsl.state_shardings(spec, mesh)


def test_kimi_mini_layers_per_device_equal_the_whole_layers():
    """Kimi K3 mini over ep 4 x tp 2, one layer of each kind (KDA + dense MLP, KDA + MoE, MLA +
    MoE): the layer's prefill per device under shard_map, fed the carries the whole prefill enters
    it with, gives the whole layer's carries and state within mkdsl/verify/kernel.py's one-layer bounds
    (CARRY_RTOL, STATE_RTOL). Layer by layer because this random-weight stack amplifies f32 noise
    through its layers (tests/test_prefill.py's Kimi test says why): over all 8 layers the two
    prefills' greedy tokens agree but their MLA caches differ by up to ~1/4 of their scale."""
    spec = mkdsl.load("specs/kimi_k3.mk", "mini")
    model, mesh = spec.model, _mesh(spec.model)
    local, P = shard(model), jax.sharding.PartitionSpec  # noqa: N806
    weights, state = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=8)
    weights, state = reference_weights(model, weights), {k: jnp.asarray(v) for k, v in state.items()}
    tokens = np.array([[11, 700, 42]], np.int32)
    carries = build_layered_reference(model).prologue(weights, state, jnp.asarray(tokens[0]), jnp.arange(3))
    w_specs, s_specs = ({t.name: tensor_spec(t) for t in ts} for ts in (local.weights, local.states))
    flat = lambda cs: [_f32(c).reshape(c.shape[0], -1) for c in cs]  # noqa: E731
    worst, kinds = {}, set()
    for index, kind in enumerate(model.schedule):
        want_carries, want = run_prefill_layer(model, index, weights, state, tokens, carries)
        if kind not in kinds:
            kinds.add(kind)
            body = lambda w, s, c, i=index: run_prefill_layer(local, i, w, s, tokens, c, spmd=True)  # noqa: E731
            specs = {"in_specs": (w_specs, s_specs, P()), "out_specs": (P(), s_specs), "check_vma": False}
            got_carries, got = jax.jit(jax.shard_map(body, mesh=mesh, **specs))(weights, state, list(carries))
            ratio = LayerChecker._carry_ratio(flat(want_carries), flat(got_carries), flat(carries))
            worst[f"layer {index} carries"] = float(ratio.max())
            for t in (t for t in model.states if t.stacked and t.slots[index] >= 0):
                w, g = _f32(want[t.name][t.slots[index]]), _f32(got[t.name][t.slots[index]])
                worst[f"layer {index} {t.name}"] = float(state_ratio(w, g, got[t.name].dtype).max())
        carries = want_carries
        if kinds == set(model.schedule):
            break  # every kind checked (by layer 3)
    assert kinds == set(model.schedule) and len(worst) >= 3 * len(kinds), worst
    assert {k: round(v, 3) for k, v in worst.items() if not v <= 1} == {}, worst
