"""The step as the cost model sees it: phases in the kernel's order, built from the plan's pieces
(schedule items, op costs, collectives), then timed by plan/cost_model.py. Every figure is
*modeled*.

One phase per op that streams or computes and per collective, in graph order; the weights a
graph fetches whole (norm vectors) form one op-issued phase at its start. The step runs its
prologue, each layer of the schedule, then its epilogue.
"""

from __future__ import annotations

import re
from collections import defaultdict

from mkdsl.backends.tpu.lowering import Site
from mkdsl.lang.ir import Graph
from mkdsl.ops import OPS
from mkdsl.plan import cost_model
from mkdsl.plan.cost_model import Phase
from mkdsl.plan.nodes import concrete, cost_attrs, streamed_weight
from mkdsl.plan.types import Assumption, PhaseCost, ScheduleItem, Timing


def _types(s, g: Graph, node):
    dims = [d.name for d in s.model.dims]
    sizes = {dims[0]: s.rows, **{d: s.context + 1 for d in dims[1:]}}
    return [concrete(s.type_of(g, r), sizes) for r in node.inputs], [concrete(v.type, sizes) for v in node.outputs]


def node_flops(s, g: Graph, i: int) -> int:
    """Flops of one run of node i of graph g at the padded rows (as the old global MXU term)."""
    node = g.nodes[i]
    if node.op not in OPS:
        return 0
    types, outs = _types(s, g, node)
    return OPS[node.op].cost(types, outs, cost_attrs(node)).flops


def node_vector_us(s, g: Graph, node) -> float:
    """The per-op estimate of node's vector work: its activations in and out and the vectors it reads
    (declared matrices, caches and state are streamed: their tiles' work is the op's loop's), plus
    the decode of its quantised tiles its cost rule states (`Cost.decode`)."""
    types, outs = _types(s, g, node)
    ins = [t for r, t in zip(node.inputs, types, strict=True) if r.kind != "tensor" or len(t.shape) <= 1]
    return cost_model.vector_us(sum(_numel(t) for t in (*ins, *outs)) + node_decode(s, g, node))


def node_decode(s, g: Graph, node) -> int:
    """Vector-unit element operations of decoding node's quantised tiles (its cost rule's estimate)."""
    types, outs = _types(s, g, node)
    return OPS[node.op].cost(types, outs, cost_attrs(node)).decode if node.op in OPS else 0


def _numel(t) -> int:
    n = 1
    for d in t.shape:
        n *= d if isinstance(d, int) else 1
    return n


def tokens_seen(s, node) -> int:
    """Cached tokens one row's attention reads: the context and the new token, at most its
    sliding `window` or `chunk` and its global tokens (as its cost's KV traffic counts them)."""
    a = cost_attrs(node)
    bounds = [b for b in (a.get(k) for k in ("window", "chunk")) if b]
    return min(s.context + 1, min(bounds) + (a.get("global_tokens") or 0)) if bounds else s.context + 1


def _exchanges(s) -> dict[tuple[str, str], object]:
    return {(c.graph, c.value): c for c in s.collectives}


def graph_phases(s, g: Graph, items: list[ScheduleItem], static: dict | None, fused=None) -> list[Phase]:
    """The phases of one run of g (for the step: prologue and epilogue, split at `layers`).
    `fused`: (graph, value) -> exchange us replacing the collective's own (plan/levers.py)."""
    step = g is s.model.step
    by_node = defaultdict(list)
    for it in items:
        by_node[it.node].append(it)
    exch = _exchanges(s)
    during = {i for graph, _, run in s.windows if graph == g.name for i in run}
    out = []
    fetched = sum(it.bytes for it in by_node.get(-1, ()))
    code = (static or {}).get(cost_model.LAYER_CODE) if not step else None
    if code:  # libtpu's schedule: this layer's code outside its tile loops, whole
        out.append(Phase(g.name, "per-layer code outside the tile loops", 0, "code", 0, 1.0, code, "static", ""))
    if fetched:
        name, rate = cost_model.bandwidth("", step, False, False)  # small op-issued DMAs
        out.append(Phase(g.name, "weights fetched whole", 0, "fetch", fetched, rate / 1e6, 0.0, "", name))
    for i, node in enumerate(g.nodes):
        if node.op == "layers":
            out.append(Phase(g.name, "layers", node.span.line, "layers", 0, 1.0, 0.0, "", ""))
            continue
        c = exch.get((g.name, node.outputs[0].name)) if node.outputs else None
        if c is not None and OPS[node.op].exchange:
            us = c.time_us() if fused is None else fused[g.name, c.value]
            if us:
                out.append(_collective_phase(g, node, c, us))
            continue
        phase = _op_phase(s, g, i, by_node.get(i, ()), static, during=i in during)
        if phase is not None:
            out.append(phase)
    return out


