"""The generated Kimi K3 megakernel (profile `mini`: 8 layers with the dense KDA layer 0, KDA + MoE
layers, MLA + MoE at layers 3 and 7 and a residual-block boundary at layer 4) against the unfused
single-device reference, in TPU interpret mode on the CPU, at batch 1 and 4, three decode steps each.

The mini profile is sharded like the full model, over 8 devices (ep 4 x tp 2: 1 head per device,
4 local experts of 16 with half their columns, vocabulary 128 per device): the kernel runs once per
virtual CPU device (tests/conftest.py asks XLA for 8) inside shard_map, exchanging values with its
peers by remote DMAs in the interpreter. Values the design keeps whole on every device (the greedy
tokens, the MLA latent cache) must be bit-identical on all 8 devices. A deadlock fails the test by
its timeout instead of hanging CI.

The spec is compiled once, with `hints { kv_tile = 16 }` added so that three steps cross latent-cache
tile boundaries cheaply (the cache holds SEQ_LEN = 4 tiles); `build_decode_step` is called per batch
on that one module. Interpret mode runs with the race detector on, uninitialised memory filled with
NaN and out-of-bounds reads raising. Rows start at different positions (STARTS): 0, the last three
positions of the cache, and rows whose steps cross a 16-token tile boundary (14 -> 16, 15 -> 17,
31 -> 33, 47 -> 49); the first row crosses one, so batch 1 does too.

Each step, kernel and reference start from the *same* state: the kernel's state after the previous
step (checked then), so every check compares one decode step and differences do not pile up across
steps. Both get the reference's previous greedy tokens. One reference, jitted at batch 8, serves
every batch (smaller batches are padded with zero rows; rows are independent).

Test weights: random_params, except the attention-residual queries (the weights res_mix reads as
its query: attn_res, mlp_res, out_res), drawn like projections ~ N(0, 1/H) instead of near one
(random_params' rule for 1-D weights, meant for norm gains). With near-one queries every mixing
logit is ~ sum(v) / rms(v) ~ +-sqrt(H) = +-16: the softmax over blocks is nearly one-hot, and where
two entries happen to score alike it turns an f32 rounding difference upstream into an O(0.1)
change of the layer's input. Measured with the reference alone (batch 1 against batch 8, which
differ only in XLA's accumulation order): up to 11x the logit tolerance below with near-one queries,
0.66x with N(0, 1/H) queries.

Routing near-ties. A MoE layer takes each row's top TOPK experts by sigmoid score + bias. Where the
TOPK-th expert and the best one not taken (the runner-up) score within ROUTE_TIE = 2^-5 of each
other, a rounding difference upstream may take the runner-up, which changes the layer's output by
O(0.1) and everything after it: not a kernel error. The reference reports every row's margin in
every MoE layer and, on request, takes the runner-up instead (recorded/forced by wrapping the
`route` op while the reference traces). Each row is compared with the reference as routed and, if
it has near ties, with the reference taking the runner-up at one of them; the closest one must pass
every check. (Where rounding differences have compounded into the late layers, router scores move
by up to ~1.7e-2 while the logits still agree: measured as margin changes between the batch-1 and
batch-8 references over 288 row-steps. 2^-5 leaves 2x.)

Tolerances. Kernel and reference round every matmul input to bf16 and accumulate in f32, so they
agree to f32 rounding (~1e-6) until an f32 difference (accumulation order; rmsnorm, l2norm, softmax
and delta-rule reductions) flips the bf16 rounding of one matmul input: that input moves by one bf16
ulp (2^-8 relative) and every output of the matmul by ~2^-8 * |x_i| * |w|. In most rows no rounding
flips (exact to ~1e-6); in the others the flips compound over the layers, each layer rounding the
perturbed values again: a 1e-4 relative perturbation of layer 0's state grows to ~1e-2 by layer 6
(measured in the reference). A Kimi layer has up to 17 bf16-input matmuls (Llama 7), and the KDA
recurrent state's error is ~2x that of the layer's input (the decay gate exp(-5 sigmoid(...))). The tolerances are
twice those of the Llama test (tests/test_kernel_interpret.py); observed worst over all batches:
at most 1/2 of each (printed per batch with -s, recorded as test properties).

* logits: |kernel - ref| <= LOGIT_ATOL + LOGIT_RTOL * |ref| = 2^-4 + 2^-5 |ref| (16 bf16 ulps at
  logit magnitude 1). A wrong head mapping, mask, decay, expert or stale tile moves logits by 0.1-1.
* greedy tokens: the kernel's token is the first argmax of its own logits (exact) and equals the
  reference's unless that is a near tie (the kernel's token then scores within 2 * tolerance of the
  reference's maximum).
* KDA recurrent state (f32 [B, NH, D, D], every entry written each step): within RECURRENT_RTOL =
  2^-4 of the largest |ref| entry of that row's head matrix. (2^-5 on one device. Sharding alone
  moves it further: the per-device models of tests/test_shard.py, run in lockstep with the
  reference ops, so no kernel involved, are 1.08 x 2^-5 off the single-device reference on batch 4's
  first step here, from the row-parallel partial sums' order and the bf16 roundings it flips.)
* KDA conv states (f32 [B, CONV-1, NH*D]): the step shifts in the new projection x.W; the shifted
  taps must be bit-identical to the input state's, the new tap within STATE_RTOL of that vector's
  largest entry.
* MLA latent cache (bf16 [B, S, KVR+XK]): the entry written this step at each row's position within
  1 bf16 ulp plus STATE_RTOL of that vector's largest entry; every other entry bit-identical to the
  kernel's input cache.
* no NaN anywhere; no race reported by the interpreter's race detector.

Cost, 8 interpreted devices on the 2-core dev machine: the first step of a batch (tracing, compiling,
running) takes ~2 minutes, later steps 30 s (batch 1) to 50 s (batch 4): 7.5 minutes for the module
(batch 1 185 s, batch 4 231 s). Measured worst error / tolerance: logits 50%, KDA state 23% (batch 1)
and 45% (batch 4) of RECURRENT_RTOL, conv states <= 40%, latent cache <= 29%; no runner-up routing
needed.
MKDSL_KIMI_BATCHES=1,2,4,8 runs more batches.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpret_hosts import host_callbacks
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from jax.experimental.pallas import tpu as pltpu

from mkdsl.compiler import compile_source
from mkdsl.ir import Model
from mkdsl.ops import OPS
from mkdsl.ops.moe import route
from mkdsl.quant import QTensor
from mkdsl.random_params import kernel_weights, random_params
from mkdsl.reference import build_reference

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "kimi_k3.mk"
PROFILE = "mini"
KV_TILE = 16
SEQ_LEN = 4 * KV_TILE
STEPS = 3
# MKDSL_KIMI_BATCHES=1,8 runs fewer batches (each costs 1-2 minutes).
BATCHES = tuple(int(b) for b in os.environ.get("MKDSL_KIMI_BATCHES", "1,4").split(","))
REF_BATCH = max(BATCHES)  # one compiled reference for every batch: rows are independent, smaller batches are padded
# First positions: a row crossing a tile boundary comes first, so batch 1 crosses one too.
STARTS = (KV_TILE - 2, 0, SEQ_LEN - STEPS, 2 * KV_TILE - 1, KV_TILE - 1, 5, 3 * KV_TILE - 1, 2 * KV_TILE - 3)

LOGIT_ATOL = 2.0**-4
LOGIT_RTOL = 2.0**-5
STATE_RTOL = 2.0**-5
RECURRENT_RTOL = 2.0**-4
ROUTE_TIE = 2.0**-5

INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")
RECURRENT, CONV, CACHE = "recurrent", "conv", "cache"
STATE_KINDS = {
    "kda_state": RECURRENT,
    "kda_q_conv": CONV,
    "kda_k_conv": CONV,
    "kda_v_conv": CONV,
    "mla_cache": CACHE,
}


def spec_text() -> str:
    text = SPEC.read_text(encoding="utf-8")
    anchor = "\nhints { "
    assert text.count(anchor) == 1 and "kv_tile" not in text, "update the kv_tile override"
    return text.replace(anchor, f"{anchor}kv_tile = {KV_TILE}  ", 1)


# ---------------------------------------------------------------------------- compile once


@dataclasses.dataclass
class Compiled:
    model: Model
    module: ModuleType
    reference: Callable  # (weights, state, tokens, positions, swap) at REF_BATCH -> (logits, next, state, margins)
    moe_layers: list[int]  # the layer index of each MoE layer, in order


def reference_with_routing(model: Model, weights: dict, state: dict) -> Callable:
    """The reference, compiled at REF_BATCH, with two additions in every MoE layer (made by wrapping
    the `route` op while the reference traces):

    * it returns each row's routing margin: score + bias of the TOPK-th expert taken minus that of
      the best expert not taken (the runner-up);
    * `swap[j, b]` makes row b take the runner-up instead of its TOPK-th expert in the j-th MoE
      layer, the routing weights renormalised over the experts taken as `route` does.
    """
    raw = build_reference(model, jit=False)
    margins: list = []
    swaps: list = []

    def routed(scores, bias, k):
        weights, ids = route(scores, bias, k)
        s = scores.astype(jnp.float32)
        key = s + bias.astype(jnp.float32)
        rows = jnp.arange(key.shape[0])[:, None]
        taken = jnp.zeros(key.shape, bool).at[rows, ids].set(True)
        runner_up = jnp.argmax(jnp.where(taken, -jnp.inf, key), axis=-1).astype(ids.dtype)
        margins.append(key[rows[:, 0], ids[:, -1]] - key[rows[:, 0], runner_up])
        swap = swaps[0][len(margins) - 1][:, None]
        alt = ids.at[:, -1].set(runner_up)
        chosen = jnp.take_along_axis(s, alt, axis=-1)
        return jnp.where(swap, chosen / jnp.sum(chosen, axis=-1, keepdims=True), weights), jnp.where(swap, alt, ids)

    def step(weights, state, tokens, positions, swap):
        margins.clear()
        swaps[:] = [swap]
        logits, next_tokens, new_state = raw(weights, state, tokens, positions)
        return logits, next_tokens, new_state, jnp.stack(margins)

    ints = jnp.zeros((REF_BATCH,), jnp.int32)
    n_moe = sum(any(n.op == "route" for n in model.kind(kind).nodes) for kind in model.schedule)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(OPS, "route", dataclasses.replace(OPS["route"], reference=routed))
        return jax.jit(step).lower(weights, state, ints, ints, jnp.zeros((n_moe, REF_BATCH), bool)).compile()


def res_queries(model: Model) -> list[str]:
    """The weights that res_mix reads as its query vector (operand 2)."""
    graphs = [*model.kinds, model.step]
    return sorted({n.inputs[2].name for g in graphs for n in g.nodes if n.op == "res_mix"})


def draw_params(model: Model, batch: int, seed: int) -> tuple[dict, dict]:
    """random_params, except the residual-mixing queries, drawn as projections ~ N(0, 1/H)."""
    weights, state = random_params(model, {"B": batch, "S": SEQ_LEN}, seed)
    rng = np.random.default_rng([seed, 1])
    for name in res_queries(model):
        w = weights[name]
        weights[name] = (rng.standard_normal(w.shape, np.float32) / np.sqrt(w.shape[-1])).astype(w.dtype)
    return weights, state


def reference_weights(weights: dict) -> dict:
    return {k: v if isinstance(v, QTensor) else jnp.asarray(v) for k, v in weights.items()}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Compiled:
    out, _ = compile_source(spec_text(), str(SPEC), PROFILE, None)
    path = tmp_path_factory.mktemp("kimi_k3_mini") / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    spec = importlib.util.spec_from_file_location("kimi_k3_mini_kv16", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.KV_TILE == KV_TILE, "the kv_tile hint was not applied"
    model = out.model
    assert {t.name for t in model.states} == set(STATE_KINDS), "a new state tensor: teach check_state how it is written"
    weights, state = random_params(model, {"B": REF_BATCH, "S": SEQ_LEN}, 0)
    reference = reference_with_routing(model, reference_weights(weights), {k: jnp.asarray(v) for k, v in state.items()})
    moe_layers = [i for i, kind in enumerate(model.schedule) if any(n.op == "route" for n in model.kind(kind).nodes)]
    return Compiled(model, module, reference, moe_layers)


# ---------------------------------------------------------------------------- checks


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), np.finfo(np.float32).tiny)))
    return np.exp2(e - 7)


def races_found() -> bool:
    return bool(_ipc.races is not None and _ipc.races.races_found)


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def pad_rows(x: np.ndarray, axis: int) -> np.ndarray:
    """Pad the batch axis to REF_BATCH rows with zeros (a valid token, position and state)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, REF_BATCH - x.shape[axis])
    return np.pad(x, widths)


