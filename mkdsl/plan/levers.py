"""Levers not pulled yet, each priced by the cost model: `mkdsl plan SPEC --levers` re-plans the step
with one change at a time and prints the modeled step beside the plan's. Every figure is *modeled*
(plan/cost_model.py, plan/collectives.py); nothing here changes what `mkdsl compile` emits. Every
row, the `plan` row too, is planned with the cost model's options `mkdsl plan` was given
(`--static-costs`, `--steps-per-call`), so the `plan` row is the step `mkdsl plan` prints.

- `ring`: the deepest weight ring that still fits the VMEM cap at the spec's largest batch (the
  `ring_depth` hint): more tiles in flight land during the exchanges.
- `placement`: every split `mkdsl plan --placement` chooses, together (plan/placement.py).
- `fuse`: collectives of one layer that are ready together (none needs another's result) run as
  one exchange: phase by phase, one message to every peer of any member, one latency for the
  union of their peers, all their bytes (`ready_together`); the fused exchange waits where the
  last member is. The plan already runs the first phases of the groups the runtime can fuse as
  one (plan/collectives.py `fuse_ready`), so this prices only what is left: the later phases of
  each group together, and the groups the runtime does not fuse (a mask used twice, two chip-first
  all-reduces, an all-reduce carrying an adjacent one); no change where nothing is left.
(Several steps per device call are no lever of the model: the ~70 us of dispatch, glue and barrier
were measured per step in runs of 16 steps per call; plan/measured.py.)
- `all`: all of them together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mkdsl.lang.diagnostics import SpecError
from mkdsl.lang.ir import Model
from mkdsl.plan.fusion import fused_phases
from mkdsl.plan.planner import make_plan
from mkdsl.spmd.shard import shard

MAX_DEPTH = 64  # the ring search stops here


@dataclass(frozen=True)
class Lever:
    name: str
    what: str
    modeled_us: float
    exchange_phases: int
    moved_bytes: int  # the schedule's bytes per core per step


def deepest_ring(model: Model, context: int | None, start: int) -> int:
    """The deepest ring (from `start`) whose plan at the largest batch fits the VMEM cap."""
    high, depth = model.dims[0].high, start
    while depth < MAX_DEPTH:
        try:
            make_plan(model, batch=high, context=context, ring_depth=depth + 1)
        except SpecError:
            break
        depth += 1
    return depth


def _placed(whole: Model, batch: int, context: int | None, options: dict) -> tuple[Model, str]:
    from mkdsl.plan import placement

    table = placement.choose(whole, batch, context, **options)
    moved = [c for rows in table if (c := placement.best(rows)) is not rows[0]]
    names = {c.tensor: c for c in moved}
    sharding = {c.tensor: c.sharding for c in moved}
    tensors = tuple(dataclasses.replace(t, sharding=sharding[t.name]) if t.name in names else t for t in whole.tensors)
    what = "; ".join(f"`{c.tensor}` {c.split}" for c in moved) or "nothing moves"
    return dataclasses.replace(whole, tensors=tensors), what


def _lever(name: str, what: str, local: Model, batch: int, context, depth: int, **options) -> Lever:
    plan = make_plan(local, batch=batch, context=context, ring_depth=depth, **options)  # later options win
    found = list(plan.collectives)
    phases = fused_phases(local, found) if options.get("fuse_ready") else plan.exchange_phases
    return Lever(name, what, plan.timing.modeled_us, phases, plan.schedule_bytes)


def levers(whole: Model, batch: int = 1, context: int | None = None, **options) -> list[Lever]:
    """The plan's step, then each lever alone, then all of them together. `options`: the cost
    model's (`static`, `steps_per_call`), as `mkdsl plan` was given them; every row uses them."""
    local = shard(whole)
    depth = make_plan(local, batch=whole.dims[0].high, context=context).ring_depth  # the kernel's ring
    deep = deepest_ring(local, context, depth)
    placed, moved = _placed(whole, batch, context, options)
    placed_local = shard(placed)
    placed_depth = deepest_ring(placed_local, context, 3)
    ring = f"ring of {deep} banks instead of {depth}" if deep > depth else f"no deeper ring fits ({depth} banks)"
    fuse = {**options, "fuse_ready": True}
    return [
        _lever("plan", "the spec as it is", local, batch, context, depth, **options),
        _lever("ring", ring, local, batch, context, deep, **options),
        _lever("placement", moved, placed_local, batch, context, depth, **options),
        _lever("fuse", "ready-together collectives, every phase shared", local, batch, context, depth, **fuse),
        _lever(
            "all",
            f"all of them (ring of {placed_depth} banks with the placement)",
            placed_local,
            batch,
            context,
            placed_depth,
            **fuse,
        ),
    ]


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def render(whole: Model, rows: list[Lever], batch: int) -> str:
    """The table `mkdsl plan --levers` prints: every figure modeled."""
    base = rows[0].modeled_us
    out = [
        f"{whole.name}: levers not pulled, batch {batch}, each re-planning the whole step (all times modeled)",
        "",
        "| lever | what | modeled step us | vs plan | exchange phases | moved per core per step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        delta = "" if r is rows[0] else f"{r.modeled_us - base:+.1f} us"
        out.append(
            f"| {r.name} | {r.what} | {r.modeled_us:.1f} | {delta} | {r.exchange_phases} | {_size(r.moved_bytes)} |"
        )
    return "\n".join(out)
