"""Checkpoint mappings: where each weight of a spec comes from in a checkpoint file.

A spec's `checkpoint FORMAT { weight = "name pattern" | step | ... }` section is checked here
(called by the elaborator) into `CheckpointMap` records that the loader reads. A pattern names
the stored tensor; `{l}` is the layer index, and any other placeholder (`{e}`) runs over the
leading dimensions of one layer's slice, in order, its tensors stacked along them. A list of
patterns is concatenated along dimension 0. Steps run in order on the stored tensor (numpy
shape, `[out, in]` for a Hugging Face or GGUF matrix); each step is a `StepDef` registered in
`STEPS` by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from mkdsl.diagnostics import Reporter, Span, did_you_mean

FORMATS = {"hf": "Hugging Face safetensors", "gguf": "GGUF (llama.cpp)"}
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[tuple[str, int], ...]  # parameter name -> folded value
    span: Span = field(compare=False)

    @property
    def arg(self) -> dict[str, int]:
        return dict(self.args)

    def __str__(self) -> str:
        return self.name + (f"({', '.join(f'{k}={v}' for k, v in self.args)})" if self.args else "")


@dataclass(frozen=True)
class WeightSource:
    """One weight's source: stored tensor names (concatenated), the steps, and the placeholders
    other than `{l}` that stack one layer's tensors along its leading dimensions."""

    weight: str
    patterns: tuple[str, ...]
    steps: tuple[Step, ...]
    stack: tuple[str, ...]
    span: Span = field(compare=False)

    @property
    def rounds(self) -> bool:
        """The mapping accepts rounding into the spec's dtype (`| round`)."""
        return any(s.name == "round" for s in self.steps)

    def names(self, layer: int | None, index: tuple[int, ...] = ()) -> list[str]:
        values = {"l": layer, **dict(zip(self.stack, index, strict=True))}
        return [_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), p) for p in self.patterns]


@dataclass(frozen=True)
class CheckpointMap:
    format: str  # a key of FORMATS
    sources: tuple[WeightSource, ...]
    span: Span = field(compare=False)

    def source(self, weight: str) -> WeightSource:
        return next(s for s in self.sources if s.weight == weight)


# ---------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class StepDef:
    """A mapping step: its parameters, its shape rule (None, or why the shape does not fit) and
    what it does to the array."""

    params: tuple[str, ...]
    shape: Callable[[tuple[int, ...], dict[str, int]], tuple[int, ...] | str]
    apply: Callable[[np.ndarray, dict[str, int]], np.ndarray]
    doc: str


def _transpose_shape(s, a):
    return s[:-2] + (s[-1], s[-2]) if len(s) >= 2 else "`transpose` needs at least 2 dimensions"


def _unpermute_shape(s, a):
    h = a["heads"]
    if not s or h < 1 or s[0] % (2 * h):
        return f"`unpermute(heads={h})` needs dimension 0 ({s[0] if s else '-'}) to be a multiple of 2 x {h}"
    return s


