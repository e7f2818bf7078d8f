"""The planner: named passes from the graph IR to a `Plan`, run in a visible sequence.

    pad_rows -> check_lowering -> tile_streams -> pad_storage -> size_ring -> plan_collectives -> allocate_vmem
             -> fit_ring -> check_budget -> check_hbm -> count_traffic -> schedule_traffic -> timeline.model_step

The planner names no op: it asks each op's TPU lowering (mkdsl/backends/tpu/lowering.py) what it
cannot lower, what buffers it needs and what its schedule moves, and the op (`OpDef`) how its
weights are reached.

Every decision has a default good enough that a spec needs no `hints` section; hints
override them and are checked here, with diagnostics that point at the hint's line.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from mkdsl.backends.tpu.lowering import Site, check_lowerable, lowering_for, sites, unread_states
from mkdsl.backends.tpu.lowerings.linear import TILE_K, TILE_N, format_of, padded_columns, stream_layout
from mkdsl.lang.diagnostics import NOWHERE, Diagnostic, Span, SpecError
from mkdsl.lang.dtypes import storage_bytes
from mkdsl.lang.ir import Graph, Model, Node, TensorType
from mkdsl.ops import OPS, Cost
from mkdsl.plan import collectives, fusion, hbm, roles, timeline
from mkdsl.plan.buffers import assign_buffers, buffer_of
from mkdsl.plan.nodes import concrete, cost_attrs, streamed_weight
from mkdsl.plan.types import Alloc, OpScratch, Plan, ScheduleItem, Sequence, Stream, TensorTraffic
from mkdsl.plan.vmem import DEFAULT_CAP, MIB, VMEM_PER_CORE, mib, padded_bytes
from mkdsl.spmd import overlap
from mkdsl.spmd.shard import devices

ROW_TILE = 16  # rows padded to the bf16 sublane tile, so matmul inputs are tile-aligned
RING_BYTES = 24 * MIB  # default share of VMEM for weight tiles in flight
KV_TILE = 256  # tokens per KV tile (256-token tiles beat 128 on TPU7x, per a public kernel)
MAX_RING_DEPTH = 16


@dataclass
class _State:
    """What the passes build up; frozen into a `Plan` at the end."""

    model: Model
    batch: int
    context: int
    fixed_depth: int | None = None  # ring depth decided elsewhere (no hint, no fitting)
    rows: int = 0
    tile_k: int = TILE_K
    tile_n: int = TILE_N
    kv_tile: int = KV_TILE
    depth: int = 0
    bank: tuple[int, int] = (0, 0)
    rings: dict = field(default_factory=dict)  # ring arrays besides `ring`: name -> (rows, cols, dtype, memory)
    sequences: list[Sequence] = field(default_factory=list)
    vmem: list[Alloc] = field(default_factory=list)
    spans: dict[str, Span] = field(default_factory=dict)  # alloc name -> spec span to blame
    cap: int = DEFAULT_CAP
    errors: list[Diagnostic] = field(default_factory=list)
    buffers: dict = field(default_factory=dict)  # (graph, value) -> VMEM buffer
    scratch: dict = field(default_factory=dict)  # (graph, node index) -> OpScratch
    collectives: list = field(default_factory=list)  # collectives.Collective of every graph (sharded models)
    wide: list = field(default_factory=list)  # the collectives a kernel built for a batch above 1 runs
    windows: tuple = ()  # (graph, collective value, node indices run during its first exchange): mkdsl/spmd/overlap.py
    one_row: list = field(default_factory=list)  # ... and one built for batch 1 (empty: the same as `wide`)
    hbm: int = 0  # bytes one device holds in HBM (largest batch, shortest cache)
    hbm_tokens: int = 0  # the longest cache that fits at the largest batch
    pads: dict = field(default_factory=dict)  # tensor -> {axis: padded width}: stored wider (pad_storage)
    span: int = 1  # verify rows per sequence (the batch is sequences x span): a speculative verify step

    def hint(self, name: str, default: int) -> int:
        h = self.model.hint(name)
        return default if h is None else h.value

    def hint_span(self, name: str) -> Span:
        h = self.model.hint(name)
        return h.span if h else NOWHERE

    # ---- what lowerings ask of the planner (mkdsl/backends/tpu/lowerings/)

    def alloc(self, name: str, shape: tuple, dtype: str, purpose: str, span: Span, memory: str = "VMEM") -> None:
        _alloc(self, name, shape, dtype, purpose, span, memory)

    def buffer(self, graph: Graph, ref) -> str:
        return buffer_of(self.buffers, graph, ref)

    def type_of(self, graph: Graph, ref) -> TensorType:
        return _type_of(self.model, graph, ref)

    def cost(self, at: Site) -> Cost:
        """The op's cost with the row dim at the batch and sequence dims at the tokens read."""
        dims = [d.name for d in self.model.dims]
        sizes = {dims[0]: self.batch, **{d: self.context + 1 for d in dims[1:]}}
        types = [concrete(self.type_of(at.graph, r), sizes) for r in at.node.inputs]
        outs = [concrete(v.type, sizes) for v in at.node.outputs]
        return OPS[at.node.op].cost(types, outs, cost_attrs(at.node))

    def stream_of(self, at: Site) -> Stream | None:
        """The weight stream of a node, in its kind's sequence (the epilogue's for the step)."""
        name = step_part(self.model, at.index) if at.graph is self.model.step else at.graph.name
        seq = next((q for q in self.sequences if q.name == name), None)
        return next((st for st in seq.streams if st.node == at.node.outputs[0].name), None) if seq else None


