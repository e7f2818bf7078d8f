"""Accept rules of speculative decoding: which drafted tokens the target keeps, and its own next
token. They run on the host, between verify steps (numpy, with the target's distribution from
`mkdsl.run.sampling`), because the drafter there needs the accepted tokens before it can
propose the next block; see docs/architecture.md ("Speculative decoding").

A verify step fed the anchor (the last accepted token) and drafts d_1..d_{R-1} at consecutive
positions gives, for each row r, the target's choice after row r's token. The rules read the rows
in order through `Rows` (`next_token(r)`, `logits(r)`) and stop at the first rejected draft.

- Greedy: accept the longest prefix of drafts equal to the target's argmax, then the target's
  own token after it (so the output is plain greedy decoding, token for token).
- Sampling (temperature, top-k, top-p): exact speculative sampling. p' is the target's
  distribution after row r (`target_probs`: plain sampling's, the same mask). Draft d_{r+1} is
  kept with probability min(1, p'(d)/q(d)), q the drafter's distribution (a deterministic drafter
  has q = one-hot(d): probability p'(d)); on rejection the target's token is drawn from
  norm(max(0, p' - q)) (deterministic: p' with d removed, renormalised); after R-1 kept drafts
  it is drawn from the last row's p'. The emitted tokens then follow p' exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Rows(Protocol):
    """One verify step's rows, read in order: the target's token after row r (its argmax when
    greedy) and row r's logits [V]."""

    def next_token(self, r: int) -> int: ...

    def logits(self, r: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Accepted:
    drafts: int  # drafts kept, 0 .. R-1
    tokens: list[int]  # the kept drafts, then the target's own token: drafts + 1 tokens


def accept_greedy(rows: Rows, drafts: list[int]) -> Accepted:
    """The longest prefix of `drafts` equal to the target's tokens, then the target's token."""
    out: list[int] = []
    for r, d in enumerate(drafts):
        t = rows.next_token(r)
        if t != d:
            return Accepted(r, [*out, t])
        out.append(d)
    return Accepted(len(drafts), [*out, rows.next_token(len(drafts))])


@functools.lru_cache(maxsize=8)
def _probs_fn(temperature: float, top_k: int, top_p: float) -> Callable:
    import jax

    from mkdsl.run.sampling import Sampling, sampling_mask

    sampling = Sampling(temperature, top_k, top_p)
    return jax.jit(lambda x: jax.nn.softmax(sampling_mask(x.astype("float32") / temperature, sampling), axis=-1))


def target_probs(logits: np.ndarray, sampling) -> np.ndarray:
    """p' [..., V] (f64): softmax of the logits / temperature with plain sampling's top-k and top-p
    mask (`mkdsl.run.sampling.sampling_mask`), the distribution a plain sampled step draws from."""
    x = np.asarray(logits, np.float32)
    p = np.asarray(
        _probs_fn(float(sampling.temperature), sampling.top_k, float(sampling.top_p))(x.reshape(-1, x.shape[-1]))
    )
    p = p.astype(np.float64).reshape(x.shape)
    return p / p.sum(axis=-1, keepdims=True)


class Coins(Protocol):
    """The random numbers of one row: `u()` in [0, 1) for the accept test, `gumbel(n)` for a draw."""

    def u(self) -> float: ...

    def gumbel(self, n: int) -> np.ndarray: ...


class SeededCoins:
    """Counter-based: row coins from a generator seeded by (seed, position), so a run's draws depend
    on the seed and where they fall, not on what ran before."""

    def __init__(self, seed: int, position: int):
        self.rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(position), 0x5EC])

    def u(self) -> float:
        return float(self.rng.random())

    def gumbel(self, n: int) -> np.ndarray:
        return -np.log(-np.log(self.rng.random(n).clip(1e-300, None)))


def draw(p: np.ndarray, coins: Coins) -> int:
    """A token from the distribution p (Gumbel-max: argmax log p + g)."""
    with np.errstate(divide="ignore"):
        return int(np.argmax(np.log(p) + coins.gumbel(p.shape[-1])))


def accept_sampled(
    rows: Rows,
    drafts: list[int],
    sampling,
    coins: Callable[[int], Coins],
    draft_probs: np.ndarray | None = None,
) -> Accepted:
    """Exact speculative sampling (module docstring). `coins(r)`: row r's random numbers;
    `draft_probs` [R-1, V]: the drafter's distributions q (None: deterministic drafts)."""
    out: list[int] = []
    for r, d in enumerate(drafts):
        p = target_probs(rows.logits(r), sampling)
        q = np.eye(p.shape[-1])[d] if draft_probs is None else np.asarray(draft_probs[r], np.float64)
        c = coins(r)
        ratio = min(1.0, p[d] / q[d]) if q[d] > 0 else 0.0  # a draft its drafter gave no mass: rejected
        if c.u() < ratio:
            out.append(d)
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        return Accepted(r, [*out, draw(residual / total if total > 0 else p, c)])
    last = len(drafts)
    return Accepted(last, [*out, draw(target_probs(rows.logits(last), sampling), coins(last))])
