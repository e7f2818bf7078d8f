"""Parse `.mk` text into an AST of frozen dataclasses that carry source spans.

The grammar lives in `grammar.lark` (LALR). Syntax errors become diagnostics with the
offending token underlined and the tokens that would have been accepted as the hint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lark
from lark import Lark, Transformer_NonRecursive, v_args

from mkdsl.lang.diagnostics import Diagnostic, Span, SpecError, source_lines, visible

# ---------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Expr:
    span: Span


@dataclass(frozen=True)
class Num(Expr):
    value: int | float | bool | str  # str: a quoted word, for attributes such as pairing="half"


@dataclass(frozen=True)
class Name(Expr):
    id: str


@dataclass(frozen=True)
class BinOp(Expr):
    op: str  # + - * / // % ** == != < <= > >= and or
    left: Expr
    right: Expr


@dataclass(frozen=True)
class UnOp(Expr):
    op: str  # - not
    operand: Expr


@dataclass(frozen=True)
class Kwarg:
    span: Span
    name: str
    value: Expr


@dataclass(frozen=True)
class Call(Expr):
    func: str
    func_span: Span
    args: tuple[Expr, ...]
    kwargs: tuple[Kwarg, ...]


# ---------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Assign:
    span: Span
    name: str
    value: Expr


@dataclass(frozen=True)
class ModelDecl:
    span: Span
    name: str


@dataclass(frozen=True)
class ConstDecl:
    span: Span
    name: str
    value: Expr


@dataclass(frozen=True)
class DimDecl:
    """A size bound when the step is built (batch rows, cache length), with its legal range."""

    span: Span
    name: str
    low: Expr
    high: Expr


@dataclass(frozen=True)
class MeshDecl:
    span: Span
    axes: tuple[Assign, ...]


@dataclass(frozen=True)
class ProfileDecl:
    span: Span
    name: str
    overrides: tuple[Assign, ...]


@dataclass(frozen=True)
class HintsDecl:
    span: Span
    hints: tuple[Assign, ...]


@dataclass(frozen=True)
class ShapeDim:
    span: Span
    size: Expr
    axes: tuple[str, ...] = ()  # mesh axes this dimension is split over (their product)
    axis_spans: tuple[Span, ...] = ()


@dataclass(frozen=True)
class TypeExpr:
    span: Span
    dtype: str
    dtype_args: tuple[Assign, ...]
    dims: tuple[ShapeDim, ...]


@dataclass(frozen=True)
class TensorDecl:
    span: Span
    kind: str  # "weight" | "state"
    name: str
    type: TypeExpr
    per_layer: bool
    layer_kinds: tuple[str, ...]  # empty: every layer
    stacking_span: Span | None


@dataclass(frozen=True)
class AssignStmt:
    span: Span
    targets: tuple[str, ...]
    value: Expr


@dataclass(frozen=True)
class ReturnStmt:
    span: Span
    values: tuple[Expr, ...]


Stmt = AssignStmt | ReturnStmt


@dataclass(frozen=True)
class FuncDef:
    """`block`, `layer` or `step`: parameters and straight-line statements."""

    span: Span
    kind: str
    name: str
    params: tuple[str, ...]
    body: tuple[Stmt, ...]
    defaults: tuple[tuple[str, Expr], ...] = ()  # block parameters with a default (constant) value


@dataclass(frozen=True)
class Rule:
    span: Span
    kind: str
    when: Expr | None  # None: otherwise


@dataclass(frozen=True)
class LayersDecl:
    span: Span
    count: Expr
    rules: tuple[Rule, ...]


@dataclass(frozen=True)
class CkptStep:
    """One step of a checkpoint mapping (`| transpose`, `| unpermute(heads=NH)`)."""

    span: Span
    name: str
    args: tuple[Expr, ...]
    kwargs: tuple[Kwarg, ...]


@dataclass(frozen=True)
class CkptEntry:
    """`weight = "pattern" | step ...`: where one weight comes from (several patterns: concatenated;
    `"codes" * "scales"`: a quantised tensor stored as its codes and their scales)."""

    span: Span
    weight: str
    patterns: tuple[str, ...]
    pattern_spans: tuple[Span, ...]
    steps: tuple[CkptStep, ...]
    scales: tuple[str, Span] | None = None
    glob: tuple[str, Span] | None = None  # `"codes" * "scales" * "global"`: NVFP4's per-tensor scale
    # `or` sources after the first: the same weight as another save stores it (a dequantised one)
    alternatives: tuple[CkptEntry, ...] = ()


@dataclass(frozen=True)
class CkptSetting:
    """`field.sub = value` in a checkpoint's `config { ... }`: one config.json field (a list of
    expressions for a list value)."""

    span: Span
    key: tuple[str, ...]
    value: Expr | tuple[Expr, ...] | None  # None: `null`


@dataclass(frozen=True)
class CheckpointDecl:
    span: Span
    format: str
    entries: tuple[CkptEntry, ...]
    settings: tuple[CkptSetting, ...] = ()


@dataclass(frozen=True)
class ContextDecl:
    """`context ctx at ctx_pos from layers 24, 48`: the state `ctx` holds the target's hidden states of
    those layers, `ctx_pos` their positions."""

    span: Span
    name: str
    positions: str
    layers: tuple[Expr, ...]


@dataclass(frozen=True)
class MtpDef:
    """`mtp(h: f32[B, H], tokens, positions) { ... }`: a multi-token prediction head."""

    span: Span
    hidden_type: TypeExpr
    func: FuncDef  # kind "mtp", params (hidden, tokens, positions)


@dataclass(frozen=True)
class Module:
    items: tuple[object, ...]


# ---------------------------------------------------------------------------- parser


def _span(meta) -> Span:
    return Span.of(meta)


@v_args(meta=True)
class _ToAst(Transformer_NonRecursive):
    """Tree -> AST. One method per grammar rule, in grammar order."""

    def start(self, meta, items):
        return Module(tuple(items))

    def model_decl(self, meta, c):
        return ModelDecl(_span(meta), str(c[0]))

    def const_decl(self, meta, c):
        return ConstDecl(Span.of(c[0]), str(c[0]), c[1])

    def dim_decl(self, meta, c):
        return DimDecl(Span.of(c[0]), str(c[0]), c[1], c[2])

    def mesh_decl(self, meta, c):
        return MeshDecl(_span(meta), tuple(c))

    def profile_decl(self, meta, c):
        return ProfileDecl(Span.of(c[0]), str(c[0]), tuple(c[1:]))

    def hints_decl(self, meta, c):
        return HintsDecl(_span(meta), tuple(c))

    def assign(self, meta, c):
        return Assign(Span.of(c[0]), str(c[0]), c[1])

    def checkpoint_decl(self, meta, c):
        entries = tuple(x for x in c[1:] if isinstance(x, CkptEntry))
        settings = tuple(s for x in c[1:] if not isinstance(x, CkptEntry) for s in x)
        return CheckpointDecl(Span.of(c[0]), str(c[0]), entries, settings)

    def ckpt_config(self, meta, c):
        return tuple(c)

    def ckpt_setting(self, meta, c):
        return CkptSetting(Span.of(c[0]), tuple(str(c[0]).split(".")), c[1])

    def ckpt_null(self, meta, c):
        return None

    def ckpt_list(self, meta, c):
        return tuple(x for x in c if x is not None)

    def context_decl(self, meta, c):
        return ContextDecl(Span.of(c[0]), str(c[0]), str(c[1]), tuple(c[2:]))

    def ckpt_entry(self, meta, c):
        first, *others = (CkptEntry(Span.of(c[0]), str(c[0]), *alt) for alt in c[1:])
        return dataclasses.replace(first, alternatives=tuple(others))

    def ckpt_alt(self, meta, c):
        """(patterns, their spans, steps, scales, global scale) of one source."""
        strings, rest = c[0], list(c[1:])
        scaled = rest.pop(0) if rest and isinstance(rest[0], tuple) else ()
        scales, glob = (scaled[0] if scaled else None), (scaled[1] if len(scaled) > 1 else None)
        return tuple(str(t)[1:-1] for t in strings), tuple(map(Span.of, strings)), tuple(rest), scales, glob

    def ckpt_scales(self, meta, c):
        return tuple((str(t)[1:-1], Span.of(t)) for t in c)

    def ckpt_source(self, meta, c):
        return tuple(c)

    def ckpt_step(self, meta, c):
        args = (c[1] if len(c) > 1 else None) or ()  # `| transpose` has no argument list
        pos = tuple(a for a in args if not isinstance(a, Kwarg))
        return CkptStep(Span.of(c[0]), str(c[0]), pos, tuple(a for a in args if isinstance(a, Kwarg)))

    def tensor_kind(self, meta, c):
        return str(c[0])

    def tensor_decl(self, meta, c):
        kind, name, ttype = c[0], c[1], c[2]
        per_layer, kinds, sspan = False, (), None
        if len(c) > 3:
            per_layer, kinds, sspan = True, c[3][0], c[3][1]
        return TensorDecl(Span.of(name), kind, str(name), ttype, per_layer, kinds, sspan)

    def ttype(self, meta, c):
        name = c[0]
        args = c[1] if len(c) == 3 else ()
        return TypeExpr(Span.of(name), str(name), tuple(args), tuple(c[-1]))

    def dtype_args(self, meta, c):
        return tuple(c)

    def dim_list(self, meta, c):
        return tuple(c)

    def sdim(self, meta, c):
        axes = c[1:]  # NAME tokens after `@`: one, or a parenthesised list
        return ShapeDim(_span(meta), c[0], tuple(str(a) for a in axes), tuple(Span.of(a) for a in axes))

    def stacking(self, meta, c):
        return (tuple(c[0]) if c else (), _span(meta))

    def name_list(self, meta, c):
        return tuple(str(t) for t in c)

    def _func(self, kind, meta, c):
        if kind == "step":
            params, body = c[0], c[1:]
            span = Span(meta.line, meta.column, len("step"))  # the keyword: the body spans lines
            return FuncDef(span, "step", "step", tuple(params or ()), tuple(body))
        name, params, body = c[0], c[1], c[2:]
        return FuncDef(Span.of(name), kind, str(name), tuple(params or ()), tuple(body))

    def block_def(self, meta, c):
        params = c[1] or ()
        f = self._func("block", meta, [c[0], tuple(p for p, _ in params), *c[2:]])
        return FuncDef(f.span, f.kind, f.name, f.params, f.body, tuple((p, d) for p, d in params if d is not None))

    def param_list(self, meta, c):
        return tuple(c)

    def param(self, meta, c):
        return (str(c[0]), c[1])

    def layer_def(self, meta, c):
        return self._func("layer", meta, c)

    def step_def(self, meta, c):
        return self._func("step", meta, c)

    def mtp_def(self, meta, c):
        span = Span(meta.line, meta.column, len("mtp"))
        names = (str(c[0]), str(c[2]), str(c[3]))
        return MtpDef(span, c[1], FuncDef(span, "mtp", "mtp", names, tuple(c[4:])))

    def layers_decl(self, meta, c):
        return LayersDecl(_span(meta), c[0], tuple(c[1:]))

    def rule_when(self, meta, c):
        return Rule(Span.of(c[0]), str(c[0]), c[1])

    def rule_otherwise(self, meta, c):
        return Rule(Span.of(c[0]), str(c[0]), None)

    def assign_stmt(self, meta, c):
        return AssignStmt(_span(meta), tuple(c[0]), c[1])

    def return_stmt(self, meta, c):
        return ReturnStmt(_span(meta), tuple(c))

    def _fold(self, meta, c, op):
        out = c[0]
        for right in c[1:]:
            out = BinOp(_span(meta), op, out, right)
        return out

    def or_expr(self, meta, c):
        return self._fold(meta, c, "or")

    def and_expr(self, meta, c):
        return self._fold(meta, c, "and")

    def not_(self, meta, c):
        return UnOp(_span(meta), "not", c[0])

    def cmp_expr(self, meta, c):
        return BinOp(_span(meta), str(c[1]), c[0], c[2])

    def binop(self, meta, c):
        return BinOp(Span.of(c[1]), str(c[1]), c[0], c[2])

    def neg(self, meta, c):
        return UnOp(_span(meta), "-", c[0])

    def power(self, meta, c):
        return BinOp(_span(meta), "**", c[0], c[1])

    def int_lit(self, meta, c):
        try:
            return Num(Span.of(c[0]), int(c[0]))
        except ValueError:  # more digits than Python converts
            raise SpecError([Diagnostic(Span.of(c[0]), f"integer literal of {len(c[0])} digits is too long")]) from None

    def float_lit(self, meta, c):
        return Num(Span.of(c[0]), float(c[0]))

    def str_lit(self, meta, c):
        return Num(Span.of(c[0]), str(c[0])[1:-1])

    def true_lit(self, meta, c):
        return Num(_span(meta), True)

    def false_lit(self, meta, c):
        return Num(_span(meta), False)

    def name_ref(self, meta, c):
        return Name(Span.of(c[0]), str(c[0]))

    def call(self, meta, c):
        name, args = c[0], c[1] or ()
        pos = tuple(a for a in args if not isinstance(a, Kwarg))
        kws = tuple(a for a in args if isinstance(a, Kwarg))
        return Call(_span(meta), str(name), Span.of(name), pos, kws)

    def args(self, meta, c):
        return tuple(c)

    def kwarg(self, meta, c):
        return Kwarg(Span.of(c[0]), str(c[0]), c[1])


@cache
def _parser() -> Lark:
    grammar = (Path(__file__).parent / "grammar.lark").read_text()
    # cache=True keeps the built LALR tables in the temp dir (keyed by grammar hash): fast start-up
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True, cache=True)


# Human names for terminals in "expected ..." hints.
_TERMINAL_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "COMMA": "`,`",
    "COLON": "`:`",
    "EQUAL": "`=`",
    "STRING": "a string",
    "$END": "end of file",
}


# Terminals that can start an expression; named together as "an expression" in hints.
_EXPRESSION_START = {"NAME", "INT", "FLOAT", "STRING", "LPAR", "MINUS", "NOT", "TRUE", "FALSE"}


def _describe(terminals) -> str:
    terminals = set(terminals)
    names = set()
    if {"NAME", "INT", "LPAR"} <= terminals:
        terminals -= _EXPRESSION_START
        names.add("an expression")
    names = sorted(names | {_TERMINAL_NAMES.get(t, f"`{_literal(t)}`") for t in terminals})
    return ", ".join(names[:6]) + (" or more" if len(names) > 6 else "")


def _literal(term: str) -> str:
    try:
        pattern = _parser().get_terminal(term).pattern
        return pattern.value if pattern.type == "str" else term.lower()
    except KeyError:
        return term.lower()


def parse(source: str) -> Module:
    """Parse spec text; raise `SpecError` with one diagnostic for the first syntax error."""
    try:
        tree = _parser().parse(source)
    except lark.exceptions.UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            lines = source_lines(source.rstrip("\n")) if source.strip() else [""]
            span = Span(len(lines), len(lines[-1]) + 1, 1)
            msg = "unexpected end of file"
        else:
            span = Span(tok.line, tok.column, max(1, len(str(tok))))
            text = str(tok)
            msg = f"unexpected `{text}`" if len(text) <= 40 else f"unexpected `{text[:20]}...` ({len(text)} characters)"
        raise SpecError([Diagnostic(span, msg, f"expected {_describe(e.expected)}")]) from None
    except lark.exceptions.UnexpectedCharacters as e:
        span = Span(e.line, e.column, 1)
        shown = f"`{e.char}`" if e.char.isprintable() else f"U+{ord(e.char):04X} ({visible(e.char)})"
        raise SpecError([Diagnostic(span, f"unexpected character {shown}")]) from None
    try:
        return _ToAst().transform(tree)  # not recursive: any nesting depth parses
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, SpecError):
            raise e.orig_exc from None
        raise
