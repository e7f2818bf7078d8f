"""Speculative decoding's loop, on the host: the drafter proposes R-1 tokens after the anchor,
the target verifies the R rows in one step, the accept rule (mkdsl/run/accept.py) keeps a
prefix of the drafts and adds the target's own token, the step is committed at that length, and
the drafter hears what was kept. One sequence (batch 1).

`speculate` drives any target with `verify(tokens, position) -> rows` (rows with `next_token`,
`logits`, `commit`): mkdsl/run/verify_rows.py's row-by-row emulation today, the R-row kernel
step when it lands. With R = 1 (no drafts) it is plain decoding.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mkdsl.run.accept import Accepted, SeededCoins, accept_greedy, accept_sampled
from mkdsl.run.drafters import Drafter
from mkdsl.run.verify_rows import RowByRow


@dataclass
class Speculation:
    """What a speculative generation made and how: per verify step, the tokens it accepted
    (kept drafts + 1) and its seconds."""

    tokens: list[int]
    rows: int  # R
    steps: list[tuple[int, float]] = field(default_factory=list)
    rows_run: int = 0  # one-row steps the target ran (the row-by-row emulation), 0 if not counted

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
        emulated = (
            f"; the target ran {self.rows_run} one-row steps (R rows emulated row by row)" if self.rows_run else ""
        )
        return (
            f"speculative ({drafter}, {self.rows} rows per verify step): {len(self.steps)} verify steps, "
            f"mean accepted {self.mean_accepted:.2f} tokens/step; {1000 * secs / len(timed):.1f} ms/step, "
            f"{made / secs:.2f} accepted tokens/s ({len(timed)} timed steps{note}){emulated}"
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
) -> Speculation:
    """Generate after `prompt` (already prefilled) and its sampled token `first`, until a token in
    `stop` (kept) or `max_tokens` tokens in all; `on_tokens` sees each step's new tokens."""
    rows = drafter.rows
    out = Speculation([int(first)], rows)
    if on_tokens:
        on_tokens([int(first)])
    drafter.start(list(prompt), None)
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
        drafter.accept(got.tokens, None)
        new = _until_stop(got.tokens[: max_tokens - len(out.tokens)], stop)
        out.tokens += new
        if on_tokens:
            on_tokens(new)
        anchor, position = got.tokens[-1], position + got.drafts + 1
        if len(new) < len(got.tokens):
            break
    out.rows_run = getattr(target, "rows_run", 0)
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


def kernel_target(decoder) -> RowByRow:
    """The kernel's one-row step of a `mkdsl.run.decode.Decoder` (batch 1, its state), row by row."""
    if decoder.batch != 1:
        raise ValueError(f"speculative decoding runs one sequence (batch 1), not {decoder.batch}")
    return kernel_step_target(decoder.step(1), decoder.weights, decoder.state, decoder.seed)


def kernel_step_target(step: Callable, weights: dict, state: dict, seed: int) -> RowByRow:
    """A batch-1 kernel step (`build_step`'s, weights in its layout) as a target, row by row."""

    def step1(state, tokens, positions):
        return step(weights, state, tokens, positions, seed)

    return RowByRow(step1, state, copies=True)


@functools.lru_cache(maxsize=4)
def reference_fns(model, sampling) -> tuple[Callable, Callable]:
    """(the XLA prefill, the reference step) of `model`, jitted once per model and sampling."""
    from mkdsl.run.prefill import build_prefill
    from mkdsl.run.reference import build_reference

    return build_prefill(model, sampling=sampling), build_reference(model)


def reference_target(model, weights: dict, state: dict) -> RowByRow:
    """The unfused reference's step (jitted, weights in the spec's layout), row by row."""
    from mkdsl.run.sampling import Sampling

    ref = reference_fns(model, Sampling())[1]
    return RowByRow(lambda state, tokens, positions: ref(weights, state, tokens, positions), state, copies=False)


def zero_state(model, seq_len: int) -> dict:
    """A batch-1 decode state of zeros with caches of `seq_len` tokens (the reference's layout)."""
    from mkdsl.lang.dtypes import numpy_dtype
    from mkdsl.run.random_params import concrete_shape

    sizes = {model.dims[0].name: 1, **{d.name: seq_len for d in model.dims[1:]}}
    return {
        t.name: np.zeros(concrete_shape(t.full_shape, sizes), numpy_dtype(t.type.dtype.numpy)) for t in model.states
    }


def run_decoder(decoder, drafter: Drafter, prompt: list[int], max_tokens: int, stop, on_tokens=None):
    """`mkdsl run --draft`: the decoder's prefill, then `speculate` on its kernel, row by row.
    Returns (Speculation, prefill seconds, how the prompt went: "XLA" or "kernel steps")."""
    t0 = time.perf_counter()
    first = int(decoder.prefill(np.asarray([prompt], np.int32))[0])
    prefill_s = time.perf_counter() - t0
    target = kernel_target(decoder)
    out = speculate(
        target,
        drafter,
        prompt,
        first,
        max_tokens,
        sampling=decoder.sampling,
        seed=decoder.seed,
        stop=stop,
        on_tokens=on_tokens,
    )
    decoder.state = target.state
    return out, prefill_s, "XLA" if decoder.prefill_fn is not None else "kernel steps"
