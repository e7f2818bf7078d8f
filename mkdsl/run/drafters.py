"""Drafters of speculative decoding: the `Drafter` protocol the loop (mkdsl/run/speculative.py)
drives, and the model-free n-gram drafter. Model drafters (MTP heads in a target spec, a draft
spec) implement the same protocol; docs/python-api.md documents it.

One sequence, in the loop's order: `start(prompt, context)` once after the prefill; then per
verify step `propose(anchor, position)` -> R-1 drafted tokens for positions position+1.., and,
after the target's verdict, `accept(tokens, context)`: the kept drafts and the target's own
token (the next anchor), with the target's hidden states of the accepted rows (the anchor and
the kept drafts), [rows, len(context_layers), H], or None when `context_layers` is ().
A drafter that samples its drafts sets `draft_probs` [R-1, V] (its distributions q) after each
`propose`; a deterministic one leaves it None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Drafter(Protocol):
    rows: int  # R: rows the target verifies per step, the anchor and R-1 drafts
    context_layers: tuple[int, ...]  # target layers whose hidden states it reads; () for none

    def start(self, prompt_tokens: list[int], context: np.ndarray | None) -> None: ...

    def propose(self, anchor_token: int, position: int) -> list[int]: ...

    def accept(self, tokens: list[int], context: np.ndarray | None) -> None: ...


class DrafterUnavailable(ValueError):
    """A drafter this build of mkdsl cannot run yet (the CLI reports it as a usage error)."""


class NgramDrafter:
    """Prompt-lookup drafting from the sequence's own tokens, no model: the longest suffix of the
    sequence (up to `max_n` tokens, at least `min_n`) that occurred before, its latest earlier
    occurrence, and the tokens that followed it, copied as LZ77 copies (a copy may run into what
    it copies, so a repeating pattern continues). No match: the anchor repeated (cheap, and then
    rejected unless the text repeats)."""

    context_layers: tuple[int, ...] = ()
    draft_probs = None

    def __init__(self, rows: int, max_n: int = 3, min_n: int = 1):
        if rows < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafter: rows >= 1 and 1 <= min_n <= max_n, got {rows}, {min_n}, {max_n}")
        self.rows, self.max_n, self.min_n = rows, max_n, min_n
        self.seq: list[int] = []
        self._anchor: int | None = None

    def start(self, prompt_tokens: list[int], context: np.ndarray | None = None) -> None:
        self.seq, self._anchor = [int(t) for t in prompt_tokens], None

    def propose(self, anchor_token: int, position: int) -> list[int]:
        self._anchor = int(anchor_token)
        seq = [*self.seq, self._anchor]
        start = self._match(np.asarray(seq, np.int64))
        want = self.rows - 1
        if start is None:
            return [self._anchor] * want
        out = list(seq)
        for i in range(want):
            out.append(out[start + i])
        return out[len(seq) :]

    def _match(self, seq: np.ndarray) -> int | None:
        """Where the copy starts: just after the latest earlier occurrence of the longest suffix."""
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            suffix = seq[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # occurrences ending before the last token
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                return int(hits[-1]) + n
        return None

    def accept(self, tokens: list[int], context: np.ndarray | None = None) -> None:
        if self._anchor is None:
            raise RuntimeError("accept() before propose()")
        self.seq += [self._anchor, *(int(t) for t in tokens[:-1])]  # the last token is the next anchor
        self._anchor = None


DRAFTERS = ("ngram", "mtp", "DRAFT.mk")


def check_draft(name: str) -> None:
    """Raise DrafterUnavailable unless `name` names a drafter this build runs (before any loading)."""
    if name == "ngram":
        return
    if name == "mtp" or Path(name).suffix == ".mk":
        what = "MTP heads" if name == "mtp" else f"the draft spec {name}"
        raise DrafterUnavailable(
            f"--draft {name}: {what} as a drafter is not available yet (model drafters come with "
            "issue #22's drafter specs); --draft ngram works today"
        )
    raise DrafterUnavailable(f"--draft {name}: expected one of ngram, mtp or a draft spec (a .mk file)")


def make_drafter(name: str, rows: int) -> Drafter:
    """The drafter `name` (ngram, mtp or a draft spec's path) for R = `rows`."""
    check_draft(name)
    return NgramDrafter(rows)
