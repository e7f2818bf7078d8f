"""Compiler diagnostics: a span in the source, a message, the line and a caret.

Every stage reports problems as `Diagnostic`s collected in a `Reporter`, so a run shows all
independent errors at once; `SpecError` carries them out of the pipeline to the CLI.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """1-based line and column of the first character, and the width of the caret run."""

    line: int
    column: int
    width: int = 1

    @staticmethod
    def of(meta_or_token) -> Span:
        """Span of a lark Token or a tree's `meta` (needs `propagate_positions`)."""
        line = getattr(meta_or_token, "line", None) or 1
        col = getattr(meta_or_token, "column", None) or 1
        end_line = getattr(meta_or_token, "end_line", line)
        end_col = getattr(meta_or_token, "end_column", col + 1)
        width = end_col - col if end_line == line and end_col and end_col > col else 1
        return Span(line, col, width)


NOWHERE = Span(1, 1, 1)


@dataclass(frozen=True)
class Diagnostic:
    span: Span
    message: str
    hint: str | None = None
    severity: str = "error"

    def render(self, path: str, source: str | list[str]) -> str:
        """`path:line:col: error: message`, then the source line with a caret and a hint.

        `source` is the text or its `source_lines`; lines are counted at `\n` only, as the
        parser counts them (a form feed or U+2028 does not start a line).
        """
        lines = source_lines(source) if isinstance(source, str) else source
        out = [f"{path}:{self.span.line}:{self.span.column}: {self.severity}: {self.message}"]
        if 1 <= self.span.line <= len(lines):
            text, column = _window(lines[self.span.line - 1].rstrip(), self.span.column)
            gutter = f"{self.span.line:>5} | "
            out.append(gutter + text)
            room = max(1, len(text) - column + 1)
            pad = "".join(c if c == "\t" else " " for c in text[: column - 1])  # tabs line up
            out.append(" " * len(gutter) + pad + "^" * max(1, min(self.span.width, room)))
        if self.hint:
            out.append(f"      = hint: {self.hint}")
        return "\n".join(out)


SHOWN_COLUMNS = 160  # a longer source line is shown as a window around the caret


def source_lines(source: str) -> list[str]:
    """The lines of a spec as the parser numbers them (split at `\n` only)."""
    return [line.removesuffix("\r") for line in source.split("\n")]


def _window(text: str, column: int) -> tuple[str, int]:
    """The part of a line shown (at most SHOWN_COLUMNS around `column`) with control
    characters made visible, one column each, and the caret's column within it."""
    if len(text) > SHOWN_COLUMNS:
        start = max(0, min(column - 1 - SHOWN_COLUMNS // 2, len(text) - SHOWN_COLUMNS))
        head, tail = ("..." if start else ""), ("..." if start + SHOWN_COLUMNS < len(text) else "")
        column = column - start + len(head)
        text = head + text[start : start + SHOWN_COLUMNS] + tail
    return "".join(visible(c) for c in text), column


def visible(c: str) -> str:
    """A character as one printable column: control characters as their Unicode pictures."""
    if c == "\t" or c.isprintable():
        return c
    if ord(c) < 0x20:
        return chr(0x2400 + ord(c))  # U+240C for a form feed, ...
    return {"\x7f": "\u2421", "\x85": "\u2424", "\u2028": "\u2424", "\u2029": "\u2424"}.get(c, "\ufffd")


class SpecError(Exception):
    """One or more diagnostics about a spec; raised once a stage has collected them all.

    `more` counts further errors that were found but not kept (see `Reporter`)."""

    def __init__(self, diagnostics: Iterable[Diagnostic], more: int = 0):
        self.diagnostics = tuple(sorted(diagnostics, key=lambda d: (d.span.line, d.span.column)))
        self.more = more
        super().__init__("\n".join(d.message for d in self.diagnostics))

    def render(self, path: str, source: str) -> str:
        lines = source_lines(source)  # once: rendering many errors stays linear
        body = "\n".join(d.render(path, lines) for d in self.diagnostics)
        n = len(self.diagnostics)
        if self.more:
            return f"{body}\n{n + self.more} errors in {path} (the first {n} found are shown)"
        return f"{body}\n{n} error{'s' if n != 1 else ''} in {path}"


MAX_KEPT = 200  # errors a run reports in full; the rest are counted (nobody reads 20,000)


@dataclass
class Reporter:
    """Collects diagnostics; `check()` raises them together at the end of a stage.

    A hint may be given as a function, called only for an error that is kept: finding a
    close spelling costs time in the number of names, so it is not paid for dropped errors."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    dropped: int = 0
    _seen: set[tuple[Span, str]] = field(default_factory=set, repr=False)  # constant-time duplicate check

    def error(self, span: Span, message: str, hint: str | Callable[[], str | None] | None = None) -> None:
        if (span, message) in self._seen:
            return
        self._seen.add((span, message))
        if len(self.diagnostics) >= MAX_KEPT:
            self.dropped += 1
            return
        self.diagnostics.append(Diagnostic(span, message, hint() if callable(hint) else hint))

    def check(self) -> None:
        if self.diagnostics:
            raise SpecError(self.diagnostics, self.dropped)


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A hint naming the closest known spelling, if one is close enough."""
    best = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"did you mean `{best[0]}`?" if best else None
