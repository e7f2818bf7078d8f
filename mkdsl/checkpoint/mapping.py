"""Checkpoint mappings: where each weight of a spec comes from in a checkpoint file.

A spec's `checkpoint FORMAT { weight = "name pattern" | step | ... }` section is checked here
(called by the elaborator) into `CheckpointMap` records that the loader reads. A pattern names
the stored tensor; `{l}` is the layer index, and any other placeholder (`{e}`) runs over the
leading dimensions of one layer's slice, in order, its tensors stacked along them. A list of
patterns is concatenated along dimension 0; `"codes" * "scales"` is one quantised tensor stored
as two (the loader's `formats.PAIRS` say how each stored kind reads). Steps run in order on the
stored tensor (numpy shape, `[out, in]` for a Hugging Face or GGUF matrix; a quantised one's
elements, its scales moving with them); each step is a `StepDef` registered in `steps.STEPS`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from mkdsl.checkpoint.steps import STEPS, Grid, StepDef, step_apply, step_grid, step_shape
from mkdsl.lang.diagnostics import Reporter, Span, did_you_mean
from mkdsl.lang.dtypes import storage

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
    """One weight's source: stored tensor names (concatenated; or the codes of a quantised
    tensor whose scales `scales` names), the steps, and the placeholders other than `{l}` that
    stack one layer's tensors along its leading dimensions."""

    weight: str
    patterns: tuple[str, ...]
    steps: tuple[Step, ...]
    stack: tuple[str, ...]
    span: Span = field(compare=False)
    scales: str | None = None
    glob: str | None = None  # NVFP4's per-tensor global scale (`"codes" * "scales" * "global"`)
    # `or` sources: the same weight as another save stores it; the loader takes the first source
    # whose tensors the checkpoint holds (`loader.choose_source`)
    alternatives: tuple[WeightSource, ...] = ()

    @property
    def sources(self) -> tuple[WeightSource, ...]:
        return (self, *self.alternatives)

    @property
    def rounds(self) -> bool:
        """The mapping accepts rounding into the spec's dtype (`| round`; `| stored` where the
        spec was not retyped to the stored format, `mkdsl/checkpoint/stored.py`)."""
        return any(s.name in ("round", "stored") for s in self.steps)

    @property
    def keeps(self) -> bool:
        """`| stored`: the weight may take the file's block format (one stored tensor)."""
        return any(s.name == "stored" for s in self.steps) and self.scales is None and len(self.patterns) == 1

    def names(self, layer: int | None, index: tuple[int, ...] = ()) -> list[str]:
        """The stored tensors of one piece: the patterns' (then the scales', for a pair)."""
        values = {"l": layer, **dict(zip(self.stack, index, strict=True))}
        pats = self.patterns + tuple(p for p in (self.scales, self.glob) if p is not None)
        return [p.format_map(values) for p in pats]  # checked: `{name}` placeholders only, no other braces


@dataclass(frozen=True)
class CheckpointMap:
    format: str  # a key of FORMATS
    sources: tuple[WeightSource, ...]
    span: Span = field(compare=False)
    # `config { ... }`: the model's class (`architecture`) and config.json fields, folded; a
    # dotted key is a nested field (rope_scaling.factor). `mkdsl verify --against transformers`
    # builds the model's own implementation from them.
    settings: tuple[tuple[str, object], ...] = ()

    @property
    def architecture(self) -> str | None:
        return dict(self.settings).get("architecture")

    def config(self) -> dict:
        """The config.json fields (all settings but `architecture`), nested by their dots."""
        out: dict = {}
        for key, value in self.settings:
            if key == "architecture":
                continue
            *outer, last = key.split(".")
            where = out
            for k in outer:
                where = where.setdefault(k, {})
            where[last] = list(value) if isinstance(value, tuple) else value
        return out

    def source(self, weight: str) -> WeightSource:
        return next(s for s in self.sources if s.weight == weight)


# ---------------------------------------------------------------------------- steps


def mapped_shape(shape: tuple[int, ...], steps: tuple[Step, ...]) -> tuple[tuple[int, ...] | None, str]:
    """The shape after `steps`, or (None, why not)."""
    for st in steps:
        out = step_shape(STEPS[st.name], shape, st.arg)
        if isinstance(out, str):
            return None, out
        shape = out
    return shape, ""


def apply_steps(x: np.ndarray, steps: tuple[Step, ...]) -> np.ndarray:
    for st in steps:
        x = step_apply(STEPS[st.name], x, st.arg)
    return x


def mapped_grid(grid: Grid, steps: tuple[Step, ...]) -> tuple[Grid | None, list | str]:
    """A quantised tensor's grid after `steps` and, per step, what it does to the scales (None:
    the same as to the elements); or (None, why not)."""
    moves = []
    for st in steps:
        out = step_grid(STEPS[st.name], grid, st.arg)
        if isinstance(out, str):
            return None, f"`{st}`: {out}"
        grid, move = out
        moves.append(move)
    return grid, moves


def apply_pair(codes: np.ndarray, scales: np.ndarray, steps: tuple[Step, ...], moves: list):
    """(codes, scales) after `steps`; `moves` from `mapped_grid`."""
    for st, move in zip(steps, moves, strict=True):
        sd = STEPS[st.name]
        codes = step_apply(sd, codes, st.arg)
        scales = move(scales) if move is not None else step_apply(sd, scales, st.arg)
    return codes, scales


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
        out.append(CheckpointMap(d.format, tuple(sources), d.span, _check_settings(d, consts, rep)))
    return tuple(out)


