"""A drafter's target context: `context NAME at POS from layers 24, 48, 72, 88, 92`.

A block drafter (Kimi K3's DSpark) reads, for each row its step adds, the hidden states the
target computed at chosen layers, concatenated. The declaration names the state tensor that
holds them ([B, n * W]: n layers of width W each), the i32 state [B] holding their positions (-1:
no row) and the target layers, so that the host knows
what to ask the target for and where to write it before each step (docs/language.md, "Drafters").
"""

from __future__ import annotations

from mkdsl.lang.diagnostics import Reporter
from mkdsl.lang.ir import Tensor
from mkdsl.lang.syntax import ContextDecl

MAX_CONTEXT_LAYERS = 64  # far above any published drafter (EAGLE-3 reads 3 layers, DSpark 5)


def check_context(decls: list[ContextDecl], tensors: dict[str, Tensor], consts, rep: Reporter):
    """The declared context: (rows' state, positions' state, target layer ids), or None without one."""
    if not decls:
        return None
    for dup in decls[1:]:
        rep.error(dup.span, f"second `context` declaration (first at line {decls[0].span.line})")
    d = decls[0]
    layers = tuple(consts.eval_int(e, "a context layer", minimum=0) for e in d.layers)
    if None in layers:
        return None
    if len(layers) > MAX_CONTEXT_LAYERS:
        rep.error(d.span, f"{len(layers)} context layers: at most {MAX_CONTEXT_LAYERS}")
        return None
    if len(set(layers)) != len(layers):
        rep.error(d.span, f"context layers {', '.join(map(str, layers))} name a layer twice")
        return None
    t = tensors.get(d.name)
    hint = f"declare it: `state {d.name}: f32[B, {len(layers)} * H]` (one row per step row)"
    if t is None:
        rep.error(d.span, f"the context `{d.name}` is not a declared state tensor", hint)
        return None
    if t.kind != "state" or t.stacked or len(t.type.shape) != 2 or not t.type.dtype.float:
        rep.error(d.span, f"the context `{d.name}` must be a float state [rows, n * width], not per layer", hint)
        return None
    width = t.type.shape[1]
    if isinstance(width, int) and width % len(layers):
        rep.error(d.span, f"the context `{d.name}` is {t.type}: {width} columns do not hold {len(layers)} layers")
        return None
    p = tensors.get(d.positions)
    if p is None or p.kind != "state" or p.stacked or p.type.dtype.name != "i32" or p.type.shape != t.type.shape[:1]:
        rep.error(
            d.span,
            f"the context's positions `{d.positions}` must be a state i32[{t.type.shape[0]}] (one per context row)",
            f"declare it: `state {d.positions}: i32[{t.type.shape[0]}]`",
        )
        return None
    return d.name, d.positions, layers
