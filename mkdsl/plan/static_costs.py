"""The static schedule as the cost model's compute: `mkdsl plan --static --save-costs FILE`.

libtpu's final bundles name no op, so each loop that waits for bytes is matched to the ops by
its bytes per iteration: a `linear` column block waits for its `nk` tiles, a loop over its tiles
for one (keyed by its weight: `linear:NAME`), an `attention` KV tile for one K and one V tile, an `mla_attention` tile for one
latent-cache tile (lane-padded), a `moe_experts` tile set for one tile of each expert matrix. A
loop whose bytes match one key gives it its compute / stream ratio (the slowest such loop, as the
loop that binds), its compute being the loop's whole body with nested loops counted once (a
floor: their trip counts are not in the dump); ambiguous and unmatched loops are listed, not used. The file is what
`mkdsl plan --static-costs FILE` reads (plan/cost_model.py). Every figure stays *modeled*.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from mkdsl.lang.dtypes import storage_bytes
from mkdsl.lang.ir import Model
from mkdsl.ops import OPS
from mkdsl.plan.types import Plan


def _attention_unit(model: Model, node, kv_tile: int) -> int:
    kc = model.tensor(node.inputs[3].name).type
    vc = model.tensor(node.inputs[4].name).type
    kvh = 1 if node.attr.get("kv_axes") else kc.shape[1]
    return kv_tile * kvh * (kc.shape[3] * kc.dtype.bits + vc.shape[3] * vc.dtype.bits) // 8


def _mla_unit(model: Model, node, kv_tile: int) -> int:
    cache = model.tensor(node.arg("cache").name).type
    return kv_tile * -(-cache.shape[2] // 128) * 128 * cache.dtype.bits // 8  # tiles are whole lanes wide


def _experts_unit(model: Model, node, kv_tile: int) -> int:
    from mkdsl.backends.tpu.lowerings.moe import moe_tiling

    tn, _, _ = moe_tiling(model, node)
    if tn is None:
        return 0
    ws = [model.tensor(node.arg(w).name).type for w in ("w1", "w3", "w2")]
    d = ws[0].shape[1]
    return sum(storage_bytes(w.dtype, (d, tn) if i < 2 else (tn, d)) for i, w in enumerate(ws))


# the op's `loop_unit` trait -> bytes one iteration of its hot loop waits for
UNITS = {"kv_tiles": _attention_unit, "latent_tiles": _mla_unit, "expert_tiles": _experts_unit}


def _stream_op(model: Model, seq: str, value: str) -> str:
    """The op of the node that produces `value` in the graph of sequence `seq`."""
    g = model.step if seq in ("prologue", "epilogue") else model.kind(seq)
    return next(n.op for n in g.nodes if n.outputs and n.outputs[0].name == value)


def loop_units(model: Model, plan: Plan) -> dict[int, set[str]]:
    """Bytes per loop iteration -> the op kinds whose loop waits for that many."""
    out: dict[int, set[str]] = defaultdict(set)
    for seq in plan.sequences:
        for st in seq.streams:
            if st.fmt == "bf16":  # a loop over column blocks waits for nk tiles, one over tiles for one
                key = f"{_stream_op(model, seq.name, st.node)}:{st.tensor}"
                if st.nn > 1:
                    out[st.k * st.tn * 2].add(key)
                if st.tiles > 1:
                    out[st.tk * st.tn * 2].add(key)
    for g in (*model.kinds, model.step):
        for node in g.nodes:
            unit = UNITS.get(OPS[node.op].loop_unit) if node.op in OPS else None
            if unit is not None:
                out[unit(model, node, plan.kv_tile)].add(node.op)
    return out


def ratios(model: Model, plan: Plan, timings) -> tuple[dict[str, float], list[tuple[int, str]]]:
    """(key -> compute / stream of its slowest matched loop, [(loop address, why not used)])."""
    units = loop_units(model, plan)
    found: dict[str, float] = {}
    skipped = []
    for t in timings:
        if not t.self_bytes or t.ratio is None:
            continue
        keys = units.get(t.self_bytes, set())
        kinds = {k.split(":")[0] for k in keys}
        if len(kinds) != 1:
            skipped.append((t.address, f"{t.self_bytes} bytes: " + (" or ".join(sorted(kinds)) or "no op")))
            continue
        ratio = t.ratio * t.bundles / t.self_bundles  # the whole body, nested loops once
        for key in keys:  # streams of the same block size share the loop's figure
            found[key] = max(found.get(key, 0.0), ratio)
    return found, skipped


def layer_code_us(timings) -> float | None:
    """The layer loop's own code (outside the tile loops nested in it) in us, on its longest path:
    the depth-1 loop that holds the most. With several layer kinds the path is the longest kind's
    (a conservative figure for the others)."""
    outer = [t for t in timings if t.depth == 1 and t.bundles > t.self_bundles]
    if not outer:
        return None
    return max(outer, key=lambda t: t.bundles).compute_s * 1e6


def save(path: Path, found: dict[str, float], skipped, clock_hz: float, source: str, code_us=None, sha="") -> None:
    data = {
        "source": source,
        **({"spec_sha256": sha} if sha else {}),
        "clock_hz": clock_hz,
        "compute_over_stream": dict(sorted(found.items())),
        **({"layer_code_us": code_us} if code_us is not None else {}),
        "unmatched_loops": [f"{a:#x}: {why}" for a, why in skipped],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # nothing half-written


def load(path: Path) -> dict[str, float]:
    """The cost model's `static` from a file `save` wrote: op -> ratio, and `layer_code_us` if read.
    Raises ValueError (or OSError) on anything else."""
    data = json.loads(path.read_text(encoding="utf-8"))
    try:
        static = {str(k): float(v) for k, v in data["compute_over_stream"].items()}
        if "layer_code_us" in data:
            static["layer_code_us"] = float(data["layer_code_us"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a JSON object with `compute_over_stream` (op -> number): {e}") from None
    return static


COSTS_DIR = "costs"  # specs/costs/<spec stem>.json: what `mkdsl static-costs` writes


def default_path(spec_path: str) -> Path:
    """Where the committed static costs of a spec live: beside it, in costs/<stem>.json."""
    spec = Path(spec_path)
    return spec.parent / COSTS_DIR / f"{spec.stem}.json"


def default_costs(spec_path: str, profile: str | None) -> tuple[dict[str, float] | None, str]:
    """(static, its source) for `mkdsl plan SPEC` and `compile` with no flag: the committed file of
    the spec's own sizes (a profile changes the shapes: none), else (None, why)."""
    path = default_path(spec_path)
    if profile is not None:
        return None, f"profile {profile}: no static costs (they are read at the spec's own sizes)"
    if not path.is_file():
        return None, f"the per-op estimate (no {COSTS_DIR}/{path.name} beside the spec)"
    from mkdsl.lang.elaborate import spec_sha256

    sha = json.loads(path.read_text(encoding="utf-8")).get("spec_sha256")
    current = spec_sha256(Path(spec_path).read_text(encoding="utf-8"))
    stale = " (read from an earlier version of the spec: `mkdsl static-costs` renews it)" if sha != current else ""
    return load(path), f"libtpu's schedule, {COSTS_DIR}/{path.name}{stale}"
