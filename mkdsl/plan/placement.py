"""Placement by the cost model: for each weight a core reads above its 1/N share of the mesh, try
the splits that would bring it closer (rows or columns over more mesh axes), re-shard and re-plan
the whole step with each, and keep the one whose *modeled* step is fastest: the exchanges a split
adds (plan/collectives.py) against the stream time its bytes save (plan/cost_model.py). The
spec's `@` annotations are the starting point; `mkdsl plan --placement` prints the comparison,
each row the kernel's plan (its ring sized for the largest batch) with the cost model's options
`mkdsl plan` was given (`--static-costs`, `--steps-per-call`).

Only splits the language already lowers are tried (rows or columns over each set of mesh axes
that divides the weight more than the spec does; a `linear`'s weight split by rows gives
partial sums and an all-reduce; by columns a split output and, where an op needs it whole, an
all-gather); a split that the planner rejects (lanes, tiles) is reported as such.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.ir import Model, Tensor
from mkdsl.plan.planner import make_plan
from mkdsl.plan.types import Plan
from mkdsl.spmd.shard import ShardError, shard


@dataclass(frozen=True)
class Choice:
    """One candidate placement of one weight: its per-core bytes per step and the modeled step."""

    tensor: str
    split: str  # how, in `@` notation: "[H @(ep, tp), QR]"
    core_bytes: int  # what a core must read of it per step (its slice, without storage padding)
    exchange_phases: int  # of the whole step
    modeled_us: float  # the whole step, or 0 when the planner rejects the split
    error: str = ""
    sharding: tuple = ()  # the tensor's sharding, per dim the mesh axes it is split over
    step_bytes: int = 0  # what the schedule moves per core per step, padded tiles included


def _notation(t: Tensor, sharding) -> str:
    dims = [f"{d}{' @(' + ', '.join(a) + ')' if a else ''}" for d, a in zip(t.type.shape, sharding, strict=True)]
    return "[" + ", ".join(dims) + "]"


def candidates(model: Model, t: Tensor) -> list[tuple[tuple[str, ...], ...]]:
    """Shardings of a 2-D weight: whole, or by rows or by columns over each set of mesh axes
    (mesh order), fewer ways than the spec's too (a deeper ring can make an exchange cost more
    than the bytes it saves); the spec's own placement is left out."""
    if len(t.type.shape) != 2:
        return []
    names = [name for name, _ in model.mesh]
    subsets = [tuple(a for i, a in enumerate(names) if mask >> i & 1) for mask in range(1, 1 << len(names))]
    out = [((), ())] + [s for axes in subsets for s in ((axes, ()), ((), axes))]
    return [s for s in out if s != tuple(t.sharding)]


def over_share(model: Model, local: Model) -> list[Tensor]:
    """The 2-D weights a core holds more of than 1/N (N devices), largest excess first."""
    n = math.prod(size for _, size in model.mesh)
    out = []
    for t in model.tensors:
        if t.kind != "weight" or len(t.type.shape) != 2:
            continue
        whole, mine = math.prod(t.type.shape), math.prod(local.tensor(t.name).type.shape)
        if mine * n > whole:
            out.append((mine - whole / n, t))
    return [t for _, t in sorted(out, key=lambda x: -x[0])]


def kernel_plan(local: Model, batch: int, context: int | None, **options) -> Plan:
    """The step at `batch` of the kernel `mkdsl compile` emits, whose ring is sized for the largest
    batch (as `mkdsl plan` plans it); `options` are the cost model's (`static`, `steps_per_call`)."""
    high = local.dims[0].high
    depth = None if batch == high else make_plan(local, batch=high, context=context).ring_depth
    return make_plan(local, batch=batch, context=context, ring_depth=depth, **options)


def evaluate(model: Model, name: str, sharding, batch: int, context: int | None, **options) -> Choice:
    """Re-shard with `name` placed as `sharding` and plan the step."""
    t = model.tensor(name)
    tensors = tuple(dataclasses.replace(x, sharding=sharding) if x.name == name else x for x in model.tensors)
    moved = dataclasses.replace(model, tensors=tensors)
    note = _notation(t, sharding)
    try:
        local = shard(moved)
        plan = kernel_plan(local, batch, context, **options)
    except (SpecError, ShardError) as e:
        return Choice(name, note, 0, 0, 0.0, str(e).splitlines()[0][:120] or type(e).__name__)
    read = next((x.bytes for x in plan.traffic if x.name == name), 0)
    return Choice(
        name,
        note,
        read,
        plan.exchange_phases,
        plan.timing.modeled_us,
        sharding=sharding,
        step_bytes=plan.schedule_bytes,
    )


def choose(model: Model, batch: int = 1, context: int | None = None, **options) -> list[list[Choice]]:
    """Per weight above its share: the spec's placement first, then each candidate. `options`: the
    cost model's, as `make_plan` takes them (`static`, `steps_per_call`)."""
    local = shard(model)
    out = []
    for t in over_share(model, local):
        rows = [evaluate(model, t.name, t.sharding, batch, context, **options)]
        rows += [evaluate(model, t.name, s, batch, context, **options) for s in candidates(model, t)]
        out.append(rows)
    return out


def best(rows: list[Choice]) -> Choice:
    """The fastest planned placement of one weight (the spec's when nothing beats it)."""
    return min((c for c in rows if not c.error), key=lambda c: c.modeled_us)


def render(model: Model, table: list[list[Choice]], batch: int) -> str:
    """The comparison `mkdsl plan --placement` prints: every figure modeled."""
    lines = [
        f"{model.name}: placements of the weights a core reads above its 1/N share, batch {batch} "
        "(each row re-plans the whole step; all times modeled)",
        "",
        "| weight | split | its bytes per core per step | step moves per core | exchange phases | modeled step us "
        "| vs spec |",
        "|---|---|---|---|---|---|---|",
    ]
    if not table:
        return lines[0] + "\n\nEvery weight is split over the whole mesh (or the model is not sharded): nothing to try."
    for rows in table:
        base = rows[0].modeled_us
        for i, c in enumerate(rows):
            if c.error:
                lines.append(f"| `{c.tensor}` | {c.split} | | | | rejected: {c.error} | |")
                continue
            delta = "spec" if i == 0 else f"{c.modeled_us - base:+.1f} us"
            lines.append(
                f"| `{c.tensor}` | {c.split} | {c.core_bytes / 1e6:.2f} MB | {c.step_bytes / 1e9:.2f} GB | "
                f"{c.exchange_phases} | {c.modeled_us:.1f} | {delta} |"
            )
    chosen = [best(rows) for rows in table]
    moved = [c for c, rows in zip(chosen, table, strict=True) if c is not rows[0]]
    lines += [
        "",
        "The cost model chooses: "
        + ("; ".join(f"`{c.tensor}` {c.split}" for c in moved) or "the spec's placement of every one")
        + ".",
    ]
    return "\n".join(lines)
