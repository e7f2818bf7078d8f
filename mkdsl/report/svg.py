"""plan.svg beside plan.md: the modeled step as a stacked bar by layer kind and cost kind, one
bar per layer kind, and the VMEM budget. Plain SVG written as text, deterministic (fixed
layout, numbers rounded the same way every time); every figure comes from the plan and its
breakdown (plan/breakdown.py). Each bar segment carries its figure (`data-us`, `data-bytes`)
so tests can check that the segments add up."""

from __future__ import annotations

import textwrap
from xml.sax.saxutils import escape, quoteattr

from mkdsl.lang.ir import Model
from mkdsl.plan.breakdown import COST_KINDS, Breakdown
from mkdsl.plan.types import Plan
from mkdsl.plan.vmem import MIB, VMEM_PER_CORE

COLOURS = {"stream": "#4e79a7", "compute": "#59a14f", "collectives": "#e15759", "fixed": "#f28e2b"}
# One colour per VMEM category, the same in every picture, none shared with a cost kind above.
VMEM_COLOURS = {
    "weight ring": "#76b7b2",
    "values": "#edc948",
    "fetched weights": "#b07aa1",
    "collectives": "#ff9da7",
    "outputs": "#9c755f",
    "op scratch": "#bab0ac",
}
# VMEM buffers by the planner's name prefix (plan/planner.py names them as the emitter does).
VMEM_GROUPS = {
    "ring": "weight ring",
    "v": "values",
    "carry": "values",
    "f": "fetched weights",
    "comm": "collectives",
    "logits": "outputs",
    "next": "outputs",
}
WIDTH, LEFT, RIGHT = 900, 20, 880  # the step bar spans LEFT..RIGHT
ROW_LEFT = 230  # per-layer-kind bars start here


def _num(x: float) -> str:
    return f"{x:.3f}"


def _rect(x: float, y: float, w: float, h: float, fill: str, tip: str, **data: str) -> str:
    attrs = "".join(f" data-{k}={quoteattr(v)}" for k, v in data.items())
    return (
        f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{h}" fill="{fill}" stroke="#fff" '
        f'stroke-width="0.5"{attrs}><title>{escape(tip)}</title></rect>'
    )


def _text(x: float, y: float, s: str, **attrs: str) -> str:
    extra = "".join(f" {k.replace('_', '-')}={quoteattr(v)}" for k, v in attrs.items())
    return f'<text x="{x:.2f}" y="{y}"{extra}>{escape(s)}</text>'


def _step_bar(b: Breakdown, y: int) -> list[str]:
    """One bar for the whole step: per graph, its cost kinds; graph names under their spans."""
    scale = (RIGHT - LEFT) / b.modeled_us
    out, x = [f'<g id="step" data-us="{_num(b.modeled_us)}">'], float(LEFT)
    spans: list[tuple[str, float, float]] = []
    for g in b.graphs:
        start = x
        for k in COST_KINDS:
            us = b.us(g, k)
            if us > 0:
                tip = f"{g}: {k} {us:.1f} us ({b.share(us)})"
                out.append(_rect(x, y, us * scale, 28, COLOURS[k], tip, graph=g, kind=k, us=_num(us)))
                x += us * scale
        spans.append((g, start, x))
    out.append("</g>")
    narrow = []
    for g, x0, x1 in spans:
        out.append(f'<path d="M{x0 + 1:.2f} {y + 30}v4H{x1 - 1:.2f}v-4" fill="none" stroke="#333"/>')
        name = "outside the layers" if g == "step" else g
        if x1 - x0 >= 7 * len(name):
            out.append(_text((x0 + x1) / 2, y + 46, name, text_anchor="middle"))
        else:  # too narrow for its name: numbered under the bar, named at its end
            narrow.append(f"{len(narrow) + 1} {name} {b.us(graph=g):.1f} us")
            out.append(_text((x0 + x1) / 2, y + 46, str(len(narrow)), text_anchor="middle", font_size="9"))
    if narrow:
        out.append(_text(RIGHT, y + 46, "; ".join(narrow), text_anchor="end", font_size="10"))
    return out