def _check_settings(d, consts, rep: Reporter) -> tuple[tuple[str, object], ...]:
    """A section's `config { ... }` folded: each value a constant (a list: a tuple of them)."""
    out, seen = [], {}
    for s in getattr(d, "settings", ()):
        key = ".".join(s.key)
        if key in seen:
            rep.error(s.span, f"checkpoint {d.format}: config field `{key}` is set twice (first at line {seen[key]})")
            continue
        seen[key] = s.span.line
        if s.value is None:  # `null`: config.json's null (a feature the model does not have)
            out.append((key, None))
            continue
        exprs = s.value if isinstance(s.value, tuple) else (s.value,)
        values = [consts.eval(e) for e in exprs]
        if any(v is None for v in values):
            continue  # not a constant: consts reported why
        if key == "architecture" and not isinstance(values[0], str):
            rep.error(s.span, '`architecture` names a transformers class: a quoted word such as "LlamaForCausalLM"')
            continue
        out.append((key, tuple(values) if isinstance(s.value, tuple) else values[0]))
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
        alts = [_check_source(d.format, a, t, consts, rep, i > 0) for i, a in enumerate((e, *e.alternatives))]
        if all(a is not None for a in alts):
            sources.append(dataclasses.replace(alts[0], alternatives=tuple(alts[1:])))
    missing = [n for n, t in tensors.items() if t.kind == "weight" and n not in mapped]
    if missing:
        rep.error(
            d.span,
            f"checkpoint {d.format} does not say where {_list(missing)} come{'s' if len(missing) == 1 else ''} from",
            'a loader needs every weight: add `NAME = "tensor name"` lines',
        )
    return sources


def _check_source(fmt: str, e, t, consts, rep: Reporter, alternative: bool) -> WeightSource | None:
    """One source of an entry (the first, or an `or` alternative: a plain tensor may then feed a
    quantised weight, quantised at load), or None after reporting its mistakes."""
    plain_alternative = alternative and e.scales is None
    stack = _check_patterns(fmt, e, t, rep) if plain_alternative or _check_pair(fmt, e, t, rep) else None
    steps = tuple(s for s in (_check_step(fmt, st, consts, rep) for st in e.steps) if s is not None)
    if stack is None or len(steps) != len(e.steps):
        return None
    scales = e.scales[0] if e.scales is not None else None
    glob = e.glob[0] if e.glob is not None else None
    return WeightSource(e.weight, e.patterns, steps, stack, e.span, scales, glob)


def _list(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _check_pair(fmt: str, e, t, rep: Reporter) -> bool:
    """A quantised weight comes from a `"codes" * "scales"` pair, one pattern each."""
    if e.scales is not None and len(e.patterns) > 1:
        rep.error(e.scales[1], f"checkpoint {fmt}: `*` pairs one codes pattern with one scales pattern, not a list")
        return False
    if t.type.dtype.gguf and (e.scales is not None or len(e.patterns) > 1):
        rep.error(e.pattern_spans[0], f"checkpoint {fmt}: `{e.weight}` is {t.type.dtype}, one stored GGUF block tensor")
        return False
    if t.type.dtype.quantised and not t.type.dtype.gguf and e.scales is None:
        rep.error(
            e.pattern_spans[0],
            f"checkpoint {fmt}: `{e.weight}` is {t.type.dtype}, stored as codes and scales",
            'name both: `"codes name" * "scales name"`' + (' * "global scale name"' if _global(t) else ""),
        )
        return False
    if e.scales is not None and (e.glob is not None) != _global(t):
        span = e.glob[1] if e.glob is not None else e.scales[1]
        rep.error(
            span,
            f"checkpoint {fmt}: `{e.weight}` is {t.type.dtype}, "
            + ("which has a global scale: name it third" if _global(t) else "which has no global scale"),
            '`"codes" * "scales" * "global scale"`' if _global(t) else '`"codes" * "scales"`',
        )
        return False
    return True


def _global(t) -> bool:
    """The weight's format has a per-tensor global scale besides its codes and scales (nvfp4)."""
    return any(p.suffix == "global" for p in storage(t.type.dtype, (16, 1)))


def _check_patterns(fmt: str, e, t, rep: Reporter) -> tuple[str, ...] | None:
    """The stacking placeholders of the entry's patterns, or None after reporting a mistake."""
    found = None
    pairs = list(zip(e.patterns, e.pattern_spans, strict=True)) + [x for x in (e.scales, e.glob) if x is not None]
    for pattern, span in pairs:
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
            rep.error(span, "the patterns of a concatenation or a pair must use the same placeholders")
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
    optional = dict(sd.defaults)
    if len(st.args) > len(sd.params) or not set(sd.params) - set(optional) <= set(given):
        rep.error(st.span, f"`{st.name}` takes {_params(sd)}")
        return None
    args = dict(optional)
    for name, expr in given.items():
        v = consts.eval_int(expr, f"`{st.name}`'s `{name}`", minimum=0)
        if v is None:
            return None
        args[name] = v
    return Step(st.name, tuple((p, args[p]) for p in sd.params), st.span)


def _params(sd: StepDef) -> str:
    optional = dict(sd.defaults)
    names = [f"{p}={optional[p]}" if p in optional else p for p in sd.params]
    return f"({', '.join(names)})" if names else "no arguments"
