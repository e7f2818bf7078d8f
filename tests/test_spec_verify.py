"""Verify rows (speculative decoding): R rows of one sequence per step, `commit`, context outputs.

Reference (fast). A verify step of R rows equals R plain steps fed the same tokens: row r's
logits those of plain step r, and after `commit` at any accepted length a the state those of
plain step a - 1 (recurrent state whole; caches at the positions written so far). The verify
reference runs each op's prefill rule over the B*R rows, the plain one its decode reference per
row, so XLA may sum in another order: f32 noise that can flip the bf16 rounding of a matmul input
(the mechanism mkdsl/verify/kernel.py bounds per layer). Nothing resets the difference between
layers here, so, as tests/test_prefill.py argues, the state layer l writes is within (l + 1) x
STATE_RTOL of its vector's largest |ref| plus one storage ulp, and the logits within (L + 1) x
LOGIT_RTOL of the row's largest |ref logit|. A row attending one position too far or too short,
or a state committed from the wrong row, is off by O(1) of the scale.

Reference (fast for tiny): greedy speculative decoding with the verify reference and `commit`
gives exactly plain greedy decoding's tokens, with every accepted length occurring.

Kernel (slow, TPU interpret mode, race detector on (Kimi K3 mini: on its first step, see
KERNEL_CASES), NaN-filled memory): greedy speculative
decoding with the kernel's verify step and the module's `commit`, over >= 24 tokens with drafts
forced partly wrong so that every accepted length 0..R-1 (drafted tokens kept) occurs, is checked
step by step against plain greedy decoding: each step, the reference's plain step starts from
the kernel's committed state and is fed the kept tokens; every kept token is its argmax there,
or a near tie, within twice the whole-step logit bound ((L + 1) x LOGIT_RTOL of the row's largest
|logit|, as above; twice, as LayerChecker allows, since both sides may be off); and the module's
`commit` selects exactly the slots `mkdsl.commit` does (held to plain decoding above). A
near tie may go either way under rounding (Qwen3-Next mini, seed 8: a top-2 gap of 0.0168 at
logits of 6.7), so decoding goes on from the kernel's token; more than two in a run would mean
errors far above rounding. A routing choice within ROUTE_TIE (2^-8) of its runner-up may also go
either way (Kimi K3 mini, 16 random experts: the kernel took another expert than plain at 3 of 24
tokens on the dev machine, where XLA:CPU's flags moved the rounding by an ulp): a kept token plain
misses counts as a routing near tie where plain, taking the runner-up at one of its routing near
ties in the rows fed so far, scores it within that bound; only the others count against the two
logit near ties. Plain starts from the kernel's state at every step rather than following its
own trajectory: in Kimi K3 mini (random MoE routing over 16 experts), verify and plain from one
state differ by <= 0.17 in logits of ~3.5 (rounding), but their separate trajectories by 2.6
after five steps, as one routing choice tips and its effect stays in the KDA and MLA state. A state committed from the wrong row or a row attending the wrong positions
moves logits and states by O(1). Every step's kernel also equals the reference layer by layer
(mkdsl/verify/kernel.py's LayerChecker over the B*R rows, its bounds derived there). Cases: tiny
(R = 8), Gemma 3 mini (GQA with a 32-token window, crossed), Qwen3-30B-A3B mini (MoE),
Qwen3-Next mini (gated delta net, short convolutions), Kimi K3 mini (KDA + MLA, sharded), R = 4
except tiny.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import mkdsl
from mkdsl.verify import kernel as verify
from mkdsl.verify.kernel import LOGIT_RTOL, STATE_RTOL, storage_ulp


@functools.cache
def _spec(path: str, profile: str | None):
    return mkdsl.load(path, profile)


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _logits_ok(model, want, got) -> bool:
    scale = np.abs(_f32(want)).max(axis=-1, keepdims=True)
    return bool((np.abs(_f32(got) - _f32(want)) <= (len(model.schedule) + 1) * LOGIT_RTOL * scale).all())


def _cache_upto(model, state: dict, limit) -> dict:
    """Each cache's entries at positions >= limit[b] zeroed (not yet meaningful after a commit)."""
    seq = {d.name for d in model.dims[1:]}
    out = dict(state)
    for t in model.states:
        axes = [i for i, d in enumerate(t.full_shape) if d in seq]
        if not axes:
            continue
        x = _f32(state[t.name])
        batch_axis = t.full_shape.index(model.dims[0].name)
        pos = np.arange(x.shape[axes[0]]).reshape([-1 if i == axes[0] else 1 for i in range(x.ndim)])
        lim = np.asarray(limit).reshape([-1 if i == batch_axis else 1 for i in range(x.ndim)])
        out[t.name] = np.where(pos < lim, x, 0.0)
    return out


