"""A block drafter's step against its stand-in (`verify --against transformers` on a draft spec such
as specs/kimi_k3_dspark.mk; the stand-in: mkdsl/verify/dspark.py). A drafter has no prefill over a
prompt: each step is a block of rows (the anchor, then mask tokens) that reads the target's
context, so the oracle's prefill + decode comparison (mkdsl/verify/transformers.py) does not fit;
its parts do, and are reused here with their bounds.

The steps are the host's (mkdsl/run/spec_drafters.py, `SpecDrafter`): the prompt's context rows
(random target hidden states, one per prompt token) written `rows` at a time, each write a step
with the first anchor's block; then `steps` more proposals, each after 1..rows accepted rows. A
prompt longer than the context window (the `mini` profile's 64 slots) reuses slots and masks the
oldest rows. Each step, both sides on the same inputs:

* fed, as the oracle's decode steps: the prologue (the embedding and the context projection the
  layers carry) against the stand-in's, within 2^-9 per rounded read of each row's largest entry;
  each layer fed the stand-in's hidden state entering it and its context projection, against its
  output (`compare_layer`: the bf16-derived layer bound, an ill-conditioned row's allowance, and
  the first op that differs named); the epilogue fed the stand-in's last hidden state: logits
  within LOGIT_RTOL, and the drafts;
* free: the spec's whole step from its own state (its own caches), its drafts against the
  stand-in's Markov-biased scores with the spec's previous token (teacher forced: `check_choice`,
  a different draft passes only as a near tie, within TIE_RTOL of the best score).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mkdsl.lang.ir import Model
from mkdsl.lazy import jnp
from mkdsl.verify.oracle_trace import hf_trace, step_op_values
from mkdsl.verify.transformers import (
    F32_RTOL,
    ROUNDING,
    OracleReport,
    check_choice,
    compare_layer,
    compare_logits,
    first_differing,
    rounded_reads,
    sensitivity,
)


def draft_schedule(prompt: int, steps: int, rows: int, rng) -> list[tuple[list[int], int, int]]:
    """(context positions written, anchor position, proposal) of each drafter step: the prompt's
    rows `rows` at a time with the first proposal's anchor (at `prompt`), then `steps` proposals,
    each after 1..rows accepted rows (the anchor and the kept drafts)."""
    out, pending, anchor = [], list(range(prompt)), prompt
    for proposal in range(steps + 1):
        while len(pending) > rows:
            out.append((pending[:rows], anchor, proposal))
            pending = pending[rows:]
        out.append((pending, anchor, proposal))
        accepted = int(rng.integers(1, rows + 1))
        pending, anchor = list(range(anchor, anchor + accepted)), anchor + accepted
    return out


def block_rows(model: Model) -> int:
    """The rows of a compared block: Kimi K3's 8 (the anchor and 7 drafts) within the spec's range."""
    rows = model.dims[0]
    return min(max(8, rows.low), rows.high)


def compare_draft_steps(report: OracleReport, model: Model, weights, hf, ids: np.ndarray, steps: int) -> None:
    """The drafter's steps (module docstring); the anchors are `ids`' tokens in turn, the prompt's
    context rows one per token of `ids`."""
    from mkdsl.run.prefill import reference_weights
    from mkdsl.run.reference import build_layered_reference, build_reference
    from mkdsl.run.spec_drafters import empty_state

    rows, (ctx_name, pos_name, _) = block_rows(model), model.context
    rng = np.random.default_rng(0)
    schedule = draft_schedule(len(ids), steps, rows, rng)
    hidden = rng.standard_normal((schedule[-1][1] + 1, model.tensor(ctx_name).type.shape[1])).astype(np.float32)
    w = reference_weights(model, weights)
    free = fed = {k: jnp.asarray(v) for k, v in empty_state(model, rows).items()}  # unjitted: jnp's `.at`
    step, layered = build_reference(model, jit=False), build_layered_reference(model)
    mask = int(model.const["MASK"])
    hf.reset()
    for s, (cpos, anchor, proposal) in enumerate(schedule):
        tokens = np.asarray([ids[proposal % len(ids)]] + [mask] * (rows - 1), np.int32)
        positions = np.arange(anchor, anchor + rows, dtype=np.int32)
        context, cp = np.zeros((rows, hidden.shape[1]), np.float32), np.full(rows, -1, np.int32)
        context[: len(cpos)], cp[: len(cpos)] = hidden[cpos], cpos
        trace, c = _traced(hf, tokens, positions, context, cp)
        free = {**free, ctx_name: jnp.asarray(context), pos_name: jnp.asarray(cp)}
        fed = {**fed, ctx_name: jnp.asarray(context), pos_name: jnp.asarray(cp)}
        _, drafts, free = step(w, free, jnp.asarray(tokens), jnp.asarray(positions))
        _check_drafts(report, hf, trace.logits, tokens[0], np.asarray(drafts), f"draft step {s}: draft")
        fed = _compare_fed(report, model, w, layered, fed, (hf, trace, c), tokens, positions, f"draft step {s}")
    report.lines.append(
        f"{len(ids)} prompt context rows + {steps} proposals: {len(schedule)} drafter steps of {rows} rows, "
        f"context positions 0..{schedule[-1][1] - 1}; last drafts {np.asarray(drafts).tolist()}"
    )


def _traced(hf, tokens, positions, context, cp):
    """The stand-in's step (`hf_trace`) and its context projection (what `hidden_norm` gives)."""
    import torch

    got = {}

    def keep(module, args, out):
        got["c"] = out[0].detach().float().numpy().copy()

    hook = hf.hidden_norm.register_forward_hook(keep)
    try:
        trace = hf_trace(
            hf,
            tokens,
            position_ids=torch.as_tensor(positions[None], dtype=torch.long),
            context=torch.from_numpy(context[None]),
            context_positions=torch.as_tensor(cp, dtype=torch.long),
        )
    finally:
        hook.remove()
    return trace, got["c"]