def _graph_bars(model: Model, b: Breakdown, y: int) -> list[str]:
    """A bar per layer kind (all its layers), on the step's scale, with its total."""
    scale = (RIGHT - 80 - ROW_LEFT) / b.modeled_us
    out = ['<g id="graphs">']
    for i, g in enumerate(b.graphs):
        row = y + 22 * i
        runs = model.schedule.count(g) if g != model.step.name else 1
        name = f"{g} x{runs}" if g != model.step.name else "outside the layers"
        out.append(_text(LEFT, row + 13, name))
        x = float(ROW_LEFT)
        for k in COST_KINDS:
            us = b.us(g, k)
            if us > 0:
                tip = f"{g}: {k} {us:.1f} us"
                out.append(_rect(x, row, us * scale, 16, COLOURS[k], tip, graph=g, kind=k, us=_num(us)))
                x += us * scale
        out.append(_text(x + 6, row + 13, f"{b.us(graph=g):.1f} us ({b.share(b.us(graph=g))})"))
    return [*out, "</g>"]


def _legend(b: Breakdown, y: int) -> list[str]:
    out, x = [], LEFT
    for k in COST_KINDS:
        out.append(f'<rect x="{x}" y="{y}" width="12" height="12" fill="{COLOURS[k]}"/>')
        if b.us(kind=k) == 0 and k not in ("stream", "compute"):
            continue  # nothing to show (no collectives on one device, no dispatch charged)
        shown = "hidden" if b.us(kind=k) == 0 else f"{b.us(kind=k):.1f} us"
        out.append(_text(x + 16, y + 10, f"{k} {shown}"))
        x += 210
    return out


def vmem_groups(plan: Plan) -> dict[str, int]:
    """VMEM bytes by what the buffers hold, largest first (ties by name)."""
    sizes: dict[str, int] = {}
    for a in plan.vmem:
        if a.memory == "VMEM":
            group = VMEM_GROUPS.get(a.name.split("_")[0].rstrip("0123456789"), "op scratch")
            sizes[group] = sizes.get(group, 0) + a.bytes
    return dict(sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])))


def _vmem_bar(plan: Plan, y: int) -> list[str]:
    scale = (RIGHT - LEFT) / VMEM_PER_CORE
    out = [
        _text(
            LEFT,
            y - 8,
            f"VMEM: {plan.vmem_total / MIB:.2f} MiB planned of the {plan.vmem_cap / MIB:.0f} MiB cap "
            f"({VMEM_PER_CORE / MIB:.0f} MiB per core)",
        ),
        f'<rect x="{LEFT}" y="{y}" width="{RIGHT - LEFT}" height="24" fill="#eee"/>',
        f'<g id="vmem" data-bytes="{plan.vmem_total}" data-cap="{plan.vmem_cap}">',
    ]
    x = float(LEFT)
    legend = []
    for group, size in vmem_groups(plan).items():
        colour = VMEM_COLOURS[group]
        out.append(
            _rect(x, y, size * scale, 24, colour, f"{group}: {size / MIB:.2f} MiB", group=group, bytes=str(size))
        )
        legend.append((colour, f"{group} {size / MIB:.2f} MiB"))
        x += size * scale
    cap = LEFT + plan.vmem_cap * scale
    out += [
        "</g>",
        f'<line x1="{cap:.2f}" y1="{y - 4}" x2="{cap:.2f}" y2="{y + 28}" stroke="#000" stroke-dasharray="4 2"/>',
    ]
    out.append(_text(cap - 4, y - 8, f"cap {plan.vmem_cap / MIB:.0f} MiB", text_anchor="end"))
    for i, (colour, text) in enumerate(legend):
        lx, ly = LEFT + 215 * (i % 4), y + 40 + 18 * (i // 4)
        out += [f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{colour}"/>', _text(lx + 16, ly + 10, text)]
    return out


def render_svg(model: Model, plan: Plan, b: Breakdown, verdict: str) -> str:
    """The picture; deterministic for the same plan."""
    where = f", one of {plan.devices} devices" if plan.mesh else ""
    profile = f" (profile {model.profile})" if model.profile else ""
    title = f"{model.name}{profile}, batch {plan.batch}{where}: modeled step {b.modeled_us:.1f} us"
    lines = textwrap.wrap(verdict.replace("`", ""), 130)
    y = 40 + 16 * len(lines)
    body = [_text(LEFT, 20, title, font_weight="bold")]
    body += [_text(LEFT, 38 + 16 * i, line) for i, line in enumerate(lines)]
    body += _step_bar(b, y)
    body += _legend(b, y + 58)
    rows = y + 86
    body += _graph_bars(model, b, rows)
    vmem = rows + 22 * len(b.graphs) + 30
    body += _vmem_bar(plan, vmem)
    height = vmem + 40 + 18 * ((len(vmem_groups(plan)) + 3) // 4) + 10
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
            f"<title>{escape(title)}</title>",
            f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>',
            *body,
            "</svg>",
            "",
        ]
    )
