"""Constant folding: evaluate constant expressions with profiles applied and cycles caught."""

from __future__ import annotations

import operator

from mkdsl.diagnostics import Reporter, Span, did_you_mean
from mkdsl.syntax import BinOp, Call, ConstDecl, Expr, Name, Num, UnOp

Scalar = int | float | bool

_ARITH = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}
_MAX_BITS = 1 << 16  # integer results of `**` beyond this are mistakes, and slow to compute
_CMP = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


class ConstEnv:
    """Lazily evaluates named constants (`const` declarations, possibly overridden).

    Errors are reported once and the failing constant evaluates to None, so one bad constant
    does not produce a cascade of follow-on errors.
    """

    def __init__(self, decls: dict[str, ConstDecl], overrides: dict[str, Expr], rep: Reporter, dims=()):
        self.decls, self.overrides, self.rep = decls, overrides, rep
        self.dims = frozenset(dims)  # sizes known only when the step is built: never constant
        self.values: dict[str, Scalar | None] = {}
        self._active: list[str] = []

    def get(self, name: str) -> Scalar | None:
        if name in self.values:
            return self.values[name]
        decl = self.decls[name]
        if name in self._active:
            chain = " -> ".join(self._active[self._active.index(name) :] + [name])
            self.rep.error(decl.span, f"constant `{name}` depends on itself: {chain}")
            return None
        self._active.append(name)
        value = self.eval(self.overrides.get(name, decl.value))
        self._active.pop()
        self.values[name] = value
        return value

    def eval(self, e: Expr, local: dict[str, Scalar] | None = None) -> Scalar | None:
        """Value of a constant expression; `local` binds extra names such as the layer index."""
        local = local or {}
        if isinstance(e, Num):
            return e.value
        if isinstance(e, Name):
            if e.id in local:
                return local[e.id]
            if e.id in self.decls:
                return self.get(e.id)
            if e.id in self.dims:
                self.rep.error(e.span, f"`{e.id}` is a `dim`, known only when the step is built: not a constant")
                return None
            hint = did_you_mean(e.id, [*self.decls, *local])
            self.rep.error(e.span, f"unknown constant `{e.id}`", hint)
            return None
        if isinstance(e, UnOp):
            v = self.eval(e.operand, local)
            if v is None:
                return None
            if e.op == "not":
                b = self._bool(v, e.operand.span)
                return None if b is None else not b
            if isinstance(v, bool):
                self.rep.error(e.span, "cannot negate a boolean")
                return None
            return -v
        if isinstance(e, BinOp):
            return self._binop(e, local)
        if isinstance(e, Call):
            self.rep.error(e.func_span, f"`{e.func}(...)` is not a constant: calls are only allowed in blocks")
            return None
        raise AssertionError(e)

    def _bool(self, v: Scalar, span: Span) -> bool | None:
        if not isinstance(v, bool):
            self.rep.error(span, f"expected true or false, got {v!r}", "compare with `==`, `<`, ...")
            return None
        return v

    def _binop(self, e: BinOp, local) -> Scalar | None:
        a = self.eval(e.left, local)
        b = self.eval(e.right, local)
        if a is None or b is None:
            return None
        if e.op in ("and", "or"):
            ba, bb = self._bool(a, e.left.span), self._bool(b, e.right.span)
            if ba is None or bb is None:
                return None
            return (ba and bb) if e.op == "and" else (ba or bb)
        if e.op in _CMP:
            return _CMP[e.op](a, b)
        if isinstance(a, bool) or isinstance(b, bool):
            self.rep.error(e.span, f"operator `{e.op}` needs numbers, not true/false")
            return None
        if e.op in ("//", "%", "/") and b == 0:
            self.rep.error(e.span, "division by zero")
            return None
        if e.op in ("//", "%") and not (isinstance(a, int) and isinstance(b, int)):
            self.rep.error(e.span, f"operator `{e.op}` needs integers", "use `/` for real division")
            return None
        if e.op == "**" and isinstance(b, int) and b < 0 and isinstance(a, int):
            a = float(a)
        if e.op == "**" and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b * a.bit_length() > _MAX_BITS:
            self.rep.error(e.span, f"`{a} ** {b}` is too large")
            return None
        try:
            v = _ARITH[e.op](a, b)
        except ZeroDivisionError:  # 0 ** -1
            self.rep.error(e.span, "division by zero")
            return None
        except OverflowError:
            self.rep.error(e.span, f"the result of `{e.op}` is too large")
            return None
        if isinstance(v, complex):
            self.rep.error(e.span, "a negative number to a fractional power is not a real number")
            return None
        return v

    def eval_int(self, e: Expr, what: str, minimum: int | None = 1) -> int | None:
        """Evaluate `e` as an integer (>= minimum), reporting `what` it was meant to be."""
        v = self.eval(e)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.rep.error(e.span, f"{what} must be an integer, got {v!r}")
            return None
        if minimum is not None and v < minimum:
            self.rep.error(e.span, f"{what} must be at least {minimum}, got {v}")
            return None
        return v

    def layer_attr(self, e: Expr, layers: list[int]):
        """An attribute inside a layer body: a constant, or a `LayerExpr` when it uses `l`.

        The expression is checked at every layer index it will see; if it has one value at all
        of them it folds to that constant.
        """
        from mkdsl.ir import LayerExpr

        if "l" in self.decls or not _mentions(e, "l"):
            return self.eval(e)
        values = [self.eval(e, {"l": layer}) for layer in layers]
        if not values or any(v is None for v in values):
            return None
        if all(v == values[0] for v in values):
            return values[0]
        return LayerExpr(self._render(e, python=True), self._render(e, python=False), values[0])

    def _render(self, e: Expr, python: bool) -> str:
        if isinstance(e, Num):
            return repr(e.value)
        if isinstance(e, Name):
            return ("l" if python else "li") if e.id == "l" else repr(self.get(e.id))
        if isinstance(e, UnOp):
            inner = self._render(e.operand, python)
            if e.op == "-":
                return f"(-{inner})"
            return f"(not {inner})" if python else f"jnp.logical_not({inner})"
        op = e.op if python or e.op not in ("and", "or") else {"and": "&", "or": "|"}[e.op]
        return f"({self._render(e.left, python)} {op} {self._render(e.right, python)})"


def _mentions(e: Expr, name: str) -> bool:
    if isinstance(e, Name):
        return e.id == name
    if isinstance(e, UnOp):
        return _mentions(e.operand, name)
    if isinstance(e, BinOp):
        return _mentions(e.left, name) or _mentions(e.right, name)
    return False
