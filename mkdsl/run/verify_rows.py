"""The target's verify step of R rows of one sequence, emulated by the one-row step.

Issue #22's verify step (`step(weights, state, tokens[B, R], positions[B, R])` and
`commit(state, accepted)`) runs R rows in one kernel call. Until it lands, `RowByRow` gives the
speculative loop the same thing from the plain step (the kernel's or the reference's): row r is
the one-row step fed token r at position + r on the state row r-1 left, and committing `k` rows
keeps the state after row k-1. That is exact by construction (each row is a plain decode step).
Rows are computed when the accept rule first reads them, so a step stops at the first rejected
draft: the emulation runs as many rows as plain decoding would (its timings say nothing about an
R-row step). The state each row leaves is kept until the commit picks one (the kernel donates
its input state, so each row runs on a copy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# step1(state, tokens i32 [1], positions i32 [1]) -> (logits [1, V], next_tokens [1], new_state)
OneRowStep = Callable[[dict, np.ndarray, np.ndarray], tuple]


class RowByRow:
    """A verify target for one sequence from a one-row step and its state."""

    context_layers: tuple[int, ...] = ()  # the one-row step exposes no hidden states

    def __init__(self, step1: OneRowStep, state: dict, *, copies: bool = True):
        self.step1, self.state, self.copies = step1, state, copies
        self.rows_run = 0  # one-row steps run so far

    def verify(self, tokens: list[int], position: int) -> _Rows:
        return _Rows(self, [int(t) for t in tokens], position)


class _Rows:
    """One verify step's rows, computed on first read; `commit(k)` keeps rows 0..k-1."""

    def __init__(self, owner: RowByRow, tokens: list[int], position: int):
        self.owner, self.tokens, self.position = owner, tokens, position
        self.states = [owner.state]  # states[r]: the state before row r
        self.out: list[tuple[np.ndarray, int]] = []

    def _row(self, r: int) -> tuple[np.ndarray, int]:
        if not 0 <= r < len(self.tokens):
            raise IndexError(f"row {r} of a {len(self.tokens)}-row verify step")
        while len(self.out) <= r:
            i = len(self.out)
            state = self.states[i]
            if self.owner.copies:  # the kernel donates its state: keep ours for a commit
                state = {k: v.copy() for k, v in state.items()}
            token, pos = np.array([self.tokens[i]], np.int32), np.array([self.position + i], np.int32)
            logits, chosen, new = self.owner.step1(state, token, pos)
            self.owner.rows_run += 1
            self.out.append((np.asarray(logits)[0], int(np.asarray(chosen).reshape(-1)[0])))
            self.states.append(new)
        return self.out[r]

    def next_token(self, r: int) -> int:
        return self._row(r)[1]

    def logits(self, r: int) -> np.ndarray:
        return self._row(r)[0]

    def commit(self, kept: int) -> None:
        """Keep rows 0..kept-1 (the anchor and kept-1 drafts): the state after row kept-1."""
        if not 1 <= kept <= len(self.out):
            raise ValueError(f"commit({kept}) of a step with {len(self.out)} rows computed")
        self.owner.state = self.states[kept]
        self.states = []
