"""The target of speculative decoding: one verify step of R rows of one sequence per call.

`RowsTarget` wraps an R-row step (the kernel's `build_decode_step(..., verify_rows=R)` or the
verify reference of mkdsl/run/rows.py), its state in the verify layout and its `commit`. Each
`verify(tokens, position)` is ONE call of that step over the anchor and the R - 1 drafts at
positions position .. position + R - 1; the accept rule then reads its rows, and `commit(k)`
keeps the state as if rows 0..k-1 alone had been decoded (recurrent slots selected, caches
masked by position: mkdsl/run/rows.py). `calls` counts the step's calls (one per verify step).
With context layers the step also gives the hidden states a drafter reads; `context(k)` is
those of the k accepted rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# step(state, tokens i32 [1, R], positions i32 [1, R]) -> (logits [1, R, V], next_tokens [1, R],
# new_state[, context f32 [1, R, len(context_layers), H]])
RowsStep = Callable[[dict, np.ndarray, np.ndarray], tuple]
# commit(state, accepted i32 [1]) -> state
Commit = Callable[[dict, np.ndarray], dict]


class RowsTarget:
    """A verify target for one sequence: an R-row step, its state (verify layout) and commit."""

    def __init__(self, step: RowsStep, state: dict, commit: Commit, rows: int, context_layers: tuple[int, ...] = ()):
        self.step, self.state, self._commit, self.rows = step, state, commit, rows
        self.context_layers = tuple(context_layers)
        self.calls = 0  # R-row steps run so far

    def verify(self, tokens: list[int], position: int) -> Verified:
        if len(tokens) != self.rows:
            raise ValueError(f"{len(tokens)} tokens for a {self.rows}-row verify step")
        toks = np.asarray([tokens], np.int32)
        positions = (position + np.arange(self.rows, dtype=np.int32))[None]
        out = self.step(self.state, toks, positions)
        self.calls += 1
        self.state = None  # the step may donate it: only a commit gives the next one
        return Verified(self, out)


class Verified:
    """One verify step's outputs: the rows the accept rule reads, and `commit(k)`."""

    def __init__(self, owner: RowsTarget, out: tuple):
        self.owner = owner
        rows = owner.rows
        self._logits = np.asarray(out[0], np.float32).reshape(rows, -1)
        self._next = np.asarray(out[1]).reshape(rows)
        self._state = out[2]
        self._context = np.asarray(out[3]).reshape(rows, len(owner.context_layers), -1) if len(out) > 3 else None

    def next_token(self, r: int) -> int:
        return int(self._next[r])

    def logits(self, r: int) -> np.ndarray:
        return self._logits[r]

    def context(self, kept: int) -> np.ndarray | None:
        """The hidden states [kept, len(context_layers), H] of rows 0..kept-1 (None: no layers)."""
        return None if self._context is None else self._context[:kept]

    def commit(self, kept: int) -> None:
        """Keep rows 0..kept-1 (the anchor and kept-1 drafts)."""
        if not 1 <= kept <= self.owner.rows:
            raise ValueError(f"commit({kept}) of a {self.owner.rows}-row step")
        self.owner.state = self.owner._commit(self._state, np.array([kept], np.int32))
        self._state = None
