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
    """An unknown drafter name (the CLI reports it as a usage error)."""


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
        self.start([])

    def start(self, prompt_tokens: list[int], context: np.ndarray | None = None) -> None:
        self._buf, self._len, self._anchor = np.zeros(max(64, 2 * len(prompt_tokens)), np.int64), 0, None
        self._extend([int(t) for t in prompt_tokens])

    @property
    def seq(self) -> list[int]:
        """The sequence so far (without the pending anchor)."""
        return [int(t) for t in self._buf[: self._len]]

    def _extend(self, tokens: list[int]) -> None:
        if self._len + len(tokens) > self._buf.size:  # amortised growth
            self._buf = np.concatenate([self._buf, np.zeros(self._buf.size + len(tokens), np.int64)])
        self._buf[self._len : self._len + len(tokens)] = tokens
        self._len += len(tokens)

    def propose(self, anchor_token: int, position: int) -> list[int]:
        self._anchor = int(anchor_token)
        self._extend([self._anchor])  # the anchor, for the search; taken back below
        seq = self._buf[: self._len]
        self._len -= 1
        start = self._match(seq)
        if start is None:
            return [self._anchor] * (self.rows - 1)
        out = seq[start : start + self.rows - 1].tolist()  # the copy, then where it runs into itself
        period = len(seq) - start
        for i in range(len(out), self.rows - 1):
            out.append(out[i - period])
        return out

    def _match(self, seq: np.ndarray) -> int | None:
        """Where the copy starts: just after the latest earlier occurrence of the longest suffix
        (of min_n .. max_n tokens). One vector compare finds where the last token occurred
        before; the longer suffixes only check those places."""
        last = len(seq) - 1
        ends = np.flatnonzero(seq[:last] == seq[last])
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            ok = ends[ends >= n - 1]
            for j in range(1, n):
                ok = ok[seq[ok - j] == seq[last - j]]
            if ok.size:
                return int(ok[-1]) + 1
        return None

    def accept(self, tokens: list[int], context: np.ndarray | None = None) -> None:
        if self._anchor is None:
            raise RuntimeError("accept() before propose()")
        self._extend([self._anchor, *(int(t) for t in tokens[:-1])])  # the last token is the next anchor
        self._anchor = None


def check_draft(name: str) -> None:
    """Raise DrafterUnavailable unless `name` names a drafter kind: ngram, mtp or a draft spec's
    path (a .mk file); what it pairs with is checked by `make_drafter` (before any weights)."""
    if name in ("ngram", "mtp") or Path(name).suffix == ".mk":
        return
    raise DrafterUnavailable(f"--draft {name}: expected one of ngram, mtp or a draft spec (a .mk file)")


def make_drafter(
    name, rows: int, target_spec=None, weights: dict | None = None, *, seed: int = 0, seq_len: int | None = None
) -> Drafter:
    """The drafter `name` for R = `rows`: "ngram"; "mtp" (the target spec's `mtp` head, `weights`
    its weights in the spec's layout: the target's); or a loaded draft spec (`mkdsl.api.load`),
    paired with `target_spec` (its context layers, width and vocabulary), `weights` in its layout
    (default: random, seeded). `seq_len`: the MTP head's cache length. Raises DrafterUnavailable
    for an unknown name, mkdsl.run.spec_drafters.DraftSpecError for a drafter that does not pair."""
    if isinstance(name, str):
        check_draft(name)
    if name == "ngram":
        return NgramDrafter(rows)
    if isinstance(name, str) and name != "mtp":
        raise DrafterUnavailable(f"--draft {name}: a draft spec is given loaded (mkdsl.api.make_drafter loads a path)")
    from mkdsl.run.spec_drafters import make_drafter as make_model_drafter

    return make_model_drafter(name, target_spec, weights, rows, seed=seed, seq_len=seq_len)