def _check_drafts(report: OracleReport, hf, logits: np.ndarray, anchor, drafts: np.ndarray, what: str) -> None:
    """Each draft against the stand-in's scores: its `logits` plus the Markov bias of the spec's
    previous token (the anchor, then the spec's own drafts)."""
    import torch

    previous = torch.as_tensor([int(anchor), *drafts[:-1].tolist()])
    with torch.no_grad():
        scores = hf.markov_scores(torch.from_numpy(logits), previous).numpy()
    for r, d in enumerate(drafts):
        check_choice(report, scores[r], int(d), f"{what} {r}")


def _compare_fed(report, model: Model, w, layered, state, traced, tokens, positions, where: str):
    """The step with every piece fed the stand-in's input (module docstring); the state after it."""
    from mkdsl.run.reference import run_layer

    hf, trace, c = traced
    anchor, tokens, positions = int(tokens[0]), jnp.asarray(tokens), jnp.asarray(positions)
    x0, c0 = layered.prologue(w, state, tokens, positions)
    _compare_prologue(report, model, (x0, c0), (trace.layer_in[0], c), where)
    for i in range(len(model.schedule)):
        args = (model, i, w, state, tokens, positions, [jnp.asarray(trace.layer_in[i]), jnp.asarray(c)])
        out, state = run_layer(*args)
        got = np.asarray(out[0], np.float32)
        moved, explain = functools.partial(_moved, *args), functools.partial(_first_op, trace, *args)
        compare_layer(report, model, i, got, trace, slice(0, len(tokens)), where, moved=moved, explain=explain)
    last = [jnp.asarray(trace.layer_out[-1]), jnp.asarray(c)]
    logits, drafts = layered.epilogue(w, state, tokens, positions, last)
    compare_logits(report, np.asarray(logits, np.float32), trace.logits, where)
    _check_drafts(report, hf, trace.logits, anchor, np.asarray(drafts), f"{where}: draft (fed)")
    return state


def _compare_prologue(report, model: Model, got, want, where: str) -> None:
    """What enters the layer stack (the embedding, the context projection) against the stand-in's:
    each row within 2^-9 of its largest entry per op of the prologue that reads a weight or state
    (one rounded matmul input each, the layer bound's premise), plus f32 noise."""
    stack = next(i for i, n in enumerate(model.step.nodes) if n.op == "layers")
    reads = rounded_reads(dataclasses.replace(model.step, nodes=model.step.nodes[:stack]))
    names = [r.name for r in model.step.nodes[stack].inputs]
    for name, g, x in zip(names, got, want):
        scale = np.abs(x).max(axis=-1)
        bound = (reads * ROUNDING + F32_RTOL) * scale + np.finfo(np.float32).tiny
        ratio = np.abs(np.asarray(g, np.float32) - x).max(axis=-1) / bound
        report.note("prologue", ratio.max())
        bad = np.flatnonzero(~(ratio <= 1))
        if bad.size:
            report.failures.append(f"{where} prologue: `{name}` row {bad[0]} off by {ratio[bad[0]]:.2f}x the bound")


def _moved(model, index, w, state, tokens, positions, carries) -> np.ndarray:
    """`sensitivity` of layer `index` to its hidden-state input, from the same state and context."""
    from mkdsl.run.reference import run_layer

    def run(x):
        return run_layer(model, index, w, state, tokens, positions, [jnp.asarray(x), carries[1]])[0][0]

    return sensitivity(run, np.asarray(carries[0], np.float32))


def _first_op(trace, model, index, w, state, tokens, positions, carries) -> str:
    """The first op of layer `index` that differs from the stand-in's modules (`first_differing`)."""
    values = step_op_values(model, index, w, state, tokens, positions, carries)
    return first_differing(values, trace.modules[index])
