"""Where the modeled time goes, three ways: a section of plan.md, the short terminal summary of
`mkdsl plan`, and the plan as data (`mkdsl plan --json`, docs/plan-schema.json). Every figure
comes from the planner and the cost model (plan/breakdown.py); none is measured."""

from __future__ import annotations

import textwrap

from mkdsl.lang.ir import Model
from mkdsl.plan.breakdown import COST_KINDS, Breakdown, Cost
from mkdsl.plan.hbm import hbm_line
from mkdsl.plan.types import Plan
from mkdsl.plan.vmem import MIB

SCHEMA = "mkdsl-plan/1"  # the `schema` field of `mkdsl plan --json`; docs/plan-schema.json
WIDTH = 100  # terminal summary lines stay within this


def label(graph: str) -> str:
    return "the step outside the layers" if graph == "step" else f"`{graph}` layers"


def _hidden(b: Breakdown, plan: Plan) -> str:
    t = plan.timing
    return f"{t.overlap_us:.1f} us of stream and compute overlap each other or the exchanges"


def verdict(model: Model, b: Breakdown, plan: Plan) -> str:
    """One line: what bounds the step, with its share; the rest; the largest part."""
    kinds = sorted((k for k in COST_KINDS if b.us(kind=k) > 0), key=lambda k: -b.us(kind=k))
    names = {"stream": "weight and state streaming", "compute": "compute", "fixed": "fixed costs"}
    rest = ", ".join(f"{names.get(k, k)} {b.share(b.us(kind=k))}" for k in kinds[1:])
    graph = max(b.graphs, key=lambda g: b.us(graph=g))
    layers = f" ({model.schedule.count(graph)} of {len(model.schedule)})" if graph != model.step.name else ""
    return (
        f"Bound by {names.get(kinds[0], kinds[0])}: {b.share(b.us(kind=kinds[0]))} of the modeled "
        f"{b.modeled_us:.1f} us step ({rest}{'; ' if rest else ''}{_hidden(b, plan)}); "
        f"{label(graph)}{layers} {'takes' if graph == model.step.name else 'take'} {b.share(b.us(graph=graph))}."
    )


def headline(plan: Plan) -> str:
    """The step with its range: the conservative reading, and what the optimistic one grants."""
    t = plan.timing
    spans = next((a for a in t.assumptions if a.spans_range), None)
    if spans is None or t.modeled_us - t.optimistic_us < 0.05:
        return f"Step {t.modeled_us:.1f} us (conservative; no unmeasured overlap changes it)"
    return (
        f"Step {t.modeled_us:.1f} us (conservative; range {t.optimistic_us:.1f} .. {t.modeled_us:.1f} us, spanned by "
        f"`{spans.name}`)"
    )


def assumption_lines(plan: Plan) -> list[str]:
    """One line per assumption no measurement supports, with the us that rest on it; then where the
    constants and the compute came from."""
    t = plan.timing
    out = [f"- `{a.name}` ({a.effect_us:.1f} us): {a.what}" for a in t.assumptions]
    return [
        *out,
        f"- constants: {t.constants}; compute: {t.compute_from}; the ~{t.fixed_us:.0f} us of dispatch, glue and "
        "barrier per step (measured per step, not shared by several steps per call)",
    ]


def assumptions_section(plan: Plan, spec_path: str) -> list[str]:
    """The plan.md section: the range and every assumption with its effect, and the command that
    gives the same figures."""
    command = f"mkdsl plan {spec_path}{f' --profile {plan.profile}' if plan.profile else ''} --batch {plan.batch} --context {plan.context}"
    return [
        "## Assumptions (modeled)",
        "",
        f"**{headline(plan)}** (`{command}`). The headline is the conservative reading; each assumption below "
        "goes beyond a measurement, with the modeled us that rest on it:",
        "",
        *assumption_lines(plan),
        "",
    ]


def _cell(b: Breakdown, graph: str | None, kind: str) -> str:
    return f"{b.us(graph, kind):.1f}"


def _cost_line(c: Cost) -> str:
    runs = f" x{c.runs}" if c.graph != "step" else ""
    return f"{label(c.graph)}{runs}: {c.what}{f' (line {c.line})' if c.line else ''}"


