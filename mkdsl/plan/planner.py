"""The planner: named passes from the graph IR to a `Plan`, run in a visible sequence.

    pad_rows -> tile_streams -> size_ring -> plan_collectives -> allocate_vmem -> fit_ring
             -> check_budget -> count_traffic -> model_time

Every decision has a default good enough that a spec needs no `hints` section; hints
override them and are checked here, with diagnostics that point at the hint's line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mkdsl.diagnostics import NOWHERE, Diagnostic, Span, SpecError
from mkdsl.dtypes import storage_bytes
from mkdsl.ir import Graph, LayerExpr, Model, Node, TensorType
from mkdsl.ops import OPS, Cost
from mkdsl.plan import collectives, cost_model, roles
from mkdsl.plan.buffers import assign_buffers, buffer_of
from mkdsl.plan.types import Alloc, Plan, Sequence, Stream, TensorTraffic
from mkdsl.plan.vmem import DEFAULT_CAP, MIB, VMEM_PER_CORE, mib, padded_bytes

ROW_TILE = 16  # rows padded to the bf16 sublane tile, so matmul inputs are tile-aligned
TILE_K = 2048  # weight tile rows (a multiple of 16, the bf16 sublane tile)
TILE_N = 512  # weight tile columns (a multiple of 128 lanes)
RING_BYTES = 24 * MIB  # default share of VMEM for weight tiles in flight
KV_TILE = 256  # tokens per KV tile (256-token tiles beat 128 on TPU7x, per a public kernel)
KV_SLOTS = 3  # KV tiles in flight
MAX_RING_DEPTH = 16

_NUMPY = {"f32": "float32", "bf16": "bfloat16", "i32": "int32", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


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
    sequences: list[Sequence] = field(default_factory=list)
    vmem: list[Alloc] = field(default_factory=list)
    spans: dict[str, Span] = field(default_factory=dict)  # alloc name -> spec span to blame
    cap: int = DEFAULT_CAP
    errors: list[Diagnostic] = field(default_factory=list)
    buffers: dict = field(default_factory=dict)  # (graph, value) -> VMEM buffer
    scratch: dict = field(default_factory=dict)  # (graph, node index) -> prefix of the op's scratch
    collectives: list = field(default_factory=list)  # collectives.Collective of every graph (sharded models)

    def hint(self, name: str, default: int) -> int:
        h = self.model.hint(name)
        return default if h is None else h.value

    def hint_span(self, name: str) -> Span:
        h = self.model.hint(name)
        return h.span if h else NOWHERE


def make_plan(model: Model, batch: int = 1, context: int | None = None, ring_depth: int | None = None) -> Plan:
    """Plan the decode step for `batch` rows reading `context` cached tokens each.

    `ring_depth` fixes the weight ring (the depth of a kernel planned at another batch: the emitted
    kernel is sized for the largest batch); by default the ring is sized for this batch.
    """
    s = _State(model, batch, context if context is not None else default_context(model), fixed_depth=ring_depth)
    for step in (pad_rows, tile_streams, size_ring, plan_collectives, allocate_vmem, fit_ring, check_budget):
        step(s)
        if s.errors:
            raise SpecError(dict.fromkeys(s.errors))  # a rule broken in several kinds is said once
    traffic, flops = count_traffic(s)
    sched_bytes, dmas = schedule_traffic(s)
    phases, comm_us = collectives.step_totals(model, s.collectives)
    timing = cost_model.model_time(model, bank_bytes(s), sched_bytes, flops, dmas, traffic, comm_us)
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
        buffers=tuple(sorted((g, v, b) for (g, v), b in s.buffers.items())),
        scratch=tuple(sorted((g, i, p) for (g, i), p in s.scratch.items())),
        mesh=model.mesh if s.collectives else (),
        wire=wire(model),
        collectives=tuple(s.collectives),
        exchange_phases=phases,
        collective_id=0 if s.collectives else None,
    )


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


def _divisor_tile(total: int, cap: int, align: int) -> int | None:
    """The largest multiple of `align` that divides `total` and is at most `cap`."""
    if total <= cap and total % align == 0:
        return total
    best = None
    for t in range(align, min(total, cap) + 1, align):
        if total % t == 0:
            best = t
    return best


def streamed_linears(graph: Graph, model: Model) -> list[Node]:
    """The `linear` nodes whose weight is a declared rank-2 matrix: each becomes a stream."""
    return [n for n in graph.nodes if n.op == "linear" and n.inputs[1].kind == "tensor"]


def tile_streams(s: _State) -> None:
    """Cut every streamed matrix into [tk, tn] tiles; one tile sequence per layer kind."""
    s.tile_n = s.hint("tile_n", TILE_N)
    if s.tile_n % 128:
        s.errors.append(Diagnostic(s.hint_span("tile_n"), f"tile_n must be a multiple of 128 lanes, got {s.tile_n}"))
        return
    graphs = [*s.model.kinds, _epilogue(s.model)]
    for g in graphs:
        streams, start = [], 0
        for node in streamed_linears(g, s.model):
            t = s.model.tensor(node.inputs[1].name)
            k, n = t.type.shape
            if t.type.dtype.name != "bf16":
                s.errors.append(
                    Diagnostic(
                        t.span,
                        f"`{t.name}` is {t.type.dtype}: only bf16 weights stream through the weight ring so far",
                        "declare it bf16, or use it through an op that takes it",
                    )
                )
                continue
            tk = _divisor_tile(k, s.tile_k, 16)
            tn = _divisor_tile(n, s.tile_n, 128)
            if tk is None or tn is None:
                what = f"{k} rows" if tk is None else f"{n} columns"
                need = "a multiple of 16" if tk is None else "a multiple of 128"
                s.errors.append(Diagnostic(t.span, f"weight `{t.name}` has {what}; streaming it in tiles needs {need}"))
                continue
            stream = Stream(t.name, node.outputs[0].name, k, n, tk, tn, start, t.stacked, node.span.line)
            streams.append(stream)
            start += stream.tiles
        s.sequences.append(Sequence(g.name, tuple(streams)))


def _epilogue(model: Model) -> Graph:
    """The step's nodes after the layer stack (final norm, lm_head, sampling)."""
    nodes = model.step.nodes
    cut = next((i for i, n in enumerate(nodes) if n.op == "layers"), -1) + 1
    return Graph("epilogue", (), nodes[cut:], model.step.results, model.step.span)


