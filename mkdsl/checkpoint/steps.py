"""The steps of a checkpoint mapping (`| transpose`, `| group_rows(...)`): what each does to a
stored tensor's shape and data, and to a quantised tensor's scales.

Most steps pick or reorder the entries of one axis (`rows`, `group_rows`, `regroup`,
`unpermute`): each is an index map, `SELECT`, and everything else follows from it, the shape, the
data (`np.take`) and the scales of a quantised tensor. A quantised tensor (codes and scales, one
scale per `groups[a]` consecutive entries of axis `a`) moves with its scales only where the map
keeps every scale group whole and in one piece; then its scales move by the map of the groups.
So every step is exact: it only moves stored values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Grid:
    """A quantised tensor during mapping: the shape of its elements and, per axis, how many
    consecutive elements share one scale (its scales' shape is `ceil(shape / groups)`)."""

    shape: Shape
    groups: Shape

    @property
    def scales_shape(self) -> Shape:
        return tuple(-(-n // g) for n, g in zip(self.shape, self.groups, strict=True))


@dataclass(frozen=True)
class StepDef:
    """A mapping step: its parameters (with defaults for the optional ones), then either an index
    map over one axis (`select`: the source entry of each output entry, or why the shape does not
    fit) or a shape rule and a function; `grid`: what it does to a quantised tensor's scale
    groups (None: it cannot apply to one), the scales moving as `apply` moves the elements."""

    params: tuple[str, ...]
    doc: str
    defaults: tuple[tuple[str, int], ...] = ()
    select: Callable[[Shape, dict], tuple[int, np.ndarray] | str] | None = None
    shape: Callable[[Shape, dict], Shape | str] | None = None
    apply: Callable[[np.ndarray, dict], np.ndarray] | None = None
    grid: Callable[[Grid, dict], Grid | str] | None = None


def _axis(s: Shape, a: dict) -> int | str:
    d = a.get("dim", 0)
    if d >= len(s):
        return f"dimension {d} does not exist in a tensor of shape {list(s)}"
    return d


def _rows(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    lo, hi = a["start"], a["stop"]
    if not 0 <= lo < hi <= s[d]:
        return f"`rows({lo}, {hi})` needs 0 <= start < stop <= {s[d]} (dimension {d})"
    return d, np.arange(lo, hi)


def _repeat(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    if a["each"] < 1:
        return f"`repeat(each={a['each']})` needs each >= 1"
    return d, np.arange(s[d] * a["each"]) // a["each"]


def _group_rows(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    g, lo, hi = a["groups"], a["start"], a["stop"]
    if g < 1 or s[d] % g or not 0 <= lo < hi <= s[d] // g:
        return (
            f"`group_rows(groups={g}, start={lo}, stop={hi})` needs dimension {d} ({s[d]}) to be {g} equal "
            f"groups and 0 <= start < stop <= the group's size"
        )
    r = s[d] // g
    return d, (np.arange(g)[:, None] * r + np.arange(lo, hi)).ravel()


def _regroup(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    g, p = a["groups"], a["parts"]
    if g < 1 or p < 1 or s[d] % (g * p):
        return f"`regroup(groups={g}, parts={p})` needs dimension {d} ({s[d]}) to be a multiple of {g} x {p}"
    return d, np.arange(s[d]).reshape(g, p, -1).swapaxes(0, 1).ravel()


def _repeat_groups(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    g, n = a["groups"], a["times"]
    if g < 1 or n < 1 or s[d] % g:
        return f"`repeat_groups(groups={g}, times={n})` needs dimension {d} ({s[d]}) to be {g} equal groups"
    r = s[d] // g
    return d, (np.repeat(np.arange(g), n)[:, None] * r + np.arange(r)).ravel()


def _group_pad_shape(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    g, size = a["groups"], a["size"]
    if g < 1 or s[d] % g or size < s[d] // g:
        return f"`group_pad(groups={g}, size={size})` needs dimension {d} ({s[d]}) to be {g} equal groups of at most {size}"
    return s[:d] + (g * size,) + s[d + 1 :]


def _group_pad(x: np.ndarray, a: dict) -> np.ndarray:
    d, g = a["dim"], a["groups"]
    parts = np.split(x, g, axis=d)
    return np.concatenate([_pad(p, {"dim": d, "size": a["size"]}) for p in parts], axis=d)


def _unpermute(s: Shape, a: dict):
    """llama.cpp stores row 2j+s of each head where Hugging Face has row s*d/2+j (its rope pairs
    adjacent rows): each head's rows regrouped as (d/2, 2) and transposed back to (2, d/2)."""
    h = a["heads"]
    if not s or h < 1 or s[0] % (2 * h):
        return f"`unpermute(heads={h})` needs dimension 0 ({s[0] if s else '-'}) to be a multiple of 2 x {h}"
    return 0, np.arange(s[0]).reshape(h, -1, 2).swapaxes(1, 2).ravel()


def _transpose_shape(s: Shape, a: dict):
    return s[:-2] + (s[-1], s[-2]) if len(s) >= 2 else "`transpose` needs at least 2 dimensions"


def _transpose_grid(g: Grid, a: dict) -> Grid:
    return Grid(_transpose_shape(g.shape, a), g.groups[:-2] + (g.groups[-1], g.groups[-2]))


def _squeeze_shape(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    return s[:d] + s[d + 1 :] if s[d] == 1 else f"`squeeze(dim={d})` needs dimension {d} to be 1, not {s[d]}"


def _squeeze_grid(g: Grid, a: dict) -> Grid | str:
    s = _squeeze_shape(g.shape, a)
    return s if isinstance(s, str) else Grid(s, g.groups[: a["dim"]] + g.groups[a["dim"] + 1 :])


def _pad_shape(s: Shape, a: dict):
    d = _axis(s, a)
    if isinstance(d, str):
        return d
    if a["size"] < s[d]:
        return f"`pad({a['size']})` needs dimension {d} ({s[d]}) to be at most {a['size']}"
    return s[:d] + (a["size"],) + s[d + 1 :]


def _pad(x: np.ndarray, a: dict) -> np.ndarray:
    d = a["dim"]
    widths = [(0, 0)] * x.ndim
    widths[d] = (0, a["size"] - x.shape[d])
    return np.pad(x, widths)


STEPS: dict[str, StepDef] = {
    "transpose": StepDef(
        (),
        "swaps the last two dimensions (a stored `[out, in]` matrix to the spec's `[in, out]`)",
        shape=_transpose_shape,
        apply=lambda x, a: np.swapaxes(x, -1, -2),
        grid=_transpose_grid,
    ),
    "rows": StepDef(
        ("start", "stop", "dim"),
        "keeps entries `start .. stop-1` of dimension `dim` (one part of a fused stored tensor)",
        (("dim", 0),),
        select=_rows,
    ),
    "group_rows": StepDef(
        ("groups", "start", "stop", "dim"),
        "cuts dimension `dim` into `groups` equal groups and keeps entries `start .. stop-1` of each, "
        "in group order (one part of a tensor fused per head; `groups=N, start=0, stop=1` of groups "
        "of 2 takes the even entries)",
        (("dim", 0),),
        select=_group_rows,
    ),
    "regroup": StepDef(
        ("groups", "parts", "dim"),
        "reads dimension `dim` as `groups` x `parts` x rest and reorders it to `parts` x `groups` x "
        "rest (part 0 of every group, then part 1, ...)",
        (("dim", 0),),
        select=_regroup,
    ),
    "repeat_groups": StepDef(
        ("groups", "times", "dim"),
        "cuts dimension `dim` into `groups` equal groups and writes each `times` times in a row (a "
        "key/value head repeated so that every device holds whole heads)",
        (("dim", 0),),
        select=_repeat_groups,
    ),
    "group_pad": StepDef(
        ("groups", "size", "dim"),
        "cuts dimension `dim` into `groups` equal groups and pads each with zeros to `size` entries "
        "(a projection the spec pads per device: each device's block holds its part first)",
        (("dim", 0),),
        shape=_group_pad_shape,
        apply=_group_pad,
    ),
    "unpermute": StepDef(
        ("heads",),
        "undoes llama.cpp's q/k row permutation: in each of the N heads of d rows, stored row "
        "`2j + s` is row `s*d/2 + j`, so half-split `rope` applies",
        select=_unpermute,
    ),
    "repeat": StepDef(
        ("each", "dim"),
        "repeats each entry of dimension `dim` `each` times in place (a per-head `[heads]` weight "
        "widened to the `[heads * d]` values it scales, e.g. Mamba2's D)",
        (("dim", 0),),
        select=_repeat,
    ),
    "squeeze": StepDef(
        ("dim",),
        "drops dimension `dim`, of size 1",
        shape=_squeeze_shape,
        apply=lambda x, a: np.squeeze(x, a["dim"]),
        grid=_squeeze_grid,
    ),
    "pad": StepDef(
        ("size", "dim"),
        "pads dimension `dim` with zeros to `size` entries (a projection the spec pads to whole tiles)",
        (("dim", 0),),
        shape=_pad_shape,
        apply=_pad,
    ),
    "stored": StepDef(
        (),
        "keeps a GGUF block format (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) as the file stores it: loaded for "
        "that file (`mkdsl run`, `mkdsl plan --weights`, `mkdsl.load(spec, weights=...)`), the weight takes "
        "the format (`q8_0`, `q4_0`, `q4_1`, `q4_k`, `q5_k`, `q6_k`) in place of its declared dtype; "
        "otherwise as `round` (see below)",
        shape=lambda s, a: s,
        apply=lambda x, a: x,
        grid=lambda g, a: g,
    ),
    "round": StepDef(
        (),
        "accepts rounding into the spec's dtype (see below)",
        shape=lambda s, a: s,
        apply=lambda x, a: x,
        grid=lambda g, a: g,
    ),
}


# ---------------------------------------------------------------------------- plain tensors


def step_shape(sd: StepDef, shape: Shape, args: dict) -> Shape | str:
    if sd.select is None:
        return sd.shape(shape, args)
    sel = sd.select(shape, args)
    if isinstance(sel, str):
        return sel
    d, idx = sel
    return shape[:d] + (len(idx),) + shape[d + 1 :]


def step_apply(sd: StepDef, x: np.ndarray, args: dict) -> np.ndarray:
    if sd.select is None:
        return sd.apply(x, args)
    d, idx = sd.select(x.shape, args)
    return np.take(x, idx, axis=d)


# ---------------------------------------------------------------------------- quantised tensors


def step_grid(sd: StepDef, g: Grid, args: dict) -> tuple[Grid, Callable | None] | str:
    """The grid after the step and what it does to the scales (None: what `apply` does), or why
    it cannot apply to a quantised tensor."""
    if sd.select is None:
        if sd.grid is None:
            return "it cannot apply to a quantised tensor (codes and scales)"
        out = sd.grid(g, args)
        return out if isinstance(out, str) else (out, None)
    sel = sd.select(g.shape, args)
    if isinstance(sel, str):
        return sel
    d, idx = sel
    k = _whole_groups(idx, g.shape[d], g.groups[d])
    if k is None:
        return f"it splits the scale groups of dimension {d} ({g.groups[d]} entries share one scale)"
    shape = g.shape[:d] + (len(idx),) + g.shape[d + 1 :]
    return Grid(shape, g.groups), lambda s: np.take(s, k, axis=d)


def _whole_groups(idx: np.ndarray, n: int, g: int) -> np.ndarray | None:
    """The source group of each output group if `idx` moves whole groups of `g` entries (the last
    one may be short) into whole output groups, else None."""
    if g == 1:
        return idx
    starts = idx[::g]
    if np.any(starts % g):
        return None
    whole = np.concatenate([np.arange(s, min(s + g, n)) for s in starts])
    return starts // g if len(whole) == len(idx) and np.array_equal(whole, idx) else None
