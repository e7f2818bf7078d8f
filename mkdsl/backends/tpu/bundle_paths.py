"""The longest path through one iteration of a loop in libtpu's final bundles.

A loop body that picks among several DMA shapes (the weight ring's issue tree, `ring_issue` in
runtime/core.py.jinja) is compiled as regions, each skipped by a forward branch
(`sbr.rel (%p) target = $regionN`) on a predicate that compares one scalar register with a
constant; the regions of one tree exclude each other, so counting every bundle of the body
charges an iteration with all of them. One iteration runs one path: this walks the body's
forward branches, keeps the paths whose compares can all hold together (an interval per compared
register), and returns the most bundles any such path issues. A taken branch is charged the
`DELAY_SLOTS` bundles after it (they issue either way). Still a floor on cycles, as any bundle
count is (mkdsl/backends/tpu/bundles.py); used by `mkdsl plan --static`.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from functools import cache

_REGION = re.compile(r"Start(?:/End empty)? region (\d+)")
_BRANCH = re.compile(r"sbr\.rel (?:\((!?)%(p\w+)\) )?target = \$region(\d+)")
_COMPARE = re.compile(r"%(p\w+) = scmp\.(lt|le|gt|ge|eq|ne)\.s32\.totalorder (?:\(!?%p\w+\), )?%(s\w+), (-?\d+)\b")
_NEGATE = re.compile(r"%(p\w+) = pneg %(p\w+)")
DELAY_SLOTS = 2  # bundles after a branch that issue whether it is taken (seen: filled with predicated code)
BIG = 2**62

# op -> the values v of the register for which `v op c` holds, as an interval of c
_HOLDS = {
    "lt": lambda c: (-BIG, c - 1),
    "le": lambda c: (-BIG, c),
    "gt": lambda c: (c + 1, BIG),
    "ge": lambda c: (c, BIG),
    "eq": lambda c: (c, c),
}
_FAILS = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def region_starts(texts: list[str]) -> dict[str, int]:
    """Region id -> index of the bundle it starts at (a branch's target)."""
    out: dict[str, int] = {}
    for i, text in enumerate(texts):
        for region in _REGION.findall(text):
            out.setdefault(region, i)
    return out


def _predicates(texts: list[str]) -> dict[str, tuple]:
    """Predicate -> ("cmp", register, op, constant) or ("not", predicate), as the body defines them."""
    out: dict[str, tuple] = {}
    for text in texts:
        for p, op, reg, c in _COMPARE.findall(text):
            out[p] = ("cmp", reg, op, int(c))
        for p, q in _NEGATE.findall(text):
            out[p] = ("not", q)
    return out


def _compare(preds: dict, p: str, value: bool = True) -> tuple[tuple | None, bool]:
    """(the compare predicate p comes down to through its negations, or None; its value when p is `value`)."""
    d = preds.get(p)
    while d is not None and d[0] == "not":
        value, d = not value, preds.get(d[1])
    return d, value


def _constrain(state: tuple, preds: dict, p: str, value: bool) -> tuple | None:
    """`state` (sorted (register, lo, hi)) with predicate p known to be `value`; None: infeasible."""
    d, value = _compare(preds, p, value)
    if d is None:
        return state
    _, reg, op, c = d
    if op == "ne":
        op, value = "eq", not value
    if not value and op == "eq":  # v != c: no interval; only a point interval at c is excluded
        point = next(((lo, hi) for r, lo, hi in state if r == reg), None)
        return None if point == (c, c) else state
    lo, hi = _HOLDS[op if value else _FAILS[op]](c)
    bounds = dict((r, (a, b)) for r, a, b in state)
    a, b = bounds.get(reg, (-BIG, BIG))
    a, b = max(a, lo), min(b, hi)
    if a > b:
        return None
    bounds[reg] = (a, b)
    return tuple(sorted((r, x, y) for r, (x, y) in bounds.items()))


def longest_path(texts: list[str], first: int, last: int, counted: set[int], starts: dict[str, int]) -> int:
    """Most bundles of `counted` on a feasible path from bundle `first` to `last` (the loop's back
    branch), following the forward branches inside [first, last]."""
    preds = _predicates(texts[first : last + 1])
    branches = {i: b for i in range(first, last + 1) if (b := _branch_at(texts[i], i, last, starts))}
    last_use: dict[str, int] = {}  # register -> the last branch that tests it (its interval is dropped after)
    for i, (_, p, _) in branches.items():
        if (d := _compare(preds, p)[0]) is not None:
            last_use[d[1]] = i
    nxt = [0] * (last + 2)  # the first branch bundle at or after each index (last + 1: none)
    nxt[last + 1] = last + 1
    for i in range(last, first - 1, -1):
        nxt[i] = i if i in branches else nxt[i + 1]
    ordered = sorted(counted)

    def count(a: int, b: int) -> int:  # counted bundles in [a, b)
        return bisect_left(ordered, b) - bisect_left(ordered, a)

    @cache
    def walk(i: int, state: tuple) -> int | None:
        j = nxt[i]
        if j > last:
            return count(i, last + 1)
        negated, p, target = branches[j]
        state = tuple(x for x in state if last_use.get(x[0], -1) >= j)
        best = None
        for taken in (True, False):
            st = _constrain(state, preds, p, taken != negated) if p else (state if taken else None)
            if st is None:
                continue
            if taken:
                rest = walk(target, st)
                rest = None if rest is None else rest + count(j + 1, min(j + 1 + DELAY_SLOTS, target))
            else:
                rest = walk(j + 1, st) if j < last else 0
            if rest is not None:
                best = rest if best is None else max(best, rest)
        return None if best is None else count(i, j + 1) + best

    found = walk(first, ())
    return len(counted) if found is None else found


def _branch_at(text: str, i: int, last: int, starts: dict[str, int]) -> tuple[bool, str, int] | None:
    """(negated, predicate or "", target index) of bundle i's forward branch inside the body."""
    for neg, p, region in _BRANCH.findall(text):
        s = starts.get(region)
        if s is not None and i < s <= last:
            return neg == "!", p, s
    return None