def all_streams(s) -> list[Stream]:
    return [st for seq in s.sequences for st in seq.streams]


def bank_bytes(s: _State) -> int:
    return padded_bytes((1, *s.bank), "bfloat16")


def size_ring(s: _State) -> None:
    """One ring of equal bf16 banks, each big enough for the largest tile."""
    streams = all_streams(s)
    s.bank = (max((t.tk for t in streams), default=16), max((t.tn for t in streams), default=128))
    default = max(3, min(MAX_RING_DEPTH, RING_BYTES // bank_bytes(s)))
    s.depth = s.fixed_depth or s.hint("ring_depth", default)
    if s.depth < 2:
        s.errors.append(Diagnostic(s.hint_span("ring_depth"), f"ring_depth must be at least 2, got {s.depth}"))
    s.kv_tile = s.hint("kv_tile", KV_TILE)
    if s.kv_tile < 16 or s.kv_tile % 16:
        s.errors.append(
            Diagnostic(
                s.hint_span("kv_tile"),
                f"kv_tile must be a positive multiple of 16 tokens, got {s.kv_tile}",
                "the new token's block is written back as whole 16-row bf16 tiles",
            )
        )
    cap_mib = s.hint("vmem_cap_mib", DEFAULT_CAP // MIB)
    if not 1 <= cap_mib <= VMEM_PER_CORE // MIB:
        s.errors.append(
            Diagnostic(
                s.hint_span("vmem_cap_mib"), f"vmem_cap_mib must be in 1 .. {VMEM_PER_CORE // MIB}, got {cap_mib}"
            )
        )
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
    concrete = tuple(eval_dim(d, rows=s.rows, batch=s.batch, seq_tiles=max(1, seq // s.kv_tile)) for d in shape)
    if memory == "VMEM":
        size = padded_bytes(concrete, dtype)
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
    _alloc(s, "ring_sem", (s.depth,), "dma", "weight ring semaphores", ring_span, "SEM")
    _alloc(s, "cursor", (2,), "int32", "tile issue cursor (layer, first tile)", NOWHERE, "SMEM")
    fetched = list(dict.fromkeys(name for g in [*m.kinds, m.step] for name in roles.fetched_weights(m, g)))
    for name in fetched:
        t = m.tensor(name)
        _alloc(s, f"f_{name}", roles.fetch_shape(t), t.type.dtype.numpy, f"`{name}` fetched per layer", t.span)
    if fetched:
        _alloc(s, "fetch_sem", (len(fetched),), "dma", "fetch semaphores", NOWHERE, "SEM")
    if s.collectives:
        _allocate_comm(s)
    logits = m.step.results[0]
    vocab = _type_of(m, m.step, logits).shape[1]
    _alloc(s, "logits", ("batch", vocab), "float32", "output: logits", m.step.span, scratch=False)
    _alloc(s, "next_tokens", ("batch", 1), "int32", "output: next tokens", m.step.span, scratch=False)
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
    for name, (width, dtype) in shapes.items():
        shown = ", ".join(users.get(name, [])[:4]) + (", ..." if len(users.get(name, [])) > 4 else "")
        _alloc(s, name, ("rows", width), dtype, f"values: {shown}", NOWHERE)
    casts: set[str] = set()
    attention_ops = 0
    counters: dict[str, int] = {}
    for g in [*m.kinds, m.step]:
        counters = {}  # op scratch is shared between kinds: only one kind runs at a time
        for idx, node in enumerate(g.nodes):
            if node.op == "layers":
                continue
            if node.op == "linear":
                src = buffer_of(where, g, node.inputs[0])
                if src not in casts:
                    casts.add(src)
                    k = m.tensor(node.inputs[1].name).type.shape[0]
                    _alloc(s, f"{src}_bf16", ("rows", k), "bfloat16", "matmul input (bf16)", node.span)
            if node.op == "embedding":
                width = m.tensor(node.inputs[1].name).type.shape[1]
                _alloc(s, "emb_block", ("batch", 16, width), "bfloat16", "embedding row blocks", node.span)
                _alloc(s, "emb_sem", (1,), "dma", "embedding semaphore", node.span, "SEM")
            if node.op in ("attention", "mla_attention"):  # own scratch: write-backs outlive the call
                (_allocate_attention if node.op == "attention" else _allocate_mla)(s, attention_ops, node)
                s.scratch[(g.name, idx)] = f"att{attention_ops}"
                attention_ops += 1
            parts = _op_scratch(s, g, node)
            if parts:
                base = node.op.split("_")[-1]
                i = 0 if node.op in SYNCHRONOUS else counters.get(base, 0)
                while any(
                    a.name == f"{base}{i}_{part}" and (a.shape, a.dtype) != (tuple(p[0]), p[1])
                    for a in s.vmem
                    for part, p in parts.items()
                ):
                    i += 1
                for part, (shape, dtype, purpose, memory) in parts.items():
                    _alloc(s, f"{base}{i}_{part}", shape, dtype, purpose, node.span, memory)
                s.scratch[(g.name, idx)] = f"{base}{i}"
                counters[base] = i + 1
    if attention_ops:
        _alloc(s, "kv_row", ("batch * seq_tiles",), "int32", "KV tile table: row", NOWHERE, "SMEM")
        _alloc(s, "kv_t0", ("batch * seq_tiles",), "int32", "KV tile table: first token", NOWHERE, "SMEM")
        _alloc(s, "kv_n", (1,), "int32", "KV tile count", NOWHERE, "SMEM")
        _alloc(s, "wb_pending", (attention_ops,), "int32", "KV write-backs in flight", NOWHERE, "SMEM")


DELTA_SLOTS = 3  # recurrent states in flight
EXPERT_OPS = {"moe_experts"}  # their weights are reported as "experts"
# Ops whose lowering finishes all of its DMAs before it returns: they can share one scratch.
SYNCHRONOUS = {"short_conv", "delta_rule", "kda_gate", "moe_experts"}


def _op_scratch(s: _State, g: Graph, node: Node) -> dict[str, tuple]:
    """Private buffers of ops that keep some: part -> (shape, dtype, purpose, memory)."""
    m = s.model
    if node.op == "short_conv":
        st = m.tensor(node.inputs[2].name)
        if st.type.dtype.name != "f32":
            s.errors.append(
                Diagnostic(st.span, f"conv state `{st.name}` is {st.type.dtype}: the kernel keeps conv states in f32")
            )
        _, taps, width = st.type.shape
        return {
            "buf": ((taps, "rows", width), "float32", "conv state window", "VMEM"),
            "sem": ((2, taps), "dma", "conv state semaphores", "SEM"),
        }
    if node.op == "delta_rule":
        _, _, dk, dv = m.tensor(node.inputs[5].name).type.shape
        slots = (DELTA_SLOTS, dk, dv)
        return {
            "in": (slots, "float32", f"recurrent states read ({DELTA_SLOTS} slots)", "VMEM"),
            "out": (slots, "float32", f"recurrent states written ({DELTA_SLOTS} slots)", "VMEM"),
            "sem": ((2, DELTA_SLOTS), "dma", "recurrent state semaphores", "SEM"),
        }
    if node.op == "kda_gate":
        return {"scale": ((1, node.outputs[0].type.shape[1]), "float32", "decay scale per channel", "VMEM")}
    if node.op == "moe_experts":
        experts, d, f = m.tensor(node.inputs[3].name).type.shape
        k = _type_of(m, g, node.inputs[2]).shape[1]  # ids are [B, k]
        tn, slots = moe_tiling(s, node)
        if tn is None:
            return {}
        tiles = (slots,)
        return {
            "w1c": ((*tiles, d // 8, tn), "uint32", f"expert W1 codes ({slots} tile sets)", "VMEM"),
            "w1s": ((*tiles, d // 32, tn), "uint8", "expert W1 scales", "VMEM"),
            "w3c": ((*tiles, d // 8, tn), "uint32", "expert W3 codes", "VMEM"),
            "w3s": ((*tiles, d // 32, tn), "uint8", "expert W3 scales", "VMEM"),
            "w2c": ((*tiles, tn // 8, d), "uint32", "expert W2 codes", "VMEM"),
            "w2s": ((*tiles, tn // 32, d), "uint8", "expert W2 scales", "VMEM"),
            "sem": ((6, slots), "dma", "expert tile semaphores", "SEM"),
            "zb": (("rows", d), "bfloat16", "latent input (bf16)", "VMEM"),
            "ids_stage": (("rows", 128), "int32", "routed ids, lane-dense for the copy to SMEM", "VMEM"),
            "ids_smem": (("rows", 128), "int32", "routed ids", "SMEM"),
            "id_sem": ((1,), "dma", "ids copy semaphore", "SEM"),
            "list": (("batch * " + str(k),), "int32", "distinct experts of this step", "SMEM"),
            "count": ((1,), "int32", "distinct expert count", "SMEM"),
            "pos": ((experts,), "int32", "distinct-set positions", "SMEM"),
        }
    return {}


EXPERT_TILE = 256  # expert columns per tile set (1.5 MB per set at K3 size: big DMAs, 5.7 MiB for 4 sets)
EXPERT_SLOTS = 4  # tile sets in flight (the DMA engine round-robins: 4 beat 3, 5, 6 and 8 on TPU7x)


def moe_tiling(s: _State, node: Node) -> tuple[int | None, int]:
    """(columns per expert tile, tile sets in flight) for a moe_experts node, or a diagnostic."""
    w1 = s.model.tensor(node.inputs[3].name)
    _, d, f = w1.type.shape
    slots = s.hint("expert_slots", EXPERT_SLOTS)
    tn = next((t for t in (EXPERT_TILE, 256, 128) if f % t == 0), None)
    kc = min(d, 512)
    problems = []
    if any(s.model.tensor(r.name).type.dtype.name != "mxfp4" for r in node.inputs[3:6]):
        problems.append("the expert weights must be mxfp4")
    if tn is None:
        problems.append(f"the expert width {f} must be a multiple of 128")
    if d % kc or (kc % 512 and kc != d) or kc % 256:
        problems.append(f"the latent width {d} must be a multiple of 512 (or 256 if smaller)")
    if slots < 2:
        problems.append(f"expert_slots must be at least 2, got {slots}")
    if problems:
        s.errors.append(Diagnostic(node.span, "moe_experts cannot be lowered: " + "; ".join(problems)))
        return None, slots
    return tn, slots


W_SLOTS = 3  # MLA weight tiles in flight


def _allocate_mla(s: _State, i: int, node: Node) -> None:
    m = s.model
    cache = m.tensor(node.inputs[4].name)
    width = cache.type.shape[2]
    a = node.attr
    heads, nope, extra, vdim = a["heads"], a["nope"], a["extra"], a["vdim"]
    r = width - extra
    span = node.span
    if r % 128:
        s.errors.append(Diagnostic(span, f"mla_attention needs a kv rank that is a multiple of 128, got {r}"))
    if cache.type.dtype.name != "bf16":
        s.errors.append(
            Diagnostic(
                cache.span, f"latent cache `{cache.name}` is {cache.type.dtype}: the kernel streams bf16 caches only"
            )
        )
    chunks = -(-width // 128)  # stored in 128-lane chunks: strided row loads need 128-wide arrays
    _alloc(s, f"att{i}_ql", (chunks, f"{heads} * rows", 128), "float32", "absorbed queries, head-major", span)
    _alloc(s, f"att{i}_ol", (r // 128, f"{heads} * rows", 128), "float32", "latent outputs, head-major", span)
    _alloc(
        s,
        f"att{i}_wtiles",
        (W_SLOTS, r, max(nope, vdim)),
        "bfloat16",
        f"kv up-projection tiles ({W_SLOTS} in flight)",
        span,
    )
    _alloc(s, f"att{i}_w_sem", (W_SLOTS,), "dma", "kv up-projection semaphores", span, "SEM")
    _alloc(
        s,
        f"att{i}_tiles",
        (KV_SLOTS, s.kv_tile, width),
        "bfloat16",
        f"latent cache tiles ({KV_SLOTS} x {s.kv_tile} tokens)",
        span,
    )
    _alloc(s, f"att{i}_m", (heads, 1), "float32", "online softmax max", span)
    _alloc(s, f"att{i}_l", (heads, 1), "float32", "online softmax sum", span)
    _alloc(s, f"att{i}_acc", (heads, r), "float32", "online softmax accumulator", span)
    _alloc(s, f"att{i}_new", ("rows", width), "float32", "this token's latent cache entry", span)
    _alloc(s, f"att{i}_wb", ("batch", 16, width), "bfloat16", "new-token blocks written back", span)
    _alloc(s, f"att{i}_kv_sem", (KV_SLOTS,), "dma", "latent cache semaphores", span, "SEM")
    _alloc(s, f"att{i}_wb_sem", (1,), "dma", "write-back semaphore", span, "SEM")


def _allocate_attention(s: _State, i: int, node: Node) -> None:
    m = s.model
    kc, vc = m.tensor(node.inputs[3].name), m.tensor(node.inputs[4].name)
    _, kvh, _, dk = kc.type.shape
    dv = vc.type.shape[3]
    heads = node.attr["heads"]
    span = node.span
    if dk != dv:
        s.errors.append(Diagnostic(span, f"attention with key width {dk} != value width {dv} has no TPU lowering yet"))
    for c in (kc, vc):
        if c.type.dtype.name != "bf16":
            s.errors.append(
                Diagnostic(c.span, f"KV cache `{c.name}` is {c.type.dtype}: the kernel streams bf16 caches only")
            )
    for name, rows, d in (("q2d", heads, dk), ("k2d", kvh, dk), ("v2d", kvh, dv), ("o2d", heads, dv)):
        _alloc(s, f"att{i}_{name}", (f"{rows} * rows", d), "float32", f"attention {name[0]}, head-major", span)
    for name, d in (("ktiles", dk), ("vtiles", dv)):
        _alloc(
            s,
            f"att{i}_{name}",
            (KV_SLOTS, kvh, s.kv_tile, d),
            "bfloat16",
            f"KV tiles in flight ({KV_SLOTS} x {s.kv_tile} tokens)",
            span,
        )
    _alloc(s, f"att{i}_m", (heads, 1), "float32", "online softmax max", span)
    _alloc(s, f"att{i}_l", (heads, 1), "float32", "online softmax sum", span)
    _alloc(s, f"att{i}_acc", (heads, dv), "float32", "online softmax accumulator", span)
    _alloc(s, f"att{i}_wb", (2, "batch", kvh, 16, dk), "bfloat16", "new-token blocks written back", span)
    _alloc(s, f"att{i}_kv_sem", (2, KV_SLOTS), "dma", "KV tile semaphores", span, "SEM")
    _alloc(s, f"att{i}_wb_sem", (1,), "dma", "write-back semaphore", span, "SEM")


def plan_collectives(s: _State) -> None:
    """The exchanges of a per-device model (after mkdsl.shard), each with its phases and bytes."""
    m = s.model
    s.collectives = [c for g in [*m.kinds, m.step] for c in collectives.graph_collectives(m, g, s.rows, wire(m))]


def _allocate_comm(s: _State) -> None:
    """Receive slots (two per index bit, alternating), staging and semaphores of the collectives."""
    m = s.model
    bits = max(collectives.index_bits(m.mesh), 1)
    two_level = [c for c in s.collectives if c.two_level]
    f32w, bf16w = collectives.comm_widths(s.collectives, wire(m))
    span = m.hint("wire_bf16").span if m.hint("wire_bf16") else NOWHERE
    _alloc(
        s, "comm_recv", (2 * bits, "rows", f32w), "float32", "collectives: f32 receive slots, 2 per index bit", NOWHERE
    )
    _alloc(s, "comm_stage", ("rows", 2 * collectives.PAIR_LANES), "float32", "collectives: argmax message", NOWHERE)
    if two_level:
        half = max(c.width for c in two_level) // 2
        xr = collectives.exchange_rows(m) or "rows"
        _alloc(
            s,
            "comm_half",
            (xr, collectives.lanes(half)),
            "float32",
            "collectives: the half a core keeps (two-level)",
            NOWHERE,
        )
    if bf16w:
        rows = collectives.exchange_rows(m) or "rows"  # all-reduces exchange the batch's rows only
        _alloc(s, "comm_recv_bf16", (2 * bits, rows, bf16w), "bfloat16", "collectives: bf16 receive slots", span)
        _alloc(s, "comm_stage_bf16", (rows, bf16w), "bfloat16", "collectives: outgoing bf16 partial", span)
    _alloc(s, "comm_send_sem", (1,), "dma", "collectives: outgoing DMA", NOWHERE, "SEM")
    _alloc(s, "comm_recv_sem", (2 * bits,), "dma", "collectives: incoming DMA per slot", NOWHERE, "SEM")
    _alloc(s, "comm_local_sem", (1,), "dma", "collectives: local copies", NOWHERE, "SEM")
    _alloc(s, "comm_count", (bits,), "int32", "collectives: exchanges done per index bit", NOWHERE, "SMEM")


def fit_ring(s: _State) -> None:
    """Without a ring_depth hint, shrink the ring (to 3 banks at least) so the plan fits the cap."""
    if s.model.hint("ring_depth") or s.fixed_depth:
        return
    others = sum(a.bytes for a in s.vmem if a.memory == "VMEM" and a.name != "ring")
    depth = max(3, min(s.depth, (s.cap - others) // bank_bytes(s)))
    if depth == s.depth:
        return
    s.depth = depth
    for i, a in enumerate(s.vmem):
        if a.name in ("ring", "ring_sem"):
            shape = (depth, *a.shape[1:])
            size = padded_bytes(shape, a.dtype) if a.memory == "VMEM" else 0
            purpose = f"weight ring: {depth} banks of [{s.bank[0]}, {s.bank[1]}]" if a.name == "ring" else a.purpose
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
            f"VMEM budget exceeded: the plan needs {mib(total)} of the {mib(s.cap)} cap; the largest allocation is "
            f"{worst.purpose} `{worst.name}` {list(worst.shape)} {worst.dtype} = {mib(worst.bytes)}",
            "lower `ring_depth` or `tile_n` in `hints`, or raise `vmem_cap_mib` (at most 64)"
            if worst.name == "ring"
            else f"its size follows from the spec's shapes and the largest batch ({s.model.dims[0].high} rows): make those smaller",
        )
    )


# ---------------------------------------------------------------------------- traffic


def _concrete(t: TensorType, sizes: dict[str, int]) -> TensorType:
    return TensorType(t.dtype, tuple(sizes.get(d, d) if isinstance(d, str) else d for d in t.shape))


def count_traffic(s: _State) -> tuple[tuple[TensorTraffic, ...], int]:
    """Bytes each declared tensor must move per step, and the flops, from the op costs."""
    m = s.model
    dims = [d.name for d in m.dims]
    read_sizes = {dims[0]: s.batch, **{d: s.context + 1 for d in dims[1:]}}
    flop_sizes = {dims[0]: s.rows, **{d: s.context + 1 for d in dims[1:]}}
    per_tensor: dict[str, int] = {t.name: 0 for t in m.tensors}
    group: dict[str, str] = {t.name: "state" for t in m.states}
    flops = 0

    def visit(graph: Graph) -> None:
        nonlocal flops
        after_layers = False
        for node in graph.nodes:
            if node.op == "layers":
                for kind in m.schedule:
                    visit(m.kind(kind))
                after_layers = True
                continue
            where = node.block or ("layer" if graph.name != "step" else "output" if after_layers else "input")
            for r in node.inputs:
                if r.kind == "tensor" and m.tensor(r.name).kind == "weight":
                    group.setdefault(r.name, "experts" if node.op in EXPERT_OPS else where)
            op = OPS[node.op]
            types = [_type_of(m, graph, r) for r in node.inputs]
            outs = [v.type for v in node.outputs]
            c: Cost = op.cost(
                [_concrete(t, read_sizes) for t in types], [_concrete(t, read_sizes) for t in outs], _attrs(node)
            )
            flops += op.cost(
                [_concrete(t, flop_sizes) for t in types], [_concrete(t, flop_sizes) for t in outs], _attrs(node)
            ).flops
            tensors = [r.name for r in node.inputs if r.kind == "tensor"]
            weights = [n for n in tensors if m.tensor(n).kind == "weight"]
            states = [n for n in tensors if m.tensor(n).kind == "state"]
            sizes = [storage_bytes(m.tensor(w).type.dtype, m.tensor(w).type.shape) for w in weights]
            for w, size in zip(weights, sizes, strict=True):  # shared in proportion to their storage
                per_tensor[w] += c.weight_bytes * size // max(1, sum(sizes))
            for n in states:
                per_tensor[n] += c.state_bytes // len(states)

    visit(m.step)
    traffic = tuple(TensorTraffic(t.name, t.kind, per_tensor[t.name], group.get(t.name, "unused")) for t in m.tensors)
    return traffic, flops


def _type_of(m: Model, graph: Graph, ref) -> TensorType:
    from mkdsl.elaborate import graph_value_type

    if ref.kind == "tensor":
        return m.tensor(ref.name).type
    if ref.kind == "input":
        return next(v.type for v in m.inputs if v.name == ref.name)
    return graph_value_type(graph, ref)


def schedule_traffic(s: _State) -> tuple[int, int]:
    """Bytes the schedule moves per step (tiles, KV tiles, resident vectors, gathers) and DMAs."""
    m = s.model
    total, dmas = 0, 0
    per_kind = {seq.name: seq for seq in s.sequences}
    for kind in m.schedule:
        seq = per_kind[kind]
        total += sum(t.k * t.n * 2 for t in seq.streams)
        dmas += seq.tiles
    epi = per_kind["epilogue"]
    total += sum(t.k * t.n * 2 for t in epi.streams)
    dmas += epi.tiles
    for kind in m.schedule:
        for name in roles.fetched_weights(m, m.kind(kind)):
            total += _fetch_bytes(m.tensor(name))
            dmas += 1
        for node in m.kind(kind).nodes:
            if node.op in ("short_conv", "delta_rule"):
                total += _state_bytes(m, m.kind(kind), node, s)
                taps = m.tensor(node.inputs[2].name).type.shape[1] if node.op == "short_conv" else 0
                dmas += 2 * s.batch * (taps or node.attr["heads"])  # per row: each tap, or each head
    for name in roles.fetched_weights(m, m.step):
        total += _fetch_bytes(m.tensor(name))
        dmas += 1
    kv_tiles = -(-(s.context + 1) // s.kv_tile)
    for kind in m.schedule:
        for node in m.kind(kind).nodes:
            if node.op == "attention":
                kc = m.tensor(node.inputs[3].name)
                vc = m.tensor(node.inputs[4].name)
                _, kvh, _, dk = kc.type.shape
                dv = vc.type.shape[3]
                total += s.batch * kv_tiles * s.kv_tile * kvh * (dk + dv) * 2
                total += s.batch * kvh * 16 * (dk + dv) * 2  # the new token's aligned block written back
                dmas += s.batch * (2 * kv_tiles + 2)
            elif node.op == "mla_attention":
                w = m.tensor(node.inputs[3].name)
                width = m.tensor(node.inputs[4].name).type.shape[2]
                total += storage_bytes(w.type.dtype, w.type.shape)  # W_UK and W_UV, each byte once
                total += s.batch * (kv_tiles * s.kv_tile + 16) * width * 2
                dmas += 2 * node.attr["heads"] + s.batch * (kv_tiles + 1)
            elif node.op == "moe_experts":  # the distinct experts chosen, as the op's cost counts them
                graph = m.kind(kind)
                types = [_concrete(_type_of(m, graph, r), {m.dims[0].name: s.batch}) for r in node.inputs]
                total += OPS[node.op].cost(types, [], _attrs(node)).weight_bytes
                e, total_e = types[3].shape[0], node.attr.get("experts_total", types[3].shape[0])
                experts = -(-min(total_e, s.batch * types[2].shape[1]) * e // total_e)  # ids are [B, k]
                tn, _ = moe_tiling(s, node)
                dmas += 6 * experts * (types[3].shape[2] // (tn or 128)) + 1  # six pieces per tile set
    emb = [n for n in m.step.nodes if n.op == "embedding"]
    for node in emb:
        t = m.tensor(node.inputs[1].name)
        total += s.batch * 16 * t.type.shape[1] * 2
        dmas += s.batch
    return total, dmas


def _fetch_bytes(t) -> int:
    shape = roles.fetch_shape(t)
    return math.prod(shape) * max(t.type.dtype.bits, 8) // 8


def _state_bytes(m: Model, graph: Graph, node: Node, s: _State) -> int:
    op = OPS[node.op]
    dims = [d.name for d in m.dims]
    sizes = {dims[0]: s.batch, **{d: s.context + 1 for d in dims[1:]}}
    types = [_concrete(_type_of(m, graph, r), sizes) for r in node.inputs]
    outs = [_concrete(v.type, sizes) for v in node.outputs]
    return op.cost(types, outs, _attrs(node)).state_bytes


def _attrs(node: Node) -> dict:
    """Attributes for cost rules: a layer-dependent one at its first layer (costs ignore them)."""
    return {k: v.first if isinstance(v, LayerExpr) else v for k, v in node.attrs}
