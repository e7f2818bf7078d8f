"""Compiler diagnostics: a span in the source, a message, the line and a caret.

Every stage reports problems as `Diagnostic`s collected in a `Reporter`, so a run shows all
independent errors at once; `SpecError` carries them out of the pipeline to the CLI.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
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

    def render(self, path: str, source: str) -> str:
        """`path:line:col: error: message`, then the source line with a caret and a hint."""
        lines = source.splitlines()
        out = [f"{path}:{self.span.line}:{self.span.column}: {self.severity}: {self.message}"]
        if 1 <= self.span.line <= len(lines):
            text = lines[self.span.line - 1].rstrip()
            gutter = f"{self.span.line:>5} | "
            out.append(gutter + text)
            room = max(1, len(text) - self.span.column + 1)
            pad = "".join(c if c == "\t" else " " for c in text[: self.span.column - 1])  # tabs line up
            out.append(" " * len(gutter) + pad + "^" * max(1, min(self.span.width, room)))
        if self.hint:
            out.append(f"      = hint: {self.hint}")
        return "\n".join(out)


class SpecError(Exception):
    """One or more diagnostics about a spec; raised once a stage has collected them all."""

    def __init__(self, diagnostics: Iterable[Diagnostic]):
        self.diagnostics = tuple(sorted(diagnostics, key=lambda d: (d.span.line, d.span.column)))
        super().__init__("\n".join(d.message for d in self.diagnostics))

    def render(self, path: str, source: str) -> str:
        body = "\n".join(d.render(path, source) for d in self.diagnostics)
        n = len(self.diagnostics)
        return f"{body}\n{n} error{'s' if n != 1 else ''} in {path}"


@dataclass
class Reporter:
    """Collects diagnostics; `check()` raises them together at the end of a stage."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def error(self, span: Span, message: str, hint: str | None = None) -> None:
        d = Diagnostic(span, message, hint)
        if d not in self.diagnostics:
            self.diagnostics.append(d)

    def check(self) -> None:
        if self.diagnostics:
            raise SpecError(self.diagnostics)


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """A hint naming the closest known spelling, if one is close enough."""
    best = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"did you mean `{best[0]}`?" if best else None