def _unpermute(x, a):
    """llama.cpp stores row 2j+s of each head where Hugging Face has row s*d/2+j (its rope
    pairs adjacent rows); regroup each head's rows as (d/2, 2) and transpose back to (2, d/2)."""
    h = a["heads"]
    d = x.shape[0] // h
    return x.reshape(h, d // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _rows_shape(s, a):
    lo, hi = a["start"], a["stop"]
    if not s or not 0 <= lo < hi <= s[0]:
        return f"`rows({lo}, {hi})` needs 0 <= start < stop <= {s[0] if s else '-'} (dimension 0)"
    return (hi - lo,) + s[1:]


STEPS: dict[str, StepDef] = {
    "transpose": StepDef((), _transpose_shape, lambda x, a: np.swapaxes(x, -1, -2), "swap the last two dimensions"),
    "unpermute": StepDef(("heads",), _unpermute_shape, _unpermute, "undo llama.cpp's q/k row permutation"),
    "rows": StepDef(("start", "stop"), _rows_shape, lambda x, a: x[a["start"] : a["stop"]], "rows start..stop-1"),
    "round": StepDef((), lambda s, a: s, lambda x, a: x, "accept rounding into the spec's dtype"),
}


def mapped_shape(shape: tuple[int, ...], steps: tuple[Step, ...]) -> tuple[tuple[int, ...] | None, str]:
    """The shape after `steps`, or (None, why not)."""
    for st in steps:
        out = STEPS[st.name].shape(shape, st.arg)
        if isinstance(out, str):
            return None, out
        shape = out
    return shape, ""


def apply_steps(x: np.ndarray, steps: tuple[Step, ...]) -> np.ndarray:
    for st in steps:
        x = STEPS[st.name].apply(x, st.arg)
    return x


# ---------------------------------------------------------------------------- checking


def check_checkpoints(decls, tensors: dict, consts, rep: Reporter, declared=()) -> tuple[CheckpointMap, ...]:
    """The spec's checkpoint sections, checked against its weights (`tensors`: name -> Tensor;
    `declared`: every declared tensor name, so one with errors of its own is not reported again)."""
    out, seen = [], {}
    for d in decls:
        if d.format not in FORMATS:
            rep.error(
                d.span,
                f"unknown checkpoint format `{d.format}` (known: {', '.join(FORMATS)})",
                partial(did_you_mean, d.format, FORMATS),
            )
            continue
        if d.format in seen:
            rep.error(d.span, f"second `checkpoint {d.format}` section (first at line {seen[d.format]})")
            continue
        seen[d.format] = d.span.line
        sources = _check_entries(d, tensors, consts, rep, set(declared))
        out.append(CheckpointMap(d.format, tuple(sources), d.span))
    return tuple(out)


def _check_entries(d, tensors: dict, consts, rep: Reporter, declared: set) -> list[WeightSource]:
    sources, mapped = [], {}
    for e in d.entries:
        t = tensors.get(e.weight)
        if t is None and e.weight in declared:
            continue  # its declaration has errors, already reported
        if t is None or t.kind != "weight":
            what = f"`{e.weight}` is state, not a weight" if t is not None else f"unknown weight `{e.weight}`"
            names = [n for n, x in tensors.items() if x.kind == "weight"]
            rep.error(e.span, f"checkpoint {d.format}: {what}", partial(did_you_mean, e.weight, names))
            continue
        if e.weight in mapped:
            rep.error(e.span, f"checkpoint {d.format}: `{e.weight}` is mapped twice (first at line {mapped[e.weight]})")
            continue
        mapped[e.weight] = e.span.line
        stack = _check_patterns(d.format, e, t, rep)
        steps = tuple(s for s in (_check_step(d.format, st, consts, rep) for st in e.steps) if s is not None)
        if stack is not None and len(steps) == len(e.steps):
            sources.append(WeightSource(e.weight, e.patterns, steps, stack, e.span))
    missing = [n for n, t in tensors.items() if t.kind == "weight" and n not in mapped]
    if missing:
        rep.error(
            d.span,
            f"checkpoint {d.format} does not say where {_list(missing)} come{'s' if len(missing) == 1 else ''} from",
            'a loader needs every weight: add `NAME = "tensor name"` lines',
        )
    return sources


def _list(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_patterns(fmt: str, e, t, rep: Reporter) -> tuple[str, ...] | None:
    """The stacking placeholders of the entry's patterns, or None after reporting a mistake."""
    found = None
    for pattern, span in zip(e.patterns, e.pattern_spans, strict=True):
        names = _PLACEHOLDER.findall(pattern)
        bad = next((n for n in names if not _IDENT.fullmatch(n)), None)
        if bad is not None or "{" in _PLACEHOLDER.sub("", pattern) or "}" in _PLACEHOLDER.sub("", pattern):
            rep.error(span, f"bad name pattern {pattern!r}", "placeholders are `{l}` (the layer) or `{NAME}`")
            return None
        if ("l" in names) != t.stacked:
            need = "has no layer index `{l}`" if t.stacked else "uses `{l}`, but the weight is not per layer"
            rep.error(span, f"checkpoint {fmt}: the pattern for `{e.weight}` {need}")
            return None
        stack = tuple(dict.fromkeys(n for n in names if n != "l"))
        if len(stack) >= len(t.type.shape):
            rep.error(span, f"pattern {pattern!r} stacks {len(stack)} dimensions; `{e.weight}` has {len(t.type.shape)}")
            return None
        if found is not None and stack != found:
            rep.error(span, "the patterns of a concatenation must use the same placeholders")
            return None
        found = stack
    return found


def _check_step(fmt: str, st, consts, rep: Reporter) -> Step | None:
    sd = STEPS.get(st.name)
    if sd is None:
        rep.error(
            st.span, f"unknown checkpoint step `{st.name}` (known: {', '.join(STEPS)})", did_you_mean(st.name, STEPS)
        )
        return None
    given = dict(zip(sd.params, st.args))
    for kw in st.kwargs:
        if kw.name not in sd.params or kw.name in given:
            rep.error(kw.span, f"`{st.name}` takes {_params(sd)}; `{kw.name}` is not one or given twice")
            return None
        given[kw.name] = kw.value
    if len(st.args) > len(sd.params) or set(given) != set(sd.params):
        rep.error(st.span, f"`{st.name}` takes {_params(sd)}")
        return None
    args = {}
    for name, expr in given.items():
        v = consts.eval_int(expr, f"`{st.name}`'s `{name}`", minimum=0)
        if v is None:
            return None
        args[name] = v
    return Step(st.name, tuple((p, args[p]) for p in sd.params), st.span)


def _params(sd: StepDef) -> str:
    return f"({', '.join(sd.params)})" if sd.params else "no arguments"
