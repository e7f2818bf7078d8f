"""Constant folding: evaluate constant expressions with profiles applied and cycles caught."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from typing import TypeVar

from mkdsl.lang.diagnostics import Reporter, Span, did_you_mean
from mkdsl.lang.syntax import BinOp, Call, ConstDecl, Expr, Name, Num, UnOp

Scalar = int | float | bool | str
T = TypeVar("T")

_ARITH = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}
INT_LIMIT = 2**63  # integer constants lie in -2**63 .. 2**63 - 1: what a kernel's int64 can hold
_CMP = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _positive(fn: Callable[[float], float]) -> Callable[[float], float]:
    def f(x):
        if x <= 0:
            raise ValueError("it needs a positive argument")
        return fn(x)

    return f


def _sqrt(x):
    if x < 0:
        raise ValueError("it needs an argument of at least 0")
    return math.sqrt(x)


# Math functions in constant expressions: name -> ((fewest, most arguments), function). Results
# are checked like every other value (finite floats, int64 integers); floor and ceil give ints.
MATH: dict[str, tuple[tuple[int, int | None], Callable]] = {
    "ln": ((1, 1), _positive(math.log)),
    "log": ((1, 1), _positive(math.log)),
    "log2": ((1, 1), _positive(math.log2)),
    "sqrt": ((1, 1), _sqrt),
    "exp": ((1, 1), math.exp),
    "pow": ((2, 2), None),  # the `**` operator's rules
    "min": ((1, None), min),
    "max": ((1, None), max),
    "floor": ((1, 1), math.floor),
    "ceil": ((1, 1), math.ceil),
    "abs": ((1, 1), abs),
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
        self._broken: set[str] = set()  # constants on a dependency cycle being resolved

    def get(self, name: str) -> Scalar | None:
        """The value of constant `name`, evaluating what it depends on first (without recursion:
        a chain of thousands of constants is as legal as a short one)."""
        if name in self.values:
            return self.values[name]
        stack = [(name, iter(self._needs(name)))]
        path = [name]
        while stack:
            current, needs = stack[-1]
            for dep in needs:
                if dep in self.values or dep in self._broken:
                    continue
                if dep in path:
                    chain = " -> ".join(path[path.index(dep) :] + [dep])
                    self.rep.error(self.decls[dep].span, f"constant `{dep}` depends on itself: {chain}")
                    self._broken.add(dep)  # reads of it give None until its own value is known
                    continue
                stack.append((dep, iter(self._needs(dep))))
                path.append(dep)
                break
            else:
                stack.pop()
                path.pop()
                self.values[current] = self._fold(self.overrides.get(current, self.decls[current].value), {})
                self._broken.discard(current)
        return self.values[name]

    def _needs(self, name: str) -> list[str]:
        """The constants the (possibly overridden) definition of `name` reads."""
        return [n for n in _names(self.overrides.get(name, self.decls[name].value)) if n in self.decls]

    def eval(self, e: Expr, local: dict[str, Scalar] | None = None) -> Scalar | None:
        """Value of a constant expression; `local` binds extra names such as the layer index."""
        local = local or {}
        for n in _names(e):
            if n not in local and n in self.decls:
                self.get(n)
        return self._fold(e, local)

    def _fold(self, e: Expr, local: dict[str, Scalar]) -> Scalar | None:
        """Bottom-up evaluation; every constant `e` reads is already evaluated (see `eval`)."""

        def visit(node: Expr, args: list) -> Scalar | None:
            if isinstance(node, Num):
                return self._checked(node.value, node.span, "this number")
            if isinstance(node, Name):
                return self._name(node, local)
            if isinstance(node, UnOp):
                return self._unop(node, args[0])
            if isinstance(node, BinOp):
                return self._binop(node, args[0], args[1])
            if isinstance(node, Call):
                return self._call(node, args)
            raise AssertionError(node)

        return postorder(e, visit)

    def _call(self, e: Call, args: list) -> Scalar | None:
        """A math function of constants (`MATH`); any other call is not a constant."""
        if e.func not in MATH:
            self.rep.error(e.func_span, f"`{e.func}(...)` is not a constant: calls are only allowed in blocks")
            return None
        arity, fn = MATH[e.func]
        if e.kwargs:
            self.rep.error(e.kwargs[0].span, f"`{e.func}` takes no keyword arguments")
            return None
        if len(args) < arity[0] or (arity[1] is not None and len(args) > arity[1]):
            want = str(arity[0]) if arity[0] == arity[1] else f"at least {arity[0]}"
            self.rep.error(e.span, f"`{e.func}` takes {want} argument{'' if arity[0] == 1 else 's'}, got {len(args)}")
            return None
        if any(a is None for a in args):
            return None
        if any(isinstance(a, bool) for a in args):
            self.rep.error(e.span, f"`{e.func}` needs numbers, not true/false")
            return None
        if e.func == "pow":
            return self._binop(BinOp(e.span, "**", e.args[0], e.args[1]), args[0], args[1])
        try:
            v = fn(*args)
        except ValueError as err:
            self.rep.error(e.span, f"`{e.func}` is not defined at {', '.join(map(repr, args))}: {err}")
            return None
        except OverflowError:
            self.rep.error(e.span, f"the result of `{e.func}` is too large")
            return None
        return self._checked(v, e.span, f"the result of `{e.func}`")

    def _name(self, e: Name, local: dict[str, Scalar]) -> Scalar | None:
        if e.id in local:
            return local[e.id]
        if e.id in self.decls:
            return self.values.get(e.id)  # None while it is broken (a cycle)
        if e.id in self.dims:
            self.rep.error(e.span, f"`{e.id}` is a `dim`, known only when the step is built: not a constant")
            return None
        # The hint, costly with many names, is computed only if the error is kept.
        self.rep.error(e.span, f"unknown constant `{e.id}`", lambda: did_you_mean(e.id, [*self.decls, *local]))
        return None

    def _unop(self, e: UnOp, v: Scalar | None) -> Scalar | None:
        if v is None:
            return None
        if e.op == "not":
            b = self._bool(v, e.operand.span)
            return None if b is None else not b
        if isinstance(v, (bool, str)):
            self.rep.error(e.span, f"cannot negate {'a boolean' if isinstance(v, bool) else 'a word'}")
            return None
        return self._checked(-v, e.span, "the result of `-`")

    def _checked(self, v: Scalar, span: Span, what: str) -> Scalar | None:
        """`v` if a kernel can hold it: an int64 integer or a finite number."""
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and not -INT_LIMIT <= v < INT_LIMIT:
            self.rep.error(
                span,
                f"{what} is out of range: integer constants must lie in -2**63 .. 2**63 - 1",
                "a kernel holds sizes and attributes in 64 bits",
            )
            return None
        if isinstance(v, float) and not math.isfinite(v):
            self.rep.error(span, f"{what} is out of range: it is {v} as a 64-bit float", "constants must be finite")
            return None
        return v

    def _bool(self, v: Scalar, span: Span) -> bool | None:
        if not isinstance(v, bool):
            self.rep.error(span, f"expected true or false, got {v!r}", "compare with `==`, `<`, ...")
            return None
        return v

    def _binop(self, e: BinOp, a: Scalar | None, b: Scalar | None) -> Scalar | None:
        if a is None or b is None:
            return None
        if e.op in ("and", "or"):
            ba, bb = self._bool(a, e.left.span), self._bool(b, e.right.span)
            if ba is None or bb is None:
                return None
            return (ba and bb) if e.op == "and" else (ba or bb)
        if isinstance(a, str) or isinstance(b, str):
            if e.op in ("==", "!=") and isinstance(a, str) and isinstance(b, str):
                return _CMP[e.op](a, b)
            self.rep.error(e.span, f"operator `{e.op}` needs numbers, not a quoted word")
            return None
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
        if e.op == "**" and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b > 64:
            return self._checked(INT_LIMIT, e.span, f"`{a} ** {b}`")  # reported without computing it
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
        return self._checked(v, e.span, f"the result of `{e.op}`")

    def eval_int(
        self, e: Expr, what: str, minimum: int | None = 1, maximum: tuple[int, str] | None = None
    ) -> int | None:
        """Evaluate `e` as an integer (>= minimum; <= maximum[0], which maximum[1] explains),
        reporting `what` it was meant to be."""
        v = self.eval(e)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            self.rep.error(e.span, f"{what} must be an integer, got {v!r}")
            return None
        if minimum is not None and v < minimum:
            self.rep.error(e.span, f"{what} must be at least {minimum}, got {v}")
            return None
        if maximum is not None and v > maximum[0]:
            self.rep.error(e.span, f"{what} must be at most {maximum[0]}, got {v}", maximum[1])
            return None
        return v

    def layer_attr(self, e: Expr, layers: list[int], local: dict[str, Scalar] | None = None):
        """An attribute inside a layer body: a constant, or a `LayerExpr` when it uses `l`.

        The expression is checked at every layer index it will see; if it has one value at all
        of them it folds to that constant. `local` binds a block's constant parameters.
        """
        from mkdsl.lang.ir import LayerExpr

        local = local or {}
        if "l" in self.decls or "l" in local or not _mentions(e, "l"):
            return self.eval(e, local)
        values = [self.eval(e, {**local, "l": layer}) for layer in layers]
        if not values or any(v is None for v in values):
            return None
        if all(v == values[0] for v in values):
            return values[0]
        call = next((n for n in walk(e) if isinstance(n, Call)), None)
        if call is not None:
            self.rep.error(
                call.func_span,
                f"`{call.func}(...)` of the layer index: the kernel computes layer-dependent values "
                "with arithmetic only",
                "give each layer kind its own constant",
            )
            return None
        return LayerExpr(self._render(e, True, local), self._render(e, False, local), values[0])

    def _render(self, e: Expr, python: bool, local: dict[str, Scalar]) -> str:
        def visit(node: Expr, args: list[str]) -> str:
            if isinstance(node, Num):
                return repr(node.value)
            if isinstance(node, Name) and node.id in local and node.id != "l":
                return repr(local[node.id])
            if isinstance(node, Name):
                return ("l" if python else "li") if node.id == "l" else repr(self.get(node.id))
            if isinstance(node, UnOp):
                if node.op == "-":
                    return f"(-{args[0]})"
                return f"(not {args[0]})" if python else f"jnp.logical_not({args[0]})"
            op = node.op if python or node.op not in ("and", "or") else {"and": "&", "or": "|"}[node.op]
            return f"({args[0]} {op} {args[1]})"

        return postorder(e, visit)


def _children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, BinOp):
        return (e.left, e.right)
    if isinstance(e, UnOp):
        return (e.operand,)
    if isinstance(e, Call) and e.func in MATH:
        return e.args
    return ()


def walk(e: Expr) -> Iterator[Expr]:
    """Every node of a constant expression, without recursion."""
    todo = [e]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(reversed(_children(node)))


def postorder(e: Expr, visit: Callable[[Expr, list], T]) -> T:
    """`visit(node, its children's results)` bottom-up, left to right, without recursion:
    expressions such as a 500-term `or` nest deeper than Python's call stack allows."""
    results: list = []
    todo: list[tuple[Expr, bool]] = [(e, False)]
    while todo:
        node, ready = todo.pop()
        kids = _children(node)
        if kids and not ready:
            todo.append((node, True))
            todo.extend((k, False) for k in reversed(kids))
            continue
        args = results[len(results) - len(kids) :] if kids else []
        del results[len(results) - len(kids) :]
        results.append(visit(node, args))
    return results[0]


def _names(e: Expr) -> list[str]:
    return list(dict.fromkeys(n.id for n in walk(e) if isinstance(n, Name)))


def _mentions(e: Expr, name: str) -> bool:
    return name in _names(e)