def time_section(model: Model, plan: Plan, b: Breakdown) -> list[str]:
    """The plan.md section: verdict, picture, time per layer kind and cost kind, top 5 costs."""
    head = "| part | layers | " + " | ".join(COST_KINDS) + " | total | share | per layer |"
    out = [
        "## Where the time goes (modeled, conservative)",
        "",
        f"**{verdict(model, b, plan)}**",
        "",
        "![The modeled step by layer kind and cost kind, and the VMEM budget](plan.svg)",
        "",
        "Modeled us per step, phase by phase in the kernel's order: each op is charged what it waits for "
        "(its bytes not yet landed, or its compute), each collective its exchange phases; the weight ring's "
        "tiles in flight land during compute and exchanges; fixed: dispatch, glue and barrier, per step.",
        "",
        head,
        "|---|---|" + "---|" * len(COST_KINDS) + "---|---|---|",
    ]
    for g in b.graphs:
        runs = model.schedule.count(g) if g != model.step.name else 1
        cells = " | ".join(_cell(b, g, k) for k in COST_KINDS)
        total = b.us(graph=g)
        out.append(f"| {label(g)} | {runs} | {cells} | {total:.1f} | {b.share(total)} | {total / runs:.1f} |")
    cells = " | ".join(_cell(b, None, k) for k in COST_KINDS)
    out += [f"| **step** | {len(model.schedule)} | {cells} | {b.modeled_us:.1f} | 100.0% | |", ""]
    out += ["Top 5 costs:", "", "| # | cost | kind | modeled us | share |", "|---|---|---|---|---|"]
    for i, c in enumerate(b.top(), 1):
        out.append(f"| {i} | {_cost_line(c)} | {c.kind} | {c.us:.1f} | {b.share(c.us)} |")
    return [*out, ""]


def render_summary(model: Model, plan: Plan, spec_path: str, b: Breakdown) -> str:
    """The terminal summary of `mkdsl plan`: a screenful, lines of at most WIDTH characters."""
    t = plan.timing
    where = f", one of {plan.devices} devices" if plan.mesh else ""
    out = [
        f"{model.name}{f' (profile {model.profile})' if model.profile else ''} from {spec_path}{where}: batch {plan.batch} "
        f"(rows padded to {plan.rows}), {plan.context} cached tokens per row. All times modeled.",
        f"{headline(plan)}, HBM floor {t.floor_us:.1f} us ({t.modeled_us / t.floor_us:.3f} x); "
        f"{t.tokens_per_s:.1f} tokens/s per sequence; VMEM {plan.vmem_total / MIB:.1f} of "
        f"{plan.vmem_cap / MIB:.0f} MiB.",
        *textwrap.wrap(hbm_line(plan) + ".", WIDTH),
        verdict(model, b, plan),
        "",
        f"{'part':<24}{'layers':>7}" + "".join(f"{k:>12}" for k in COST_KINDS) + f"{'total':>10}{'share':>8}",
    ]
    for g in (*b.graphs, None):
        runs = len(model.schedule) if g is None else model.schedule.count(g) if g != model.step.name else 1
        total = b.us(graph=g)
        cells = "".join(f"{_cell(b, g, k):>12}" for k in COST_KINDS)
        name = "step" if g is None else "outside the layers" if g == model.step.name else g
        out.append(f"{name:<24.24}{runs:>7}{cells}{total:>10.1f}{b.share(total):>8}")
    out += ["", "Top 5 costs (modeled us per step):"]
    for i, c in enumerate(b.top(), 1):
        out.append(f"{i}. {c.us:9.1f} us {b.share(c.us):>6}  {_cost_line(c)}")
    rest = ", ".join(f"{a.name} {a.effect_us:.1f}" for a in t.assumptions)
    out += ["", f"Assumptions no measurement supports (us resting on each; `--full` says what each is): {rest}."]
    out += ["", "More: `mkdsl plan --full` (the whole report, as plan.md), `--json` (the plan as data)."]
    return "\n".join(part for line in out for part in (textwrap.wrap(line, WIDTH) if len(line) > WIDTH else [line]))


def plan_data(model: Model, plan: Plan, spec_path: str, b: Breakdown) -> dict:
    """The plan as data for `mkdsl plan --json`, in the shape docs/plan-schema.json documents."""
    return {
        "schema": SCHEMA,
        "spec": spec_path,
        "model": model.name,
        "profile": model.profile,
        "devices": plan.devices,
        "plan": plan.as_dict(),
        "verdict": verdict(model, b, plan),
        "breakdown": b.as_dict(),
    }