def _fused(model: Model, found) -> dict:
    return fusion.ready_together(model, found)


def make_plan(
    model: Model,
    batch: int = 1,
    context: int | None = None,
    ring_depth: int | None = None,
    steps_per_call: int = 1,
    static: dict[str, float] | None = None,
    fuse_ready: bool = False,
    static_from: str = "",
    verify_rows: int = 1,
) -> Plan:
    """Plan the decode step for `batch` rows reading `context` cached tokens each.

    `ring_depth` fixes the weight ring (the depth of a kernel planned at another batch: the emitted
    kernel is sized for the largest batch); by default the ring is sized for this batch.
    `steps_per_call`: decode steps per device call (the dispatch is shared by them); `static`: op ->
    compute / stream ratio of its loop in libtpu's schedule, used by the cost model where given.
    `fuse_ready`: a what-if of the cost model, collectives ready together as one exchange
    (plan/levers.py); the kernel does not do it. `static_from`: where `static` came from (shown).
    `verify_rows` = R > 1: the verify step of batch / R sequences of R rows each, whose ops with
    `rows_in_series` run the rows one after the other (their state through HBM).
    """
    s = _start(model, batch, context, ring_depth, verify_rows)
    pad_rows(s)
    if not s.rows:  # no layer stack: nothing to plan
        raise SpecError(s.errors)
    for step in PASSES:  # each pass carries on past a broken rule, so one run reports every error
        step(s)
        if step is check_lowering and unread_states(s.model):  # later passes find no buffer for them
            raise SpecError(list(dict.fromkeys(s.errors)))
    if s.errors:
        raise SpecError(list(dict.fromkeys(s.errors)))  # a rule broken in several kinds is said once
    traffic, graph_flops = count_traffic(s)
    flops = sum(graph_flops.values())
    items = tuple(schedule_items(s))
    sched_bytes, dmas = schedule_traffic(model, items)
    phases, _ = collectives.step_totals(model, s.collectives)
    must_move = sum(t.bytes for t in traffic)
    fused = _fused(model, s.collectives) if fuse_ready else None
    timing, costs = timeline.model_step(s, items, s.depth - 1, steps_per_call, static, must_move, flops, fused)
    if static_from or not static:
        timing = dataclasses.replace(timing, compute_from=static_from or "the per-op estimate")
    return Plan(
        model=model.name,
        profile=model.profile,
        batch=batch,
        rows=s.rows,
        context=s.context,
        ring_depth=s.depth,
        bank=s.bank,
        kv_tile=s.kv_tile,
        sequences=tuple(s.sequences),
        vmem=tuple(s.vmem),
        vmem_cap=s.cap,
        traffic=traffic,
        schedule_bytes=sched_bytes,
        dma_count=dmas,
        flops=flops,
        timing=timing,
        schedule_items=items,
        graph_flops=tuple(graph_flops.items()),
        buffers=tuple(sorted((g, v, b) for (g, v), b in s.buffers.items())),
        scratch=tuple(s.scratch[key] for key in sorted(s.scratch)),
        mesh=model.mesh if s.collectives else (),
        wire=wire(model),
        collectives=tuple(s.collectives),
        one_row=tuple(s.one_row),
        comm_masks=_comm_masks(s),
        windows=s.windows,
        exchange_phases=phases,
        collective_id=0 if s.collectives else None,
        hbm_bytes=s.hbm,
        hbm_max_cache=s.hbm_tokens,
        pads=tuple(
            (name, axis, width) for name, axes in sorted(s.pads.items()) for axis, width in sorted(axes.items())
        ),
        phases=costs,
    )


