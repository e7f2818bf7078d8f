"""Speculative decoding's loop, on the host: the drafter proposes R-1 tokens after the anchor,
the target verifies the R rows in one step, the accept rule (mkdsl/run/accept.py) keeps a
prefix of the drafts and adds the target's own token, the step is committed at that length, and
the drafter hears what was kept. One sequence (batch 1).

`speculate` drives any target with `verify(tokens, position) -> rows` (rows with `next_token`,
`logits`, `commit`, and `context(k)` for a drafter reading target hidden states): the R-row step
of the kernel or of the reference, one call per verify step (mkdsl/run/verify_rows.py). With
R = 1 (no drafts) it is plain decoding.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mkdsl.run.accept import Accepted, SeededCoins, accept_greedy, accept_sampled
from mkdsl.run.drafters import Drafter
from mkdsl.run.verify_rows import RowsTarget


@dataclass
class Speculation:
    """What a speculative generation made and how: per verify step, the tokens it accepted
    (kept drafts + 1) and its seconds."""

    tokens: list[int]
    rows: int  # R
    steps: list[tuple[int, float]] = field(default_factory=list)
    calls: int = 0  # calls of the target's step (one R-row step per verify step), 0 if not counted

    @property
    def mean_accepted(self) -> float:
        return sum(n for n, _ in self.steps) / len(self.steps) if self.steps else 0.0

    def accept_lengths(self) -> list[int]:
        """Drafts kept per step (0 .. R-1)."""
        return [n - 1 for n, _ in self.steps]

    def summary(self, drafter: str) -> str:
        """The speculative figures: mean accepted tokens per verify step and accepted tokens/s,
        beside the plain ms/step. The first step (trace and compile) is left out when others ran."""
        if not self.steps:
            return f"speculative ({drafter}, {self.rows} rows): no verify steps"
        timed = self.steps[1:] or self.steps
        secs, made = sum(t for _, t in timed), sum(n for n, _ in timed)
        note = "" if len(self.steps) > 1 else ", the only step: trace and compile included"
        calls = f"; {self.calls} target calls" if self.calls else ""
        step_ms = 1000 * secs / len(timed)
        return (
            f"speculative ({drafter}, {self.rows} rows per verify step): {len(self.steps)} verify steps{calls}, "
            f"mean accepted {self.mean_accepted:.2f} tokens/step; {step_ms:.1f} ms/step, "
            f"{made / secs:.2f} accepted tokens/s ({len(timed)} timed steps{note}); "
            f"{1000 / step_ms:.2f} tokens/s if each step kept only the target's token (drafts: x{made / len(timed):.2f})"
        )


def speculate(
    target,
    drafter: Drafter,
    prompt: list[int],
    first: int,
    max_tokens: int,
    *,
    sampling,
    seed: int = 0,
    stop: frozenset[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
    prompt_context=None,
) -> Speculation:
    """Generate after `prompt` (already prefilled) and its sampled token `first`, until a token in
    `stop` (kept) or `max_tokens` tokens in all; `on_tokens` sees each step's new tokens.
    `prompt_context`: the target's hidden states of the prompt's tokens [T, len(layers), H], for a
    drafter with `context_layers` (it then gets the accepted rows' after each step)."""
    rows = drafter.rows
    out = Speculation([int(first)], rows)
    if on_tokens:
        on_tokens([int(first)])
    reads = bool(drafter.context_layers)
    if reads and tuple(getattr(target, "context_layers", ())) != tuple(drafter.context_layers):
        raise ValueError(f"the drafter reads target layers {drafter.context_layers}: the target gives none of them")
    drafter.start(list(prompt), prompt_context if reads else None)
    anchor, position = int(first), len(prompt)
    while len(out.tokens) < max_tokens and anchor not in stop:
        drafts = [int(t) for t in drafter.propose(anchor, position)]
        if len(drafts) != rows - 1:
            raise ValueError(f"the drafter proposed {len(drafts)} tokens, not rows - 1 = {rows - 1}")
        t0 = time.perf_counter()
        verified = target.verify([anchor, *drafts], position)
        got = _accept(verified, drafts, sampling, seed, position, getattr(drafter, "draft_probs", None))
        verified.commit(got.drafts + 1)
        out.steps.append((len(got.tokens), time.perf_counter() - t0))
        drafter.accept(got.tokens, verified.context(got.drafts + 1) if reads else None)
        new = _until_stop(got.tokens[: max_tokens - len(out.tokens)], stop)
        out.tokens += new
        if on_tokens:
            on_tokens(new)
        anchor, position = got.tokens[-1], position + got.drafts + 1
        if len(new) < len(got.tokens):
            break
    out.calls = getattr(target, "calls", 0)
    return out


def _accept(verified, drafts, sampling, seed, position, draft_probs) -> Accepted:
    if sampling.greedy:
        return accept_greedy(verified, drafts)
    return accept_sampled(verified, drafts, sampling, lambda r: SeededCoins(seed, position + r), draft_probs)


def _until_stop(tokens: list[int], stop: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


# ------------------------------------------------------------------------------- the targets


def kernel_rows_target(module, step: Callable, weights: dict, state: dict, rows: int, seed: int, layers=()):
    """A batch-1 kernel verify step of the generated `module` (`build_decode_step(1, ...,
    verify_rows=rows, context_layers=layers)`, weights in its layout) as a target; `state` in the
    plain layout (as the prefill leaves it), committed by the module's `commit`."""

    def call(state, tokens, positions):
        if rows == 1 and not layers:  # the plain step: tokens and positions [1]
            logits, chosen, new = step(weights, state, tokens.reshape(1), positions.reshape(1), seed)
            return logits[:, None], chosen.reshape(1, 1), new
        return step(weights, state, tokens, positions, seed)

    return RowsTarget(call, _expand(state, module.ROW_STATES, rows), module.commit, rows, layers)


def _expand(state: dict, axes: dict[str, int], rows: int) -> dict:
    """A plain state in the verify layout: each row state's slot repeated R times."""
    import jax.numpy as jnp

    return {k: jnp.repeat(v, rows, axis=axes[k]) if k in axes and rows > 1 else v for k, v in state.items()}


@functools.lru_cache(maxsize=4)
def reference_fns(model, sampling, context_layers: tuple[int, ...] = ()) -> tuple[Callable, Callable]:
    """(the XLA prefill, the reference step) of `model`, jitted once per model and sampling; the
    prefill also returns the prompt's hidden states after `context_layers` when given."""
    from mkdsl.run.prefill import build_prefill
    from mkdsl.run.reference import build_reference

    return build_prefill(model, sampling=sampling, context_layers=context_layers), build_reference(model)


@functools.lru_cache(maxsize=8)
def _verify_reference(model, rows: int, layers: tuple[int, ...]) -> Callable:
    """The jitted reference step: the plain one at R = 1 without layers, else the verify one."""
    from mkdsl.run.reference import build_reference
    from mkdsl.run.rows import build_verify_reference

    return build_reference(model) if rows == 1 and not layers else build_verify_reference(model, rows, layers)


def reference_rows_target(model, weights: dict, state: dict, rows: int, layers: tuple[int, ...] = ()) -> RowsTarget:
    """The unfused reference's step as a target (weights and `state` in the spec's layout, the
    state plain): R = 1 without layers is the plain reference step, else the verify reference."""
    from functools import partial

    from mkdsl.run.rows import commit, verify_state

    ref = _verify_reference(model, rows, tuple(layers))
    if rows == 1 and not layers:

        def call(state, tokens, positions):
            logits, chosen, new = ref(weights, state, tokens.reshape(1), positions.reshape(1))
            return logits[:, None], chosen.reshape(1, 1), new

        return RowsTarget(call, state, lambda s, _: s, 1)
    return RowsTarget(
        lambda s, t, p: ref(weights, s, t, p), verify_state(model, state, rows), partial(commit, model), rows, layers
    )


def zero_state(model, seq_len: int) -> dict:
    """A batch-1 decode state of zeros with caches of `seq_len` tokens (the reference's layout)."""
    from mkdsl.lang.dtypes import numpy_dtype
    from mkdsl.run.random_params import concrete_shape

    sizes = {model.dims[0].name: 1, **{d.name: seq_len for d in model.dims[1:]}}
    return {
        t.name: np.zeros(concrete_shape(t.full_shape, sizes), numpy_dtype(t.type.dtype.numpy)) for t in model.states
    }


def run_decoder(decoder, drafter: Drafter, prompt: list[int], max_tokens: int, stop, on_tokens=None, bucket=1):
    """`mkdsl run --draft` (and `serve --draft`): the decoder's prefill (with the prompt's hidden
    states if the drafter reads some; the prompt padded to a multiple of `bucket`), then
    `speculate` on its R-row verify step. Returns (Speculation, prefill seconds, how the prompt
    went: "XLA" or "kernel steps")."""
    if decoder.batch != 1:
        raise ValueError(f"speculative decoding runs one sequence (batch 1), not {decoder.batch}")
    layers = tuple(drafter.context_layers)
    t0 = time.perf_counter()
    first, context = decoder.prefill_with_context(np.asarray([prompt], np.int32), layers, bucket)
    prefill_s = time.perf_counter() - t0
    target = decoder.verify_target(drafter.rows, layers)
    out = speculate(
        target,
        drafter,
        prompt,
        int(first[0]),
        max_tokens,
        sampling=decoder.sampling,
        seed=decoder.seed,
        stop=stop,
        on_tokens=on_tokens,
        prompt_context=None if context is None else np.asarray(context)[0],
    )
    decoder.state = None  # in the verify layout: a new generation starts from a new decoder
    return out, prefill_s, "XLA" if decoder.prefill_fn is not None else "kernel steps"