def check_untouched(name: str, old: np.ndarray, new: np.ndarray, positions: np.ndarray, where: str) -> None:
    """What a step must leave bit for bit: the conv taps it shifts, the cache entries it does not write."""
    assert new.shape == old.shape and new.dtype == old.dtype, f"{where}: {name} changed shape or dtype"
    assert not np.isnan(new.astype(np.float32)).any(), f"{where}: NaN in {name}"
    if STATE_KINDS[name] == CONV:  # [slot, row, tap, channel]: shifted by one tap, the new input last
        same = bits(new[:, :, :-1]) == bits(old[:, :, 1:])
        assert same.all(), (
            f"{where}: {name}: a shifted tap differs from the input's, first at {tuple(np.argwhere(~same)[0])}"
        )
    elif STATE_KINDS[name] == CACHE:  # [slot, row, position, width]: one entry per row written
        written = np.zeros(new.shape, bool)
        written[:, np.arange(new.shape[1]), positions] = True
        changed = (bits(new) != bits(old)) & ~written
        assert not changed.any(), (
            f"{where}: {name}: {int(changed.sum())} entries changed that were not written this step, "
            f"first at {tuple(np.argwhere(changed)[0])}"
        )


def state_error(name: str, new: np.ndarray, want: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Each row's worst error in what this step wrote into a state tensor ([slot, row, ...]), in STATE_RTOLs."""
    batch = new.shape[1]
    if STATE_KINDS[name] == RECURRENT:  # [slot, row, head, dk, dv], all written; per head matrix
        err = np.abs(new - want) / np.abs(want).max(axis=(-2, -1), keepdims=True) * (STATE_RTOL / RECURRENT_RTOL)
    elif STATE_KINDS[name] == CONV:  # the new tap; per vector
        got, ref = new[:, :, -1], want[:, :, -1]
        err = np.abs(got - ref) / np.abs(ref).max(axis=-1, keepdims=True)
    else:  # the new cache entries [slot, row, width]: 1 bf16 ulp + STATE_RTOL of the vector's largest entry
        rows = np.arange(batch)
        got, ref = new[:, rows, positions].astype(np.float32), want[:, rows, positions].astype(np.float32)
        err = np.maximum(np.abs(got - ref) - bf16_ulp(ref), 0) / np.abs(ref).max(axis=-1, keepdims=True)
    return np.moveaxis(err, 1, 0).reshape(batch, -1).max(axis=1) / STATE_RTOL


def check_replicated(module, next_tokens, new_state, where: str) -> None:
    """Each device's own copy of what the design keeps whole everywhere must be the same bits."""
    if not hasattr(module, "MESH_SHAPE"):
        return
    whole = {"next tokens": next_tokens} | {
        name: a for name, a in new_state.items() if not any(module.STATE_SPLIT[name])
    }
    assert "mla_cache" in whole, "the latent cache should be whole on every device"
    for name, a in whole.items():
        shards = [np.asarray(s.data) for s in a.addressable_shards]
        assert len(shards) == math.prod(module.MESH_SHAPE), f"{where}: {name}: {len(shards)} device copies"
        for i, s in enumerate(shards[1:], 1):
            assert np.array_equal(bits(s), bits(shards[0])), f"{where}: {name} differs between device 0 and device {i}"


def logit_tolerance(ref_logits: np.ndarray) -> np.ndarray:
    return LOGIT_ATOL + LOGIT_RTOL * np.abs(ref_logits)


def errors(logits, new_state, ref, positions) -> dict[str, np.ndarray]:
    """Each row's worst error against one reference output, in units of its tolerance, per item."""
    ref_logits, _, ref_state = ref
    out = {"logits": (np.abs(logits - ref_logits) / logit_tolerance(ref_logits)).max(axis=1)}
    for name, new in new_state.items():
        out[name] = state_error(name, new, ref_state[name], positions)
    return out


# ---------------------------------------------------------------------------- one batch


def run_reference(c: Compiled, ref_in: tuple, swap: np.ndarray, batch: int):
    """((logits, next tokens, state), routing margins [MoE layer, row]) of the first `batch` rows."""
    logits, next_tokens, new_state, margins = c.reference(*ref_in, jnp.asarray(swap))
    out = (
        np.asarray(logits)[:batch],
        np.asarray(next_tokens)[:batch],
        {k: np.asarray(v)[:, :batch] for k, v in new_state.items()},
    )
    return out, np.asarray(margins)[:, :batch]


def run_and_check(c: Compiled, batch: int, seed: int) -> dict:
    """STEPS decode steps of the kernel in interpret mode beside the reference, each one checked."""
    model, module = c.model, c.module
    weights, state = draw_params(model, batch, seed)
    ref_weights = reference_weights(weights)
    kernel_w = {k: jnp.asarray(v) for k, v in kernel_weights(weights).items()}
    kernel_state = {k: np.asarray(v) for k, v in state.items()}  # host copies: the kernel donates its state
    vocab = model.tensor("embed").type.shape[0]
    tokens = np.random.default_rng(seed).integers(0, vocab, batch).astype(np.int32)
    positions = np.asarray(STARTS[:batch], np.int32)
    n_moe = len(c.moe_layers)
    step = module.build_decode_step(batch, SEQ_LEN, interpret=INTERPRET)
    worst = {"of_tol": dict.fromkeys(["logits", *STATE_KINDS], 0.0), "swapped": [], "seconds": []}

    pltpu.reset_tpu_interpret_mode_state()
    for i in range(STEPS):
        where = f"batch {batch}, step {i}, positions {positions.tolist()}"
        ref_in = (
            ref_weights,
            {k: jnp.asarray(pad_rows(v, 1)) for k, v in kernel_state.items()},
            jnp.asarray(pad_rows(tokens, 0)),
            jnp.asarray(pad_rows(positions, 0)),
        )

        # The reference as routed, then with one near-tie routing swapped per row (the c-th of its near ties).
        base, margins = run_reference(c, ref_in, np.zeros((n_moe, REF_BATCH), bool), batch)
        ties = [np.flatnonzero(margins[:, b] < ROUTE_TIE).tolist() for b in range(batch)]
        candidates = [base]
        for k in range(max(map(len, ties))):
            swap = np.zeros((n_moe, REF_BATCH), bool)
            for b in range(batch):
                if k < len(ties[b]):
                    swap[ties[b][k], b] = True
            candidates.append(run_reference(c, ref_in, swap, batch)[0])

        t0 = time.perf_counter()
        with host_callbacks():  # see tests/interpret_hosts.py: avoids an interpreter deadlock on 8 devices
            logits, next_tokens, new_state = step(
                kernel_w,
                {k: jnp.asarray(v) for k, v in kernel_state.items()},
                jnp.asarray(tokens),
                jnp.asarray(positions),
            )
            logits = np.asarray(jax.block_until_ready(logits))
        raw_tokens, raw_state = next_tokens, new_state
        worst["seconds"].append(time.perf_counter() - t0)
        next_tokens = np.asarray(next_tokens)
        new_state = {k: np.asarray(v) for k, v in new_state.items()}

        assert not races_found(), f"{where}: the interpreter's race detector reported a race"
        check_replicated(module, raw_tokens, raw_state, where)
        assert logits.shape == base[0].shape and not np.isnan(logits).any(), f"{where}: NaN in logits"
        np.testing.assert_array_equal(next_tokens, logits.argmax(axis=1), err_msg=f"{where}: in-kernel argmax")
        for name, new in new_state.items():
            check_untouched(name, kernel_state[name], new, positions, where)

        errs = [errors(logits, new_state, ref, positions) for ref in candidates]
        for b in range(batch):
            # the routing the kernel took: the reference's, or one near tie the other way
            options = range(len(ties[b]) + 1)
            k = min(options, key=lambda k: max(e[b] for e in errs[k].values()))
            if k:
                worst["swapped"].append((i, b, c.moe_layers[ties[b][k - 1]]))
            row = {name: float(e[b]) for name, e in errs[k].items()}
            for name, e in row.items():
                worst["of_tol"][name] = max(worst["of_tol"][name], e)
            routing = (
                "routed as the reference" if not k else f"runner-up expert in layer {c.moe_layers[ties[b][k - 1]]}"
            )
            off = {name: f"{e:.2f}" for name, e in row.items() if e > 1}
            assert not off, (
                f"{where}: row {b} ({routing}; near ties in layers {[c.moe_layers[j] for j in ties[b]]}): "
                f"error / tolerance {off}"
            )
            ref_logits, ref_next, _ = candidates[k]
            if next_tokens[b] != ref_next[b]:
                best, got = ref_logits[b].max(), ref_logits[b, next_tokens[b]]
                assert got >= best - 2 * logit_tolerance(ref_logits[b]).max(), (
                    f"{where}: row {b} kernel token {next_tokens[b]} (reference logit {got:.5g}) but reference token "
                    f"{ref_next[b]} ({best:.5g}) is not a near tie"
                )

        kernel_state = new_state
        tokens = base[1].astype(np.int32)
        positions = positions + 1
    return worst


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("batch", BATCHES)
def test_kimi_k3_mini_matches_reference(batch, compiled, record_property):
    t0 = time.perf_counter()
    worst = run_and_check(compiled, batch, seed=batch)
    total = time.perf_counter() - t0
    of_tol = ", ".join(f"{name} {e:.0%}" for name, e in worst["of_tol"].items())
    line = (
        f"kimi_k3 mini batch={batch}: worst error / tolerance: {of_tol}; runner-up routings taken (step, row, layer): "
        f"{worst['swapped']}; {total:.0f} s (kernel steps {', '.join(f'{s:.1f}' for s in worst['seconds'])} s)"
    )
    print("\n" + line)
    for name, e in worst["of_tol"].items():
        record_property(f"batch{batch}_{name}_of_tolerance", round(e, 3))
    record_property(f"batch{batch}_seconds", round(total, 1))