def _start(model: Model, batch: int, context: int | None, ring_depth: int | None, verify_rows: int) -> _State:
    if verify_rows < 1 or batch % verify_rows:
        raise ValueError(f"verify_rows {verify_rows} must divide the batch {batch} (sequences x rows)")
    s = _State(model, batch, context if context is not None else default_context(model), fixed_depth=ring_depth)
    s.span = verify_rows
    return s


def check_lowering(s: _State) -> None:
    """What the TPU lowerings cannot lower (`mkdsl check` runs the same checks)."""
    s.errors.extend(check_lowerable(s.model))


def wire(model: Model) -> str:
    h = model.hint("wire_bf16")
    return "bf16" if h is not None and h.value else "f32"


def default_context(model: Model) -> int:
    """Traffic figures assume a cache filled to a quarter of its largest length, capped at 4096."""
    seq = next((d for d in model.dims[1:]), None)
    return min(4096, seq.high // 4) if seq else 0


# ---------------------------------------------------------------------------- passes


def pad_rows(s: _State) -> None:
    if not any(n.op == "layers" for n in s.model.step.nodes):
        s.errors.append(
            Diagnostic(
                s.model.step.span,
                "the step runs no layer stack: a megakernel needs `layers(...)`",
                "declare `layers N { KIND: otherwise }` and call `x = layers(x)` in the step",
            )
        )
        return
    rows = next(iter(s.model.dims))
    if not rows.low <= s.batch <= rows.high:
        s.errors.append(Diagnostic(NOWHERE, f"batch {s.batch} is outside `{rows.name}` in {rows.low} .. {rows.high}"))
    s.rows = -(-s.batch // ROW_TILE) * ROW_TILE


def tile_streams(s: _State) -> None:
    """Cut every streamed matrix into [tk, tn] tiles; one tile sequence per layer kind.

    A matrix that cannot stream has a diagnostic from its lowering's check; it is left out."""
    s.tile_n = s.hint("tile_n", TILE_N)
    if s.tile_n <= 0 or s.tile_n % 128:
        s.errors.append(Diagnostic(s.hint_span("tile_n"), f"tile_n must be a multiple of 128 lanes, got {s.tile_n}"))
        s.tile_n = TILE_N
    for g in [_prologue(s.model), *s.model.kinds, _epilogue(s.model)]:
        streams, start = [], 0
        for node in g.nodes:
            w = streamed_weight(node)
            if w is None:
                continue
            t = s.model.tensor(w.name)
            transposed = bool(node.attr.get("transposed"))
            sf, tk, tn = stream_layout(t, s.tile_k, s.tile_n, transposed)
            if tk is None or tn is None:
                continue
            k, n = reversed(t.type.shape) if transposed else t.type.shape
            padded = padded_columns(n)
            plain = sf.fmt == "bf16" and padded == n and not transposed
            parts = (
                () if plain else tuple((p.suffix, p.ring_for(padded, tk, k), p.runtime_rdiv, p.cdiv) for p in sf.parts)
            )
            valid = n if padded != n else 0
            stream = Stream(
                t.name,
                node.outputs[0].name,
                k,
                padded,
                tk,
                tn,
                start,
                t.stacked,
                node.span.line,
                sf.fmt,
                sf.group,
                parts,
                transposed=transposed,
                valid=valid,
            )
            streams.append(stream)
            start += stream.tiles
        if streams or g.name != "prologue":  # a prologue that streams nothing has no sequence
            s.sequences.append(Sequence(g.name, tuple(streams)))


def pad_storage(s: _State) -> None:
    """The tensors stored wider than one device's shape, zero-padded so that whole tiles hold them:
    a streamed matrix's outputs to whole 128-lane tiles, and what lowerings ask (`Lowering.pads`,
    e.g. expert widths). The kernel reads the padded tensor; only the valid part reaches a value."""
    asked: list[tuple[str, int, int]] = [
        (st.tensor, -2 if st.transposed else -1, st.n) for st in all_streams(s) if st.valid
    ]
    for at in sites(s.model):
        lw = lowering_for(at.node.op)
        if lw is not None and lw.pads is not None:
            asked += [(name, axis, w) for name, axes in lw.pads(s.model, at).items() for axis, w in axes.items()]
    for name, axis, width in asked:
        t = s.model.tensor(name)
        axis = axis - len(t.type.shape) if axis >= 0 else axis
        have = s.pads.setdefault(name, {}).setdefault(axis, width)
        if have != width:
            s.errors.append(
                Diagnostic(
                    t.span,
                    f"`{name}` is read padded to {have} and to {width} along axis {axis} by different ops",
                    "give each op its own copy of the weight",
                )
            )


def _cut(model: Model) -> int:
    """The index of the step's layer stack (-1: none)."""
    return next((i for i, n in enumerate(model.step.nodes) if n.op == "layers"), -1)


def step_part(model: Model, index: int) -> str:
    """The tile sequence of the step's node `index`: "prologue" before the layer stack (its tiles
    stream first, before layer 0's), "epilogue" after it."""
    return "prologue" if index < _cut(model) else "epilogue"


def _prologue(model: Model) -> Graph:
    """The step's nodes before the layer stack (embedding, a drafter's projection of its context)."""
    nodes = model.step.nodes
    return Graph("prologue", (), nodes[: max(0, _cut(model))], (), model.step.span)


def _epilogue(model: Model) -> Graph:
    """The step's nodes after the layer stack (final norm, lm_head, sampling)."""
    nodes = model.step.nodes
    return Graph("epilogue", (), nodes[_cut(model) + 1 :], model.step.results, model.step.span)


def all_streams(s) -> list[Stream]:
    return [st for seq in s.sequences for st in seq.streams]


def bank_bytes(s: _State) -> int:
    """VMEM of one bank of every ring array (a tile's parts share the bank index)."""
    extra = sum(padded_bytes((1, r, c), dt) for r, c, dt, mem in s.rings.values() if mem == "VMEM")
    return padded_bytes((1, *s.bank), "bfloat16") + extra


def ring_arrays(s: _State) -> dict:
    """name -> (rows, cols, dtype, memory) of each ring array: `ring` (bf16) and one per other
    dtype of a streamed tile part, each bank as large as the largest such part."""
    shapes: dict = {}
    for st in all_streams(s):
        for p in format_of(s.model, st).parts:
            rows, cols = p.tile(st.tk, st.tn, st.n, st.transposed, st.k)
            ring = p.ring_for(st.n, st.tk, st.k)
            r0, c0, _, _ = shapes.get(ring, (0, 0, p.dtype, p.memory))
            shapes[ring] = (max(r0, rows), max(c0, cols), p.dtype, p.memory)
    return shapes


def size_ring(s: _State) -> None:
    """One bank index for every ring array, each bank big enough for the largest tile part."""
    rings = ring_arrays(s)
    bf16 = rings.pop("ring", (16, 128, "bfloat16", "VMEM"))
    s.bank, s.rings = bf16[:2], rings
    default = max(3, min(MAX_RING_DEPTH, RING_BYTES // bank_bytes(s)))
    s.depth = s.fixed_depth or s.hint("ring_depth", default)
    if s.depth < 2:
        s.errors.append(Diagnostic(s.hint_span("ring_depth"), f"ring_depth must be at least 2, got {s.depth}"))
        s.depth = 2
    s.kv_tile = s.hint("kv_tile", KV_TILE)
    if s.kv_tile < 16 or s.kv_tile % 16:
        s.errors.append(
            Diagnostic(
                s.hint_span("kv_tile"),
                f"kv_tile must be a positive multiple of 16 tokens, got {s.kv_tile}",
                "the new token's block is written back as whole 16-row bf16 tiles",
            )
        )
        s.kv_tile = KV_TILE
    cap_mib = s.hint("vmem_cap_mib", DEFAULT_CAP // MIB)
    if not 1 <= cap_mib <= VMEM_PER_CORE // MIB:
        s.errors.append(
            Diagnostic(
                s.hint_span("vmem_cap_mib"), f"vmem_cap_mib must be in 1 .. {VMEM_PER_CORE // MIB}, got {cap_mib}"
            )
        )
        cap_mib = DEFAULT_CAP // MIB
    s.cap = cap_mib * MIB


def _alloc(
    s: _State, name: str, shape: tuple, dtype: str, purpose: str, span: Span, memory: str = "VMEM", scratch: bool = True
):
    """Record one kernel buffer. Dims may be expressions in `rows` and `batch` (sized at build time).

    A name recorded again (op scratch shared between layer kinds) must have the same shape."""
    for a in s.vmem:
        if a.name == name:
            assert (a.shape, a.dtype) == (tuple(shape), dtype), (name, a.shape, shape)
            return
    seq = s.model.dims[1].high if len(s.model.dims) > 1 else 1
    sizes = dict(rows=s.rows, batch=s.batch, seq_tiles=max(1, seq // s.kv_tile))
    concrete = tuple(eval_dim(d, **sizes, wire_rows=collectives.exchange_rows(s.batch)) for d in shape)
    if memory == "VMEM":
        size = padded_bytes(concrete, dtype)
        if len(shape) >= 2 and shape[-2] == "wire_rows" and concrete[-2] == 1:
            size //= 8  # a 1-row 32-bit comm buffer: Mosaic tiles it (1, 128), not (8, 128)
    elif memory == "SMEM":
        size = 4 * math.prod(concrete)
    else:
        size = 0
    s.vmem.append(Alloc(name, tuple(shape), dtype, size, purpose, span.line, memory, scratch))
    s.spans[name] = span


def eval_dim(d, **sizes) -> int:
    """A buffer dim: an int, or a planner-written expression such as "4 * rows"."""
    return d if isinstance(d, int) else int(eval(d, {"__builtins__": {}}, sizes))  # noqa: S307


def allocate_vmem(s: _State) -> None:
    """Every buffer and semaphore the kernel uses, named as the emitter names them."""
    m = s.model
    ring_span = s.hint_span("ring_depth") if m.hint("ring_depth") else NOWHERE
    _alloc(
        s,
        "ring",
        (s.depth, *s.bank),
        "bfloat16",
        f"weight ring: {s.depth} banks of [{s.bank[0]}, {s.bank[1]}]",
        ring_span,
    )
    for name, (rows, cols, dtype, memory) in s.rings.items():
        purpose = f"weight ring ({dtype}): {s.depth} banks of [{rows}, {cols}]"
        _alloc(s, name, (s.depth, rows, cols), dtype, purpose, ring_span, memory)
    _alloc(s, "ring_sem", (s.depth,), "dma", "weight ring semaphores", ring_span, "SEM")
    fetched = list(dict.fromkeys(name for g in [*m.kinds, m.step] for name in roles.fetched_weights(m, g)))
    for name in fetched:
        t = m.tensor(name)
        _alloc(
            s,
            f"f_{name}",
            roles.fetch_shape(roles.stored(t, s.pads)),
            t.type.dtype.numpy,
            f"`{name}` fetched per layer",
            t.span,
        )
    if fetched:
        _alloc(s, "fetch_sem", (len(fetched),), "dma", "fetch semaphores", NOWHERE, "SEM")
    if s.collectives:
        _allocate_comm(s)
    logits = m.step.results[0]
    vocab = _type_of(m, m.step, logits).shape[1]
    _alloc(s, "logits", ("batch", vocab), "float32", "output: logits", m.step.span, scratch=False)
    _alloc(s, "next_tokens", ("batch", 1), "int32", "output: next tokens", m.step.span, scratch=False)
    _allocate_step_loop(s)
    carry = next((n for n in m.step.nodes if n.op == "layers"), None)
    if carry is not None:
        for i, v in enumerate(carry.outputs):
            _alloc(s, f"carry{i}", ("rows", v.type.shape[1]), "float32", "value carried across layers", carry.span)
    results = [r.name for r in m.step.results]
    where, shapes = assign_buffers(m, {results[0]: "logits", results[1]: "next_tokens"})
    s.buffers = where
    users: dict[str, list[str]] = {}
    for (gname, vname), name in where.items():
        users.setdefault(name, []).append(f"{gname}.{vname}" if gname != "step" else vname)
    for name, (width, dtype, rows) in shapes.items():
        shown = ", ".join(users.get(name, [])[:4]) + (", ..." if len(users.get(name, [])) > 4 else "")
        _alloc(s, name, (rows, width), dtype, f"values: {shown}", NOWHERE)
    allocate_ops(s)


def allocate_ops(s: _State) -> None:
    """What each op's lowering asks for: named buffers, then numbered scratch `<base><i>_<part>`.

    A synchronous lowering (all DMAs done on return) takes scratch set 0, or the first whose
    shapes match, so all its instances share one set across and within layer kinds; the others
    number their instances across all graphs. `after_all` runs once per base, after every op."""
    counts: dict[str, int] = {}
    after: dict[str, Callable] = {}
    for at in sites(s.model):
        lw = lowering_for(at.node.op)
        if lw is None:
            continue
        if lw.allocate:
            lw.allocate(s, at)
        parts = lw.scratch(s, at) if lw.scratch else {}
        if not parts:
            continue
        base = lw.scratch_base
        i = 0 if lw.synchronous else counts.get(base, 0)
        while lw.synchronous and any(
            a.name == f"{base}{i}_{part}" and (a.shape, a.dtype) != (tuple(p[0]), p[1])
            for a in s.vmem
            for part, p in parts.items()
        ):
            i += 1
        for part, (shape, dtype, purpose, memory) in parts.items():
            s.alloc(f"{base}{i}_{part}", shape, dtype, purpose, at.node.span, memory)
        s.scratch[(at.graph.name, at.index)] = OpScratch(at.graph.name, at.index, base, i, tuple(parts))
        counts[base] = max(counts.get(base, 0), i + 1)
        if lw.after_all:
            after.setdefault(base, lw.after_all)
    for base, fn in after.items():
        fn(s, counts[base])


def plan_collectives(s: _State) -> None:
    """The exchanges of a per-device model (after mkdsl.spmd.shard), each with its phases and bytes.

    The kernel runs the algorithms the cost model picks for its messages: a kernel built for batch 1
    those picked for 1 row (`one_row`, where the batch range holds more than 1 and they run the same
    exchanges over the same masks: collectives.same_exchanges), one built for a larger batch those
    picked at the largest batch's rows (`wide`); each priced at the planned batch's rows."""
    m = s.model
    low, high = m.dims[0].low, m.dims[0].high
    pick = lambda rows: [c for g in [*m.kinds, m.step] for c in collectives.graph_collectives(m, g, rows, wire(m))]  # noqa: E731
    s.wide = pick(collectives.exchange_rows(high))
    one = pick(1) if low == 1 < high else []
    s.one_row = one if one and collectives.same_exchanges(one, s.wide) else []
    runs = s.one_row if s.batch == 1 and s.one_row else s.wide
    s.collectives = collectives.on_wire(runs, collectives.exchange_rows(s.batch))
    s.windows = overlap.windows(m, s.collectives)


def _allocate_step_loop(s: _State) -> None:
    """The in-kernel step loop's own scratch (wrapper/sampling.py.jinja `step_scratch`, which the
    kernel allocates itself: counted here, not emitted): the drawn tokens' staging and their SMEM
    copy, the step's tokens and positions."""
    span, what = s.model.step.span, "the step loop (step_scratch)"
    _alloc(s, "token_stage", ("rows", 128), "int32", f"{what}: drawn tokens, staged", span, scratch=False)
    _alloc(s, "token_smem", ("rows", 128), "int32", f"{what}: drawn tokens", span, "SMEM", scratch=False)
    _alloc(s, "step_tokens", ("batch",), "int32", f"{what}: this step's tokens", span, "SMEM", scratch=False)
    _alloc(s, "step_positions", ("batch",), "int32", f"{what}: this step's positions", span, "SMEM", scratch=False)


def check_gathers(s: _State) -> None:
    """Each device's slice of an all-gathered value must be whole 128-lane tiles: the TPU compiler
    slices the receive slots in tiles (Mosaic refuses a 448-wide slice; interpret mode runs it)."""
    for c in s.collectives:
        if c.exchange != "gather" or c.width % 128 == 0:
            continue
        g = next(g for g in (*s.model.kinds, s.model.step) if g.name == c.graph)
        node = next(n for n in g.nodes if any(v.name == c.value for v in n.outputs))
        src = next((n for n in g.nodes if any(v.name == node.inputs[0].name for v in n.outputs)), None)
        weights = [r.name for r in src.inputs if r.kind == "tensor"] if src is not None else []
        what = f"`{src.op}`'s output over `{weights[0]}`" if weights else "a value"
        s.errors.append(
            Diagnostic(
                node.span,
                f"{what} is split over {', '.join(c.axes)} into {c.width} columns per device and gathered "
                "whole: the TPU compiler exchanges whole 128-lane tiles only",
                "pad the split dimension to a multiple of 128 x the devices it is split over and `slice` "
                "the gathered value (specs/kimi_k3.mk pads the router's columns to `EP` so)",
            )
        )


def _allocate_comm(s: _State) -> None:
    """The collectives' scratch (runtime comm_scratch()): per mask exchanged over, receive slots
    (two parities x one slot per group member) and semaphores; the outgoing stage; the kept half."""
    rows = "wire_rows"  # only the batch's rows travel: the kernel sizes these by exchange_rows(batch)
    slots, stage, half = collectives.comm_buffers(s.wide)
    small = collectives.comm_buffers(s.one_row) if s.one_row else (slots, stage, half)
    stage, half = _by_rows(stage, small[1]), _by_rows(half, small[2])
    for mask in sorted({*slots, *small[0]}):
        g = collectives.group_size(mask)
        what = f"collectives over index bits {mask:#b}"
        # a mask only one kernel exchanges over keeps one 128-lane slot per member in the other
        wide, one = (g * collectives.lanes(d.get(mask, 1)) for d in (slots, small[0]))
        recv = _by_rows(wide, one)
        _alloc(s, f"comm_recv_{mask}", (2, rows, recv), "int32", f"{what}: receive slots", NOWHERE)
        _alloc(s, f"comm_rsem_{mask}", (2 * g,), "dma", f"{what}: incoming DMA per slot", NOWHERE, "SEM")
        _alloc(s, f"comm_ssem_{mask}", (g,), "dma", f"{what}: outgoing DMA per peer", NOWHERE, "SEM")
        _alloc(s, f"comm_count_{mask}", (1,), "int32", f"{what}: exchanges done", NOWHERE, "SMEM")
    _alloc(s, "comm_stage", (rows, stage), "int32", "collectives: outgoing messages", NOWHERE)
    if half:
        _alloc(s, "comm_half", (rows, half), "float32", "collectives: the half a core keeps (chip first)", NOWHERE)


def _comm_masks(s: _State) -> tuple:
    """(the masks a kernel built for batch 1 exchanges over, the others') where they differ."""
    if not s.one_row:
        return ()
    one, wide = collectives.masks_of(s.one_row), collectives.masks_of(s.wide)
    return (one, wide) if one != wide else ()


def _by_rows(wide: int, one_row: int) -> int | str:
    """A comm buffer's width: `one_row` in a kernel built for batch 1, `wide` in the others (an
    expression in the kernel's wire_rows where they differ; the wider where one is 0: none)."""
    if wide == one_row or not wide or not one_row:
        return max(wide, one_row)
    return f"{one_row} if wire_rows == 1 else {wide}"


def fit_ring(s: _State) -> None:
    """Without a ring_depth hint, shrink the ring (to 3 banks at least) so the plan fits the cap."""
    if s.model.hint("ring_depth") or s.fixed_depth:
        return
    rings = {"ring", "ring_sem", *s.rings}
    others = sum(a.bytes for a in s.vmem if a.memory == "VMEM" and a.name not in rings)
    depth = max(3, min(s.depth, (s.cap - others) // bank_bytes(s)))
    if depth == s.depth:
        return
    s.depth = depth
    for i, a in enumerate(s.vmem):
        if a.name in rings:
            shape = (depth, *a.shape[1:])
            size = (
                padded_bytes(shape, a.dtype)
                if a.memory == "VMEM"
                else 4 * math.prod(shape)
                if a.memory == "SMEM"
                else 0
            )
            purpose = a.purpose.replace(f"{a.shape[0]} banks", f"{depth} banks")
            s.vmem[i] = Alloc(a.name, shape, a.dtype, size, purpose, a.line, a.memory, a.scratch)


def check_budget(s: _State) -> None:
    total = sum(a.bytes for a in s.vmem if a.memory == "VMEM")
    if total <= s.cap:
        return
    worst = max((a for a in s.vmem if a.memory == "VMEM"), key=lambda a: a.bytes)
    span = (
        s.spans[worst.name]
        if s.spans[worst.name] != NOWHERE
        else next(
            (
                v.span
                for g in (*s.model.kinds, s.model.step)
                for n in g.nodes
                for v in n.outputs
                if s.buffers.get((g.name, v.name)) == worst.name
            ),
            s.model.step.span,
        )
    )
    s.errors.append(
        Diagnostic(
            span,
            f"VMEM budget exceeded{' per device' if devices(s.model) > 1 else ''}: the plan needs {mib(total)} of the {mib(s.cap)} cap; the largest allocation is "
            f"{worst.purpose} `{worst.name}` {list(worst.shape)} {worst.dtype} = {mib(worst.bytes)}",
            "lower `ring_depth` or `tile_n` in `hints`, or raise `vmem_cap_mib` (at most 64)"
            if worst.name.startswith("ring")
            else f"its size follows from the spec's shapes and the largest batch ({s.model.dims[0].high} rows): make those smaller",
        )
    )


def check_hbm(s: _State) -> None:
    """Weights, state at the largest batch and cache, and the outputs must fit one core's HBM."""
    vocab = _type_of(s.model, s.model.step, s.model.step.results[0]).shape[1]
    items = hbm.hbm_items(s.model, vocab, hbm.build_sizes(s.model, cache="low"), s.pads)
    s.hbm = sum(b for _, b in items)
    s.hbm_tokens = hbm.max_cache(s.model, vocab, s.pads)
    s.errors.extend(hbm.check_hbm(s.model, items, devices(s.model)))
    if not s.errors:
        s.errors.extend(hbm.check_capacity(s.model, vocab, s.batch, s.context, s.pads))


PASSES = (
    check_lowering,
    tile_streams,
    pad_storage,
    size_ring,
    plan_collectives,
    check_gathers,
    allocate_vmem,
    fit_ring,
    check_budget,
    check_hbm,
)


# ---------------------------------------------------------------------------- traffic


def count_traffic(s: _State) -> tuple[tuple[TensorTraffic, ...], dict[str, int]]:
    """Bytes each declared tensor must move per step, and the flops per graph (all its runs in a
    step), from the op costs."""
    m = s.model
    dims = [d.name for d in m.dims]
    read_sizes = {dims[0]: s.batch, **{d: s.context + 1 for d in dims[1:]}}
    flop_sizes = {dims[0]: s.rows, **{d: s.context + 1 for d in dims[1:]}}
    per_tensor: dict[str, int] = {t.name: 0 for t in m.tensors}
    group: dict[str, str] = {t.name: "state" for t in m.states}
    flops = dict.fromkeys([*(k.name for k in m.kinds), m.step.name], 0)

    def visit(graph: Graph, runs: int = 1) -> None:
        """Add `graph`'s traffic and flops, `runs` times (a layer kind: once per layer of that kind,
        in first-layer order; its costs do not depend on the layer, see `cost_attrs`)."""
        after_layers = False
        for node in graph.nodes:
            if node.op == "layers":
                for kind, count in Counter(m.schedule).items():
                    visit(m.kind(kind), count)
                after_layers = True
                continue
            where = node.block or ("layer" if graph.name != "step" else "output" if after_layers else "input")
            for r in node.inputs:
                if r.kind == "tensor" and m.tensor(r.name).kind == "weight":
                    group.setdefault(r.name, OPS[node.op].traffic_group or where)
            op = OPS[node.op]
            types = [_type_of(m, graph, r) for r in node.inputs]
            outs = [v.type for v in node.outputs]
            c: Cost = op.cost(
                [concrete(t, read_sizes) for t in types], [concrete(t, read_sizes) for t in outs], cost_attrs(node)
            )
            at_rows = op.cost(
                [concrete(t, flop_sizes) for t in types], [concrete(t, flop_sizes) for t in outs], cost_attrs(node)
            )
            flops[graph.name] += runs * at_rows.flops
            tensors = [r.name for r in node.inputs if r.kind == "tensor"]
            weights = [n for n in tensors if m.tensor(n).kind == "weight"]
            states = [n for n in tensors if m.tensor(n).kind == "state"]
            sizes = [storage_bytes(m.tensor(w).type.dtype, m.tensor(w).type.shape) for w in weights]
            for w, size in zip(weights, sizes, strict=True):  # shared in proportion to their storage
                per_tensor[w] += runs * (c.weight_bytes * size // max(1, sum(sizes)))
            for n in states:
                per_tensor[n] += runs * (c.state_bytes // len(states))

    visit(m.step)
    traffic = tuple(TensorTraffic(t.name, t.kind, per_tensor[t.name], group.get(t.name, "unused")) for t in m.tensors)
    return traffic, flops


def _type_of(m: Model, graph: Graph, ref) -> TensorType:
    from mkdsl.lang.elaborate import graph_value_type

    if ref.kind == "tensor":
        return m.tensor(ref.name).type
    if ref.kind == "input":
        return next(v.type for v in m.inputs if v.name == ref.name)
    return graph_value_type(graph, ref)


def schedule_traffic(m: Model, items) -> tuple[int, int]:
    """Bytes the schedule moves per step and its DMAs: every item times the runs of its graph."""
    runs = graph_runs(m)
    return sum(i.bytes * runs[i.graph] for i in items), sum(i.dmas * runs[i.graph] for i in items)


def graph_runs(m: Model) -> dict[str, int]:
    """How often each graph runs per step: a layer kind once per layer of it, the step once."""
    return {**{k.name: m.schedule.count(k.name) for k in m.kinds}, m.step.name: 1}


def schedule_items(s: _State) -> list[ScheduleItem]:
    """What the schedule moves each time a graph runs, piece by piece: the weights fetched whole,
    and what each op's lowering says it moves (`Lowering.traffic`)."""
    m = s.model
    items = []
    for g in [*m.kinds, m.step]:
        for name in roles.fetched_weights(m, g):
            t = m.tensor(name)
            items.append(ScheduleItem(g.name, f"`{name}` fetch", t.span.line, _fetch_bytes(roles.stored(t, s.pads)), 1))
        for i, node in enumerate(g.nodes):
            lw = lowering_for(node.op)
            moved = lw.traffic(s, Site(g, i, node)) if lw is not None else None
            if moved is not None and (moved.bytes or moved.dmas):
                items.append(ScheduleItem(g.name, _what(node), node.span.line, moved.bytes, moved.dmas, i))
    return items


def _what(node: Node) -> str:
    """How the report names what a node moves: its op and the first tensor it reads."""
    tensors = [r.name for r in node.inputs if r.kind == "tensor"]
    return f"{node.op} `{tensors[0]}`" if tensors else node.op


def _fetch_bytes(t) -> int:
    shape = roles.fetch_shape(t)
    return math.prod(shape) * max(t.type.dtype.bits, 8) // 8
