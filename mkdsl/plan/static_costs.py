"""The static schedule as the cost model's compute: `mkdsl plan --static --save-costs FILE`.

libtpu's final bundles name no op, so each loop that waits for bytes is matched to the ops by
its bytes per iteration: a `linear` column block waits for its `nk` tiles, an `attention` KV tile
for one K and one V tile, an `mla_attention` tile for one latent-cache tile. A loop whose bytes
match one op kind gives that op its compute / stream ratio (the slowest such loop, as the loop
that binds); ambiguous and unmatched loops are listed, not used. The file is what
`mkdsl plan --static-costs FILE` reads (plan/cost_model.py). Every figure stays *modeled*.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from mkdsl.ir import Model
from mkdsl.plan.types import Plan


def _attention_unit(model: Model, node, kv_tile: int) -> int:
    kc = model.tensor(node.inputs[3].name).type
    vc = model.tensor(node.inputs[4].name).type
    kvh = 1 if node.attr.get("kv_axes") else kc.shape[1]
    return kv_tile * kvh * (kc.shape[3] * kc.dtype.bits + vc.shape[3] * vc.dtype.bits) // 8


def _mla_unit(model: Model, node, kv_tile: int) -> int:
    cache = model.tensor(node.arg("cache").name).type
    return kv_tile * cache.shape[2] * cache.dtype.bits // 8


UNITS = {"attention": _attention_unit, "mla_attention": _mla_unit}  # op -> bytes one loop iteration waits for


def loop_units(model: Model, plan: Plan) -> dict[int, set[str]]:
    """Bytes per loop iteration -> the op kinds whose loop waits for that many."""
    out: dict[int, set[str]] = defaultdict(set)
    for seq in plan.sequences:
        for st in seq.streams:
            if st.nn > 1 and st.fmt == "bf16":
                out[st.k * st.tn * 2].add("linear")
    for g in (*model.kinds, model.step):
        for node in g.nodes:
            unit = UNITS.get(node.op)
            if unit is not None:
                out[unit(model, node, plan.kv_tile)].add(node.op)
    return out


def ratios(model: Model, plan: Plan, timings) -> tuple[dict[str, float], list[tuple[int, str]]]:
    """(op -> compute / stream of its slowest matched loop, [(loop address, why not used)])."""
    units = loop_units(model, plan)
    found: dict[str, float] = {}
    skipped = []
    for t in timings:
        if not t.self_bytes or t.ratio is None:
            continue
        ops = units.get(t.self_bytes, set())
        if len(ops) != 1:
            skipped.append((t.address, f"{t.self_bytes} bytes: " + (" or ".join(sorted(ops)) or "no op")))
            continue
        (op,) = ops
        found[op] = max(found.get(op, 0.0), t.ratio)
    return found, skipped


def save(path: Path, found: dict[str, float], skipped, clock_hz: float, source: str) -> None:
    data = {
        "source": source,
        "clock_hz": clock_hz,
        "compute_over_stream": dict(sorted(found.items())),
        "unmatched_loops": [f"{a:#x}: {why}" for a, why in skipped],
    }
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