def written(g: Graph, value: str, at) -> str:
    """The value as the spec author wrote it: the shard passes' `x__sum` / `x__mine` is `x`; an
    unnamed expression (named after its op: `linear_7`) is that op at its line and column; inlined
    from a block, the block is named. `at`: the collective's node, where the producer is gone."""
    base = value.split("__", 1)[0]
    node = next((n for n in g.nodes if any(v.name == base for v in n.outputs)), at)
    where = f" in block `{node.block}`" if node.block else ""
    op = re.fullmatch(r"(\w+?)(_\d+)?", base)[1]
    if op in OPS:
        return f"the `{op}`{where} at {node.span.line}:{node.span.column}"
    return f"`{base}`{where}"


def _collective_phase(g: Graph, node, c, us: float) -> Phase:
    """A collective's phase: `us` of exchanges, of which its first phase may hide work run during it."""
    first = c.phases[0].time_us() if c.phases else 0.0
    what = f"{c.label} of {written(g, c.value, node)}"  # the algorithm the planner chose
    wide = any(ph.peers >= cost_model.measured.DIRECT_FIT_CORES for ph in c.phases)
    return Phase(
        g.name,
        what,
        node.span.line,
        node.op,
        0,
        1.0,
        0.0,
        "",
        "",
        exchange_us=us,
        overlap_us=min(first, us),
        wide_peers=wide,
    )


def _op_phase(s, g: Graph, i: int, its_items, static: dict | None, during: bool) -> Phase | None:
    """Node i's phase: the bytes it streams at their measured rate and its compute (None: neither)."""
    node, step = g.nodes[i], g is s.model.step
    nbytes = sum(it.bytes for it in its_items)
    st = s.stream_of(Site(g, i, node))
    ring = st is not None
    weight = streamed_weight(node) if ring else None
    int8 = weight is not None and s.model.tensor(weight.name).type.dtype.name == "int8"
    op = OPS[node.op]
    name, rate = cost_model.bandwidth(op.traffic_group, step, ring, int8)
    stream_us = nbytes / rate * 1e6
    key = f"{node.op}:{weight.name}" if weight is not None else node.op
    flops = node_flops(s, g, i)
    whole = cost_model.LAYER_CODE in (static or {}) and not step  # the layer's code is charged whole
    vector = 0.0 if whole else node_vector_us(s, g, node)
    tokens = tokens_seen(s, node)
    comp, source = cost_model.compute_us(node.op, flops, stream_us, s.batch, tokens, static, key, op.latency, vector)
    if not (nbytes or comp):
        return None
    what = next((it.what for it in its_items), node.op)
    tile = nbytes // st.tiles if ring and st.tiles else 0
    measured_tokens = cost_model.measured.ATTENTION_MEASURED_TOKENS
    beyond = comp * (1 - measured_tokens / tokens) if source == "latency" and op.latency == "cached_tokens" else 0.0
    return Phase(
        g.name,
        what,
        node.span.line,
        node.op,
        nbytes,
        rate / 1e6,
        comp,
        source,
        name,
        ring,
        tile,
        during=during,
        extrapolated_us=max(0.0, beyond),
        serial=s.span > 1 and op.rows_in_series and nbytes > 0,
        decode_us=cost_model.vector_us(node_decode(s, g, node)) - cost_model.vector_us(0)
        if source == "vector"
        else 0.0,
    )


def step_order(s, items, static, fused=None) -> list[list[Phase]]:
    """Every graph run of the step, in order: prologue, the layers of the schedule, epilogue."""
    m = s.model

    def phases(g):
        return graph_phases(s, g, [it for it in items if it.graph == g.name], static, fused)

    kinds = {k.name: phases(k) for k in m.kinds}
    top = phases(m.step)
    cut = next((i for i, p in enumerate(top) if p.op == "layers"), len(top))
    return [top[:cut], *(kinds[k] for k in m.schedule), [p for p in top[cut + 1 :]]]