def _state_errors(model, want: dict, got: dict) -> list[str]:
    bad, units = [], verify.state_units(model)  # a recurrent state: per head (mkdsl/verify/kernel.py)
    for t in model.states:
        for slot in range(t.stack if t.stacked else 1):
            layers = [li for li, s in enumerate(t.slots) if s == slot] if t.stacked else [len(model.schedule)]
            w = _f32(want[t.name][slot] if t.stacked else want[t.name])
            g = _f32(got[t.name][slot] if t.stacked else got[t.name])
            scale = np.abs(w).max(axis=tuple(range(-units.get(t.name, 1), 0)), keepdims=True)
            bound = storage_ulp(w, np.asarray(want[t.name]).dtype) + (max(layers) + 1) * STATE_RTOL * scale
            ratio = float((np.abs(g - w) / bound).max())
            if not ratio <= 1:
                bad.append(f"{t.name}[{slot}] off by {ratio:.2f}x the bound")
    return bad


# Qwen3-Next mini's reference compiles for about a minute per step function: slow.
REFERENCE_SPECS = [
    pytest.param("specs/tiny.mk", None, id="tiny"),
    pytest.param("specs/qwen3_next_80b_a3b.mk", "mini", id="qwen3_next_mini", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("path,profile", REFERENCE_SPECS)
def test_verify_reference_equals_plain_steps_and_commits_at_every_length(path, profile):
    spec, rows, batch = _spec(path, profile), 4, 2
    model = spec.model
    weights, state = mkdsl.random_inputs(spec, batch=batch, seq_len=256, seed=3)
    tokens = np.random.default_rng(4).integers(0, 256, (batch, rows)).astype(np.int32)
    positions = np.array([[5], [30]], np.int32) + np.arange(rows, dtype=np.int32)
    plain, after = mkdsl.reference_step(spec), []
    s = dict(state)
    for r in range(rows):
        logits, _, s = plain(weights, s, tokens[:, r], positions[:, r])
        after.append((np.asarray(logits), {k: np.asarray(v) for k, v in s.items()}))
    last = len(model.schedule) - 1
    step = mkdsl.reference_step(spec, rows=rows, context_layers=(0, last))
    logits, next_tokens, new, context = step(weights, mkdsl.verify_state(spec, state, rows), tokens, positions)
    assert logits.shape == (batch, rows, after[0][0].shape[-1]) and context.shape[:3] == (batch, rows, 2)
    assert (np.asarray(next_tokens) == np.asarray(jnp.argmax(logits, axis=-1))).all()
    for r in range(rows):
        assert _logits_ok(model, after[r][0], logits[:, r]), f"row {r}: logits"
    for a in range(1, rows + 1):
        committed = mkdsl.plain_state(spec, mkdsl.commit(spec, new, np.full(batch, a, np.int32)), rows)
        limit = positions[:, 0] + a
        errors = _state_errors(model, _cache_upto(model, after[a - 1][1], limit), _cache_upto(model, committed, limit))
        assert errors == [], f"committed at {a}: {errors}"


def test_commit_copies_each_sequences_accepted_row_slot():
    spec, rows = _spec("specs/qwen3_next_80b_a3b.mk", "mini"), 3
    _, state = mkdsl.random_inputs(spec, batch=2, seq_len=64, seed=5, rows=rows)
    rng = np.random.default_rng(6)
    state = {k: rng.standard_normal(np.shape(v)).astype(np.float32) for k, v in state.items()}  # every slot distinct
    axes = spec.model.row_states()
    assert axes and all(spec.model.tensor(n).type.shape[0] == "B" for n in axes)  # recurrent: gdn state, conv taps
    new = mkdsl.commit(spec, state, np.array([1, 3], np.int32))
    for name, x in state.items():
        got = np.asarray(new[name])
        if name not in axes:
            assert np.array_equal(got, x), f"{name}: a cache changed"
            continue
        ax = axes[name]
        take = [0, 1, 0, 3, 4, 5]  # sequence 0 kept row 0 (slot 0 -> slot 2); sequence 1 all three rows
        assert np.array_equal(got, np.take(x, take, axis=ax)), name


def test_verify_arguments_are_checked():
    spec = _spec("specs/tiny.mk", None)
    for rows in (0, 17):
        with pytest.raises(ValueError, match="rows must be an int in 1..16"):
            mkdsl.reference_step(spec, rows=rows)
    with pytest.raises(ValueError, match="context layers must be layer indices 0..1"):
        mkdsl.reference_step(spec, rows=2, context_layers=(2,))
    module = mkdsl.load_kernel(spec)
    with pytest.raises(ValueError, match="batch x verify_rows = 32 kernel rows, more than 16"):
        module.build_decode_step(2, 256, verify_rows=16)
    with pytest.raises(ValueError, match="one step per call"):
        module.build_decode_step(1, 256, verify_rows=2, steps_per_call=2)
    weights, state = mkdsl.random_inputs(spec, batch=1, seq_len=256, rows=4)
    kw = mkdsl.kernel_weights(weights)
    tokens = np.zeros((1, 4), np.int32)
    with pytest.raises(ValueError, match="positions must be consecutive"):
        module.check_inputs(kw, state, tokens, np.array([[3, 4, 6, 7]], np.int32), 1, 256, 4)
    with pytest.raises(ValueError, match=r"tokens must be an integer array of shape \(1, 4\)"):
        module.check_inputs(kw, state, np.zeros(4, np.int32), np.zeros((1, 4), np.int32), 1, 256, 4)


def _greedy(step, weights, state, token: int, start: int, count: int) -> list[int]:
    """Plain greedy decoding of `count` tokens after `token` at position `start`."""
    out, s, tok = [], dict(state), np.array([token], np.int32)
    for i in range(count):
        _, nxt, s = step(weights, s, tok, np.array([start + i], np.int32))
        tok = np.asarray(nxt).astype(np.int32).reshape(1)
        out.append(int(tok[0]))
    return out


def _speculate(verify_step, commit, state, token: int, start: int, want: list[int], rows: int, vocab: int):
    """Greedy speculative decoding of len(want) - rows tokens with drafts taken from `want` (the
    plain greedy tokens) and forced wrong after k of them, k = 0, 1, .., rows - 1 in turn, then
    all right. `verify_step(state, tokens, positions) -> (next_tokens [1, R], state)`. Returns
    (tokens, accepted drafts per step)."""
    out, kept, pos, last = [], [], start, token
    while len(out) < len(want) - rows:
        k = min(len(kept), rows - 1)
        drafts = [want[len(out) + i] if i < k else (want[len(out) + i] + 1) % vocab for i in range(rows - 1)]
        tokens = np.array([[last, *drafts]], np.int32)
        nxt, state = verify_step(state, tokens, pos + np.arange(rows, dtype=np.int32)[None])
        nxt = np.asarray(nxt).reshape(rows)
        a = 1
        while a < rows and drafts[a - 1] == nxt[a - 1]:
            a += 1
        out += [*drafts[: a - 1], int(nxt[a - 1])]
        kept.append(a - 1)
        state = commit(state, np.array([a], np.int32))
        pos, last = pos + a, out[-1]
    return out, kept


@pytest.mark.parametrize("path,profile", REFERENCE_SPECS)
def test_reference_greedy_speculative_decoding_equals_plain_greedy(path, profile):
    spec, rows, count = _spec(path, profile), 4, 24
    weights, state = mkdsl.random_inputs(spec, batch=1, seq_len=256, seed=7)
    want = _greedy(mkdsl.reference_step(spec), weights, state, 11, 20, count + rows)
    ref = mkdsl.reference_step(spec, rows=rows)

    def verify_step(s, tokens, positions):
        _, nxt, s = ref(weights, s, tokens, positions)
        return nxt, s

    commit = functools.partial(mkdsl.commit, spec)
    got, kept = _speculate(verify_step, commit, mkdsl.verify_state(spec, state, rows), 11, 20, want, rows, 256)
    assert got[:count] == want[:count]
    assert set(kept) == set(range(rows)), kept


def _near_tie(lg: np.ndarray, choice: int, tie: float) -> bool:
    """Whether `choice` scores within `tie` x the row's largest |logit| of the row's best."""
    return bool(lg.max() - lg[choice] <= tie * np.abs(lg).max())


def _routing_tie_explains(spec, weights, state, tokens, start: int, choice: int, tie: float) -> bool:
    """Whether plain's reference, fed `tokens` one at a time from `state` at `start`, with one of
    its routing choices within the kernel check's ROUTE_TIE (2^-8) of the runner-up taking the
    runner-up, scores `choice` within `tie` of its best at the last row. The verify step computes
    the router's scores in another order (bf16 inputs rounded elsewhere), so it may take the
    runner-up at such a near tie, and its rows differ from there by the expert's whole
    contribution, not by rounding; LayerChecker excuses the kernel's side of a layer the same way
    (mkdsl/verify/kernel.py)."""
    from mkdsl.verify.transformers import watching_route_ties

    step = mkdsl.reference_step(spec, jit=False)

    def run(flip: int | None) -> tuple[np.ndarray, int]:
        found, s = [], {k: jnp.asarray(v) for k, v in state.items()}
        with watching_route_ties(spec.model, lambda: found.append(True), margin=verify.ROUTE_TIE, flip=flip):
            for i, token in enumerate(tokens):
                logits, _, s = step(weights, s, np.array([token], np.int32), np.array([start + i], np.int32))
        return _f32(logits[0]), len(found)

    _, ties = run(None)
    for n in range(ties):
        if _near_tie(run(n)[0], choice, tie):
            return True
    return False


def _speculate_against(plain, weights, verify_step, commit, spec, state, token, start, rows, count, tie):
    """Greedy speculative decoding checked step by step against plain greedy decoding: each step,
    the reference's `plain` step starts from the verify side's committed state (`plain_state`), so
    that the two never drift apart by rounding carried across steps (Kimi K3 mini's random MoE
    routing turns a rounding difference into a different expert a few steps later: verify and
    plain from one state differ by <= 0.17 in logits of ~3.5, their separate trajectories by 2.6
    after 5 steps). The drafts are plain's greedy continuation, forced wrong after k of them (k:
    the smallest accepted length not seen yet, then all right); every token the verify step keeps
    must be plain's argmax there, or within `tie` x the row's largest |logit| of it (a near tie,
    which rounding may decide either way; decoding goes on from the kernel's token), unless plain,
    taking the runner-up at one of its routing near ties in the rows fed so far this step, scores
    it so (`_routing_tie_explains`: a routing near tie, not counted as a logit one); and `commit`
    must select exactly what `mkdsl.commit` selects (which the reference tests above hold to plain
    decoding), so a wrong slot is caught. Returns (tokens, accepted drafts per step, logit near
    ties, tokens explained by a routing near tie)."""
    out, kept, ties, routed, pos, last = [], [], [], [], start, token
    for _ in range(count + 2 * rows):
        missing = [n for n in range(rows) if n not in kept]
        if len(out) >= count and not missing:
            break
        ref_state = {k: np.asarray(v) for k, v in mkdsl.plain_state(spec, state, rows).items()}
        step_state = dict(ref_state)
        k = missing[0] if missing else rows - 1
        s, t, cont = dict(ref_state), last, []
        for i in range(rows - 1):
            logits, nt, s = plain(weights, s, np.array([t], np.int32), np.array([pos + i], np.int32))
            t = int(np.asarray(nt)[0])
            cont.append(t)
        vocab = np.shape(logits)[-1]
        drafts = [c if i < k else (c + 1) % vocab for i, c in enumerate(cont)]
        tokens = np.array([[last, *drafts]], np.int32)
        nxt, state = verify_step(state, tokens, pos + np.arange(rows, dtype=np.int32)[None])
        nxt = np.asarray(nxt).reshape(rows)
        a = 1
        while a < rows and drafts[a - 1] == nxt[a - 1]:
            a += 1
        for j in range(a):  # plain fed the kept rows
            logits, _, ref_state = plain(weights, ref_state, tokens[0, j : j + 1], np.array([pos + j], np.int32))
            lg, choice = _f32(logits[0]), int(nxt[j])
            if choice != int(lg.argmax()):
                if _routing_tie_explains(spec, weights, step_state, tokens[0, : j + 1], pos, choice, tie):
                    routed.append(len(out) + j)
                    continue
                assert _near_tie(lg, choice, tie), (
                    f"token {len(out) + j}: {choice}, {lg.max() - lg[choice]:.3g} below the argmax, "
                    "and no routing near tie explains it"
                )
                ties.append(len(out) + j)
        out += [*drafts[: a - 1], int(nxt[a - 1])]
        kept.append(a - 1)
        accepted = np.array([a], np.int32)
        want, state = mkdsl.commit(spec, state, accepted), commit(state, accepted)
        for name, x in want.items():  # a slot selection: exact
            assert np.array_equal(np.asarray(x), np.asarray(state[name])), f"commit at {a}: `{name}` differs"
        pos, last = pos + a, out[-1]
    return out, kept, ties, routed


# (spec, profile, R, first position, steps run with the race detector: None for all). Kimi K3
# mini interprets 8 devices: a 4-row step costs ~12 s with the race detector and ~8 s without, a
# build ~35 s (measured on the 2-core dev machine), so its first step runs with it (every DMA,
# semaphore and remote copy of the R-row step; the schedule does not depend on the accepted
# length) and the other 7, compiled once more without it, check the numerics. tests/test_kimi_kernel.py
# runs every R = 1 step with it at batch 4, including one whose first row enters a new KV tile.
KERNEL_CASES = [
    ("specs/tiny.mk", None, 8, 10, None),
    ("specs/gemma3_27b.mk", "mini", 4, 20, None),  # from position 20 past the 32-token window
    ("specs/qwen3_30b_a3b.mk", "mini", 4, 10, None),
    ("specs/qwen3_next_80b_a3b.mk", "mini", 4, 10, None),
    ("specs/kimi_k3.mk", "mini", 4, 10, 1),  # KDA (delta rule, short convolutions) + MLA, over 8 devices
]


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize(
    "path,profile,rows,start,race_steps",
    KERNEL_CASES,
    ids=["tiny_r8", "gemma3_mini", "qwen3_mini", "qwen3_next_mini", "kimi_k3_mini"],
)
def test_kernel_speculative_decoding_equals_plain_greedy_layer_by_layer(path, profile, rows, start, race_steps):
    spec, count = _spec(path, profile), max(24, rows * (rows + 1) // 2)
    model, module = spec.model, mkdsl.load_kernel(spec)
    seq_len = verify.check_seq_len(module)
    assert start + count + 3 * rows <= seq_len
    weights, state = mkdsl.random_inputs(spec, batch=1, seq_len=seq_len, seed=8)

    @functools.cache
    def build(races: bool):
        params = verify.interpret_params()
        params = params if races else dataclasses.replace(params, detect_races=False)
        return module.build_decode_step(1, seq_len, interpret=params, layer_trace=True, verify_rows=rows)

    checker, failures, raced = verify.LayerChecker(model, rows=rows), [], []
    sharded, pad = hasattr(module, "MESH_SHAPE"), getattr(module, "pad_weights", dict)

    def verify_step(s, tokens, positions):
        races = race_steps is None or len(raced) < race_steps
        out = verify.run_kernel(build(races), weights, s, tokens, positions, sharded, pad)
        raced.append(races)
        assert not verify.races_found(), "the race detector reported a race"
        failures.extend(checker.check(weights, s, tokens, positions, out).failures)
        return out.next_tokens, out.state

    def commit(s, accepted):
        return {k: np.asarray(v) for k, v in module.commit(s, accepted).items()}

    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    start_state = {k: np.asarray(v) for k, v in mkdsl.verify_state(spec, state, rows).items()}
    tie = 2 * (len(model.schedule) + 1) * LOGIT_RTOL  # twice the whole-step logit bound (module docstring)
    plain = mkdsl.reference_step(spec)
    got, kept, ties, routed = _speculate_against(
        plain, weights, verify_step, commit, spec, start_state, 11, start, rows, count, tie
    )
    assert failures == []
    assert len(got) >= count and set(kept) == set(range(rows)), kept
    assert len(ties) <= 2, f"near ties at tokens {ties}"  # random logits: a near tie is rare
    print(f"\n{path} {profile}: logit near ties at tokens {ties}, routing near ties at {routed}")


def test_mkdsl_verify_rows_out_of_range_is_a_usage_error(capsys):
    from mkdsl.cli import main

    assert main(["verify", "specs/tiny.mk", "--rows", "17", "--no-compile"]) == 2
    assert "--rows 17: verify rows must be 1..16" in capsys.readouterr().err
    assert main(["verify", "specs/tiny.mk", "--rows", "4", "--batch", "8", "--no-compile"]) == 2
