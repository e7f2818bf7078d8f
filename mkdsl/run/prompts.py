"""`mkdsl run`'s prompts, known and checked before the checkpoint loads.

Prompts come from `--prompt` (repeatable) or standard input, one a line. Piped input is read
whole up front, so an empty one, an empty prompt, or a prompt (with `--max-tokens`) longer than
the cache is reported in seconds, not after a minute of loading; only an interactive terminal is
read a line at a time. With `--batch N`, prompts fill the N rows in order (one prompt: every row
the same); each group of N is one generation.
"""

from __future__ import annotations

import contextlib
import signal
import weakref
from collections.abc import Iterator
from dataclasses import dataclass


class PromptError(Exception):
    """A prompt the run cannot take (the CLI's usage error, exit 2)."""


@dataclass(frozen=True)
class Group:
    """One generation: a prompt per row, its token ids, and how many rows are real."""

    texts: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    shown: int  # rows beyond this repeat a prompt to fill the batch and are not printed


def given(prompts: list[str] | None, stdin) -> list[str] | None:
    """The prompts known up front: `--prompt`s, or every non-blank line of piped input; None for
    an interactive terminal (read as the user types)."""
    if prompts is not None:
        for i, p in enumerate(prompts):
            if not p.strip():
                raise PromptError(f"--prompt {i + 1} is empty")
        return prompts
    if stdin.isatty():
        return None
    lines = [line.rstrip("\n") for line in stdin if line.strip()]
    if not lines:
        raise PromptError("no prompt: standard input is empty (give --prompt TEXT, or one prompt per line)")
    return lines


def batch_of(batch: int | None, prompts: list[str] | None, low: int, high: int) -> int:
    """`--batch`, or by default one row per prompt given with `--prompt` (at least `low`, at most `high`)."""
    if batch is not None:
        return batch
    return min(max(len(prompts or ()), low, 1), high)


def groups(texts: list[str], batch: int, encode, fits) -> list[Group]:
    """The prompts in generations of `batch` rows, encoded and checked: `encode(text) -> ids`,
    `fits(longest prompt) -> None` or why it does not fit the cache."""
    out = []
    step = 1 if len(texts) == 1 else batch
    for start in range(0, len(texts), step):
        chunk = texts[start : start + step]
        rows = [chunk[i % len(chunk)] for i in range(batch)]  # one prompt repeated, or a short last group filled
        ids = []
        for text in chunk:
            tokens = tuple(encode(text))
            if not tokens:
                raise PromptError(f"the prompt {text!r} encodes to no tokens")
            ids.append(tokens)
        problem = fits(max(len(t) for t in ids))
        if problem:
            raise PromptError(problem)
        out.append(Group(tuple(rows), tuple(ids[i % len(ids)] for i in range(batch)), 1 if step == 1 else len(chunk)))
    return out


_FINALIZE = weakref.finalize.__call__.__code__


@contextlib.contextmanager
def interrupts_kept() -> Iterator[list[bool]]:
    """Ctrl-C is never lost. Python raises KeyboardInterrupt wherever the signal lands, and one
    landing in a garbage-collector callback or a finaliser (JAX's `_xla_gc_callback` during a
    load, a `__del__`, a `weakref.finalize` callback) is printed as "Exception ignored" and
    dropped, and the run went on. Here the interrupt is recorded; it is raised at once unless it
    lands in such a place, and `check` raises a recorded one at the next safe point (and on
    leaving)."""
    hit: list[bool] = []

    def handler(signum, frame):
        hit.append(True)
        f = frame
        while f is not None:
            code = f.f_code
            if "gc_callback" in code.co_name or code.co_name == "__del__" or code is _FINALIZE:
                return  # raised later, by `check`
            f = f.f_back
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, old)
    check(hit)


def check(hit: list[bool]) -> None:
    """Raise the interrupt `interrupts_kept` recorded and could not raise where it landed."""
    if hit:
        raise KeyboardInterrupt


# A rough rate of TPU interpret mode on a 2-core CPU: SmolLM2-135M from its Q4_1 GGUF (63.3 MiB
# of weights as the kernel keeps them) took 2.18 s per decode step (`mkdsl run --interpret`, 14
# timed steps, 2026-12-06), so about 29 MiB of weights per second. An assumption no measurement
# checks: that the cost scales with the weights' bytes. It scales with the interpreter's
# callbacks (a tile's DMA, loads and stores), so bf16 weights, 4x the bytes in as many tiles of
# 4x the size, are likely over-estimated.
INTERPRET_BYTES_PER_S = 63.3 * 2**20 / 2.18


def emulation_notice(weight_bytes: int, tokens: int, rows: int, verify_rows: int = 1) -> str:
    """The one line `mkdsl run` prints before the load when the kernel runs in interpret mode.
    `verify_rows` > 1: speculative decoding, one step per verify of that many rows of one sequence,
    so the figure for the tokens (a step each) is an upper bound."""
    per_step = weight_bytes / INTERPRET_BYTES_PER_S
    total = per_step * tokens
    when = f"{total / 60:.0f} min" if total >= 120 else f"{total:.0f} s"
    if verify_rows > 1:
        when, shape = f"at most {when}", f"one sequence, {verify_rows} rows a verify step"
    else:
        shape = f"{rows} row{'s' if rows > 1 else ''}"
    return (
        "mkdsl run: no TPU: the kernel runs in TPU interpret mode, an emulation on the CPU; expect roughly "
        f"{per_step:.1f} s per step, {when} for {tokens} tokens ({shape}; "
        "an estimate from a 2-core CPU, plus the first call's trace and compile)"
    )