def model_step(s, items, slots: int, steps_per_call: int, static: dict | None, must_move: int, flops: int, fused=None):
    """(Timing, per-phase costs per step) of the plan's step."""
    order = step_order(s, items, static, fused)
    charges = cost_model.simulate(order, slots, cost_model.measured.EXCHANGE_STREAM_OVERLAP)
    granted = cost_model.simulate(order, slots, 1.0)  # every tile in flight lands during an exchange
    costs: dict[tuple, list[float]] = {}
    keys: dict[tuple, tuple] = {}
    for ch in charges:
        p = ch.phase
        key = (p.graph, p.what, p.line)
        acc = costs.setdefault(key, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += ch.stream_us
        acc[2] += ch.compute_us
        acc[3] += ch.comm_us
        keys[key] = (p.op, p.source, p.bandwidth, p.bytes, p.compute_us)
    out = tuple(
        PhaseCost(g, what, line, keys[g, what, line][0], int(a[0]), a[1], a[2], a[3], *keys[g, what, line][1:3])
        for (g, what, line), a in costs.items()
    )
    phases = [p for run in order for p in run]
    fixed = cost_model.dispatch_us()
    modeled = fixed + sum(c.stream_us + c.compute_us + c.comm_us for c in charges)
    optimistic = fixed + sum(c.stream_us + c.compute_us + c.comm_us for c in granted)
    floor_rate = cost_model.floor_bytes_per_s()
    timing = Timing(
        hbm_bytes_per_s=floor_rate,
        floor_us=must_move / floor_rate * 1e6,
        stream_us=sum(p.stream_us for p in phases),
        mxu_us=flops / cost_model.measured.PEAK_BF16_FLOPS_PER_CORE * 1e6,
        compute_us=sum(p.compute_us for p in phases),
        fixed_us=fixed,
        modeled_us=modeled,
        comm_us=sum(p.exchange_us for p in phases),
        steps_per_call=steps_per_call,
        during_us=sum(p.exchange_us for p in phases) - sum(c.comm_us for c in charges),
        optimistic_us=optimistic,
        assumptions=assumptions(s, charges, modeled - optimistic),
        constants=cost_model.measured.SOURCE,
    )
    return timing, out


def assumptions(s, charges, spread: float) -> tuple[Assumption, ...]:
    """What the modeled step rests on beyond the measurements, each with the us that depend on it."""
    m = cost_model.measured
    share = m.EXCHANGE_STREAM_OVERLAP
    out = [
        Assumption(
            "exchange_overlap",
            f"weight tiles in flight land during {share:.0%} of each exchange (the hand kernel: about "
            f"{m.EXCHANGE_UNDER_STREAM_US:g} of {m.EXCHANGE_US_PER_LAYER:g} us per layer); all of it is the optimistic end",
            spread,
            spans_range=True,
        )
    ]
    vector = sum(c.compute_us for c in charges if c.phase.source == "vector")
    if vector:
        out.append(
            Assumption(
                "vector_estimate",
                f"vector and scalar work of ops libtpu's schedule was not read for: {m.VECTOR_OP_US:.2f} us per op "
                f"plus its elements at the vector unit's width ({m.UNEXPLAINED_LAYER_US:g} us per layer unexplained "
                f"in the hand kernel over {m.VECTOR_OPS_PER_LAYER} ops; an estimate)",
                vector,
            )
        )
    decode = sum(c.phase.decode_us for c in charges if c.phase.source == "vector")
    if decode:
        out.append(
            Assumption(
                "quantised_decode",
                "of the vector estimate, decoding quantised tiles in VMEM at the operations per weight "
                "each op's cost rule states (`linear`: mkdsl/ops/linear.py DECODE_OPS_PER_WEIGHT, counted "
                "from the kernel's decoders, not measured)",
                decode,
            )
        )
    beyond = sum(min(c.compute_us, c.phase.extrapolated_us) for c in charges if c.phase.extrapolated_us)
    if beyond:
        out.append(
            Assumption(
                "attention_context",
                f"attention's {m.ATTENTION_250_TOKENS_US:g} us per {m.ATTENTION_MEASURED_TOKENS} cached tokens "
                f"(measured there) extended linearly to {s.context + 1} tokens and {s.rows} rows",
                beyond,
            )
        )
    wide = sum(c.comm_us for c in charges if c.phase.wide_peers)
    if wide:
        out.append(
            Assumption(
                "collective_peers",
                f"exchange phases with more than {m.DIRECT_FIT_CORES - 1} peers use the direct fit measured on "
                f"{m.DIRECT_FIT_CORES} cores (latency extrapolated per peer; bandwidth taken as the same)",
                wide,
            )
        )
    series = sum(min(c.stream_us, c.compute_us) for c in charges if c.phase.serial)
    if series:
        out.append(
            Assumption(
                "rows_in_series",
                f"a verify step's {s.span} rows per sequence run each recurrent state in series (row r reads "
                "the state row r - 1 wrote to HBM): its stream is charged after its compute, none of it under "
                "(the kernel overlaps heads within a row; these us are what full overlap would save)",
                series,
            )
        )
    devices = _devices(s.model)
    if devices > m.DISPATCH_MEASURED_CORES:
        out.append(
            Assumption(
                "dispatch_cores",
                f"the {m.DISPATCH_US:g} us per step of dispatch, glue and barrier measured on "
                f"{m.DISPATCH_MEASURED_CORES} cores, used for {devices}",
                m.DISPATCH_US,
            )
        )
    return tuple(out)


def _devices(model) -> int:
    n = 1
    for _, size in model.mesh:
        n *= size
    return n
