"""`block_attention` in the kernel (mkdsl/backends/tpu/lowerings/draft.py), TPU interpret mode with
the race detector on, checked layer by layer against the reference (mkdsl/verify/kernel.py: its
derived bounds, carries 2^-6 of the layer's update, logits 2^-7 of the row's largest entry), and
the slot caches and slot positions it writes (bf16 caches: within one storage ulp; positions:
exact).

The step's rows are a block at consecutive positions from an anchor; the context rows are the
block's own keys and values, the keys rotated at the positions of a state `cpos` the test sets
(`rope` at a state's positions, mkdsl/backends/tpu/lowerings/rope.py): some rows absent
(-1), some below the anchor (written, then seen by this very step), some at or past it (written,
unseen), two sharing a slot (the later wins). The caches start with random entries and slot
positions below, at and above the anchor, inside and outside the window, and empty, so every
mask of the op is taken. A kernel attending to every slot fails the check (the mutation test)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mkdsl.compiler import compile_source
from mkdsl.run.random_params import random_params
from mkdsl.verify import kernel as verify

SPEC = """\
model block_kernel

const L = 2
const H = 128
const NH = 4
const NKV = 2
const D = 64
const W = 32
const V = 256

dim B in 1 .. 8

weight embed:     bf16[V, H]
weight norm1:     bf16[H]         per layer
weight wq:        bf16[H, NH*D]   per layer
weight wk:        bf16[H, NKV*D]  per layer
weight wv:        bf16[H, NKV*D]  per layer
weight wo:        bf16[NH*D, H]   per layer
weight out_norm:  bf16[H]
weight lm_head:   bf16[H, V]

state cpos:       i32[B]
state k_cache:    bf16[NKV, W, D] per layer
state v_cache:    bf16[NKV, W, D] per layer
state slot_pos:   i32[W]          per layer

layer dec(x) {
  h = rmsnorm(x, norm1)
  q = rope(linear(h, wq), positions, heads=NH)
  kr = linear(h, wk)
  k = rope(kr, positions, heads=NKV)
  ck = rope(kr, cpos, heads=NKV)
  v = linear(h, wv)
  a = block_attention(q, k, v, ck, v, k_cache, v_cache, slot_pos, cpos, positions, heads=NH, kv_heads=NKV, window=W)
  return x + linear(a, wo)
}

layers L { dec: otherwise }

step(tokens, positions) {
  x = layers(embedding(tokens, embed))
  logits = linear(rmsnorm(x, out_norm), lm_head)
  return logits, argmax(logits)
}
"""
BATCH, ANCHOR, W = 6, 40, 32


def build(tmp_path, mutate=None):
    out, _ = compile_source(SPEC, "block_kernel.mk", None)
    source = out.files["kernel.py"]
    if mutate is not None:
        assert mutate[0] in source, f"the mutation's target `{mutate[0]}` is not in the kernel"
        source = source.replace(*mutate)
    return out.model, verify.import_generated(source, tmp_path, "block_kernel")


def inputs(model):
    weights, state = random_params(model, {"B": BATCH}, seed=5)
    rng = np.random.default_rng(5)
    state["cpos"] = np.array([-1, ANCHOR - 3, ANCHOR + 1, ANCHOR - 20, ANCHOR - 3 + W, ANCHOR - 1], np.int32)
    layers = state["slot_pos"].shape[0]
    state["slot_pos"] = rng.integers(ANCHOR - 2 * W, ANCHOR + 4, (layers, W)).astype(np.int32)
    state["slot_pos"][:, ::5] = -1
    tokens = rng.integers(0, 256, BATCH).astype(np.int32)
    return weights, state, tokens, (ANCHOR + np.arange(BATCH)).astype(np.int32)


class CarryChecker(verify.LayerChecker):
    """The layer checker's carries and logits; its state check reads states batch-first, so the
    slot caches (no batch axis) are compared by `cache_failures`."""

    def _states_of(self, index: int) -> list[str]:
        return []


def cache_failures(model, checker, weights, state, tokens, positions, got) -> list[str]:
    """Each layer's slot caches against the reference's layer fed the kernel's carries: within the
    state bound (one bf16 ulp + 2^-6 of the head's largest entry, `verify.state_ratio`); the slot
    positions exactly."""
    args = ({k: jnp.asarray(v) for k, v in weights.items()}, {k: jnp.asarray(v) for k, v in state.items()})
    args += (jnp.asarray(tokens), jnp.asarray(positions))
    out = []
    for index in range(len(model.schedule)):
        carries = [jnp.asarray(got.trace[name][index]) for name in checker.carry_names]
        _, ref = checker.ref.layer(index, *args, carries)
        for name in ("k_cache", "v_cache", "slot_pos"):
            slot = model.tensor(name).slots[index]
            want, have = np.asarray(ref[name][slot]), got.state[name][slot]
            if name == "slot_pos":
                ok = np.array_equal(want, have)
            else:
                ok = (verify.state_ratio(want.astype(np.float32), have.astype(np.float32), have.dtype) <= 1).all()
            if not ok:
                out.append(f"layer {index}: {name}")
    return out


def run(model, module):
    from jax.experimental.pallas import tpu as pltpu

    weights, state, tokens, positions = inputs(model)
    step = module.build_decode_step(
        BATCH, verify.check_seq_len(module), interpret=verify.interpret_params(), layer_trace=True
    )
    pltpu.reset_tpu_interpret_mode_state()
    got = verify.run_kernel(step, weights, state, tokens, positions, sharded=False)
    races = verify.races_found()
    checker = CarryChecker(model)
    check = checker.check(weights, state, tokens, positions, got)
    return check.failures + cache_failures(model, checker, weights, state, tokens, positions, got), check, races


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_block_attention_kernel_matches_the_reference(tmp_path):
    model, module = build(tmp_path)
    failures, check, races = run(model, module)
    assert not races, "the interpreter's race detector reported a race"
    assert not failures, failures
    assert {"carries", "logits"} <= set(check.worst), check.worst
    print(f"\nworst error / bound: {check.worst}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kernel_seeing_every_slot_fails(tmp_path):
    model, module = build(tmp_path, mutate=("seen = (spv >= 0) & (spv < anchor)", "seen = spv > -(2**30)"))
    failures, _, _ = run(model, module)
    assert failures
