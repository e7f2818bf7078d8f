"""The collectives of a sharded step: which algorithm each runs, its exchange phases and their cost.

A device's linear index is row-major over the mesh axes, all powers of two, so each axis owns a
group of index bits; a collective over some axes runs over the group of devices that differ only
in those bits. The kernel's runtime (backends/tpu/templates/runtime/comm.py.jinja) exchanges
*directly*: in one phase every device sends a message to each peer of its group, then waits for
theirs. Per collective the planner models each algorithm the runtime has and picks the cheapest:

- all-gather: one direct phase (`gather`); argmax of a split vocabulary: one (`best`);
- all-reduce: reduce-scatter + all-gather, two direct phases (`rs_ag`); one phase carrying the
  whole partial to every peer (`oneshot`); or chip first (`hier`: the chip's two cores, index bit
  0, reduce-scatter halves, the rest of the group all-reduces the half by `rs_ag` or `oneshot`,
  the two cores gather the halves).

Collectives of one graph that are ready together (none needs another's result; the shard pass's
last step, mkdsl/spmd/ready.py, puts them next to each other) run their first phases as one direct
exchange over the union of their masks (`fuse_ready`, the runtime's `Comm.together`), then the
rest of each one's phases: one latency for the union of their peers, all their bytes.

Messages carry the planned batch's rows only (`exchange_rows`: 1 at batch 1, else the batch rounded
up to 8, the 32-bit sublane tile) as int32 lanes: f32 bits, or two bf16 values per lane on a bf16 wire. Every figure here is
*modeled* from the measured component costs in plan/measured.py; `direct_latency_us` says which
peer counts are measured and which are inter- or extrapolated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace

from mkdsl.lang.ir import Graph, Model
from mkdsl.ops import OPS
from mkdsl.plan import measured

PAIR_LANES = 128  # an argmax message: [value bits x 64 | index x 64] int32 per row
LANE_BYTES = 4  # every message is int32 lanes


@dataclass(frozen=True)
class Phase:
    """One direct exchange: each device of each group of `mask` sends one message of `lanes` int32
    columns x `rows` to each of its `peers`, after staging `stage` int32 columns. A phase of
    several collectives ready together has their own phases as `parts` (each over its own mask
    and receive buffer); its mask and peers are their union's, its lanes and stage their sums."""

    mask: int
    peers: int
    rows: int
    lanes: int
    stage: int
    parts: tuple[Phase, ...] = ()

    @property
    def message_bytes(self) -> int:
        return self.rows * self.lanes * LANE_BYTES

    @property
    def bytes(self) -> int:
        """Bytes one device sends in the phase (all its messages)."""
        if self.parts:
            return sum(p.bytes for p in self.parts)
        return self.peers * self.message_bytes

    @property
    def link(self) -> str:
        """`sibling` (the chip's other core only), `chip` (one peer on another chip) or `direct`."""
        if self.peers > 1 or self.parts:
            return "direct"
        return "sibling" if self.mask == 1 else "chip"

    def time_us(self) -> float:
        return phase_us(self.link, self.peers, self.bytes)


@dataclass(frozen=True)
class Collective:
    """One collective of one graph (a layer kind or the step), with the algorithm it runs."""

    graph: str
    op: str  # the op that exchanges (an internal collective, or a split argmax)
    value: str  # the IR value it produces
    axes: tuple[str, ...]
    algorithm: str  # gather, best, rs_ag, oneshot or hier; rs or rs_scale_ag (a deferred norm's)
    phases: tuple[Phase, ...]
    line: int
    width: int  # columns of the value each device contributes
    exchange: str = ""  # the op's `exchange` trait: "sum", "gather", "best", "scatter" or "scaled"
    wire: str = "f32"  # what the values travel as
    inner: str = ""  # hier: the algorithm of the cross-chip all-reduce of the half
    half: int = 0  # hier: f32 columns of the half a core keeps
    fused: tuple[str, ...] = ()  # values of the node just before, all-reduced in the same exchanges
    joined: tuple[Collective, ...] = ()  # the next nodes' collectives, ready together: first phases shared

    def time_us(self) -> float:
        """Modeled time of the whole collective: its phases one after the other."""
        return sum(p.time_us() for p in self.phases)

    @property
    def two_level(self) -> bool:
        return self.algorithm == "hier"

    @property
    def phase_bytes(self) -> tuple[int, ...]:
        return tuple(p.bytes for p in self.phases)

    @property
    def label(self) -> str:
        inner = f", {self.inner} inside" if self.inner else ""
        fused = "".join(f", fused with `{v}`" for v in self.fused)
        joined = "".join(f", one exchange with {j.op} ({j.algorithm}) of `{j.value}`" for j in self.joined)
        return f"{self.op} ({self.algorithm}{inner}{fused}{joined})"

    def apart(self) -> list[Collective]:
        """The collectives as they run alone: this one, then each joined one (see `together`)."""
        if not self.joined:
            return [self]
        others = sum(len(j.phases) - 1 for j in self.joined)
        own = (self.phases[0].parts[0], *self.phases[1 : len(self.phases) - others])
        return [dataclasses.replace(self, phases=own, joined=()), *self.joined]

    @property
    def values(self) -> tuple[str, ...]:
        """Every IR value these exchanges produce."""
        return (self.value, *self.fused, *(v for j in self.joined for v in j.values))


def direct_latency_us(peers: int) -> float:
    """Latency of a direct phase with `peers` peers: measured at 1 cross-chip peer (2.1 us) and
    at 7 (8 cores on 4 chips, 2.65 us); other peer counts are a straight line through these two
    points (interpolated below 7, **extrapolated** above: each extra peer adds one DMA descriptor
    and one semaphore wait, 0.09 us; not measured)."""
    per_peer = (measured.DIRECT_PHASE_US - measured.CROSS_CHIP_COPY_US) / (measured.DIRECT_FIT_CORES - 2)
    return measured.CROSS_CHIP_COPY_US + per_peer * (peers - 1)


def phase_us(link: str, peers: int, nbytes: int) -> float:
    """Modeled time of one phase moving `nbytes` out of each device. Several peers: the direct
    fit's aggregate 101 GB/s per core (measured over 7 peers; taken as the core's injection
    bandwidth for any count, an extrapolation past 7)."""
    if link == "sibling":
        return measured.SIBLING_COPY_US + nbytes / measured.SIBLING_COPY_BYTES_PER_S * 1e6
    if link == "chip":
        return measured.CROSS_CHIP_COPY_US + nbytes / measured.CROSS_CHIP_COPY_BYTES_PER_S * 1e6
    return direct_latency_us(peers) + nbytes / measured.DIRECT_BYTES_PER_S * 1e6


def axis_bits(mesh: tuple[tuple[str, int], ...]) -> dict[str, tuple[int, ...]]:
    """Mesh axis -> the bits of the row-major linear device index it owns."""
    out, shift = {}, 0
    for name, size in reversed(mesh):
        width = size.bit_length() - 1
        out[name] = tuple(range(shift, shift + width))
        shift += width
    return out


def index_bits(mesh) -> int:
    return sum(size.bit_length() - 1 for _, size in mesh)


def mask_of(mesh, axes) -> int:
    bits = axis_bits(mesh)
    return sum(1 << b for a in axes for b in bits[a])


def exchange_rows(batch: int) -> int:
    """Rows on the wire of the kernel built for `batch` rows (the runtime's exchange_rows): 1 at
    batch 1 (a 1-row int32 buffer tiles as (1, 128)), else the batch rounded up to whole 32-bit
    sublane tiles of 8 rows (libtpu refuses the 2- and 4-row tilings' loads); never more than the
    16-row padding."""
    return 1 if batch == 1 else -(-batch // 8) * 8


def on_wire(found: list[Collective], rows: int) -> list[Collective]:
    """The same collectives, each phase carrying `rows` rows (the kernel's algorithms priced at
    another batch's wire rows)."""
    return [_rowed(c, rows) for c in found]


def _rowed(c: Collective, rows: int) -> Collective:
    """c with every phase (and the parts of a shared phase, and the joined collectives) at `rows`."""

    def phase(p: Phase) -> Phase:
        return replace(p, rows=rows, parts=tuple(phase(q) for q in p.parts))

    return replace(c, phases=tuple(phase(p) for p in c.phases), joined=tuple(_rowed(j, rows) for j in c.joined))


def same_exchanges(a: list[Collective], b: list[Collective]) -> bool:
    """The same collectives (values, fusions, groups ready together: the kernel emits a `together`
    call for each list's algorithms where they differ): the kernel may then run either list's
    algorithms. Their masks may differ: Comm meets and exchanges over the masks of the list it
    runs (`masks_of`; each must be exchanged over every call)."""
    return _exchange_keys(a) == _exchange_keys(b)


def masks_of(found: list[Collective]) -> tuple[int, ...]:
    """Every mask these collectives exchange over, sorted (the runtime Comm's `masks`)."""
    return tuple(sorted(_masks(found)))


def _exchange_keys(found: list[Collective]) -> list[tuple]:
    together = lambda c: tuple(m.value for m in c.apart()) if c.joined else ()  # noqa: E731
    return [(c.graph, c.value, c.fused, together(c)) for c in found]


def _masks(found: list[Collective]) -> set[int]:
    return {q.mask for c in found for p in c.phases for q in (p.parts or (p,))}


def chunk_width(n: int, group: int, wire: str) -> int:
    """Columns of one reduce-scatter chunk (the runtime's chunk_width): n / group rounded up to
    whole 128-lane int32 messages (256 columns on a bf16 wire)."""
    unit = 256 if wire == "bf16" else 128
    per = -(-n // group)
    return -(-per // unit) * unit


def _lanes_of(cw: int, wire: str) -> int:
    return cw // 2 if wire == "bf16" else cw


def group_size(mask: int) -> int:
    return 1 << bin(mask).count("1")


def reduce_phases(algorithm: str, mask: int, n: int, rows: int, wire: str) -> tuple[Phase, ...]:
    """The phases of an all-reduce of [rows, n] over `mask` by `algorithm` (not hier)."""
    g = group_size(mask)
    if algorithm == "oneshot":
        lanes = _lanes_of(chunk_width(n, 1, wire), wire)
        return (Phase(mask, g - 1, rows, lanes, lanes),)
    lanes = _lanes_of(chunk_width(n, g, wire), wire)
    return (Phase(mask, g - 1, rows, lanes, g * lanes), Phase(mask, g - 1, rows, lanes, lanes))


def hier_phases(inner: str, mask: int, n: int, rows: int, wire: str) -> tuple[Phase, ...]:
    cw = chunk_width(n, 2, wire)
    pair = reduce_phases("rs_ag", 1, n, rows, wire)
    return (pair[0], *reduce_phases(inner, mask & ~1, cw, rows, wire), pair[1])


SCATTERING = {"scatter": "rs", "scaled": "rs_scale_ag"}  # the one algorithm of each deferred-norm exchange


def scaled_chunk(n: int, group: int, wire: str) -> int:
    """Columns of one all_reduce_scaled chunk (the runtime's scaled_chunk): n / group rounded up,
    to even on a bf16 wire (two columns per int32 lane)."""
    per = -(-n // group)
    return per + per % 2 if wire == "bf16" else per


def scatter_phases(kind: str, mask: int, n: int, rows: int, wire: str, inputs: int) -> tuple[Phase, ...]:
    """The phases of a deferred norm's exchanges (mkdsl/spmd/defer_norm.py) over `mask`, n the first
    input's columns. `scatter` (reduce_scatter): one phase; member j's message is chunk j of
    exactly n / G columns (the slice a row-parallel consumer takes), padded to whole 128-lane
    messages. `scaled` (all_reduce_scaled, `inputs` 2 or 3): as rs_ag over chunks of
    `scaled_chunk` columns, the first phase's message holding the projection's chunk and the
    other partial's (3 inputs) side by side and the sum of squares in at least one lane after
    them, whole 128-lane messages; the second each chunk, padded so."""
    g = group_size(mask)
    if kind == "scatter":
        width = _lanes_of(chunk_width(n // g, 1, wire), wire)
        return (Phase(mask, g - 1, rows, width, g * width),)
    cw = scaled_chunk(n, g, wire)
    first = lanes(_lanes_of(cw * (inputs - 1), wire) + 1)
    second = _lanes_of(chunk_width(cw, 1, wire), wire)
    return (Phase(mask, g - 1, rows, first, g * first), Phase(mask, g - 1, rows, second, second))


def all_reduce_options(mask: int, n: int, rows: int, wire: str) -> list[tuple[str, str, tuple[Phase, ...]]]:
    """(algorithm, inner, phases) of every way the runtime can all-reduce [rows, n] over `mask`;
    chip first only where the group holds both cores of a chip (bit 0) and other bits."""
    out = [(a, "", reduce_phases(a, mask, n, rows, wire)) for a in ("rs_ag", "oneshot")]
    if mask & 1 and mask != 1:
        out += [("hier", a, hier_phases(a, mask, n, rows, wire)) for a in ("rs_ag", "oneshot")]
    return out


def _node_collective(model: Model, g: Graph, node, rows: int, wire: str) -> Collective | None:
    from mkdsl.lang.elaborate import graph_value_type

    kind = OPS[node.op].exchange if node.op in OPS else ""
    axes = node.attr.get(OPS[node.op].exchange_axes) if kind else None
    if not axes:
        return None
    mask = mask_of(model.mesh, axes)
    n = graph_value_type(g, node.inputs[0]).shape[-1]
    base = dict(graph=g.name, op=node.op, value=node.outputs[0].name, axes=tuple(axes), line=node.span.line, width=n)
    peers = group_size(mask) - 1
    if kind == "gather":
        return Collective(
            **base, algorithm="gather", phases=(Phase(mask, peers, rows, lanes(n), lanes(n)),), exchange=kind
        )
    if kind == "best":
        phase = Phase(mask, peers, rows, PAIR_LANES, PAIR_LANES)
        return Collective(**base, algorithm="best", phases=(phase,), exchange=kind)
    if kind in ("scatter", "scaled"):
        inputs = len(node.inputs)
        return Collective(
            **base,
            algorithm=SCATTERING[kind],
            phases=scatter_phases(kind, mask, n, rows, wire, inputs),
            exchange=kind,
            wire=wire,
        )
    options = all_reduce_options(mask, n, rows, wire)
    algorithm, inner, phases = min(options, key=lambda o: sum(p.time_us() for p in o[2]))
    half = chunk_width(n, 2, wire) if algorithm == "hier" else 0
    return Collective(**base, algorithm=algorithm, phases=phases, exchange=kind, wire=wire, inner=inner, half=half)


def graph_collectives(model: Model, g: Graph, rows: int, wire: str) -> list[Collective]:
    """The collectives of one graph of the per-device model; `rows`: the rows on the wire
    (exchange_rows of the planned batch)."""
    found = [(i, _node_collective(model, g, node, rows, wire)) for i, node in enumerate(g.nodes)]
    return fuse_ready(g, fuse_adjacent([(i, c) for i, c in found if c is not None]))


def fuse_adjacent(found: list[tuple[int, Collective]]) -> list[Collective]:
    """Merge an all-reduce into the next node's when that node is an all-reduce over the same
    axes and wire (no op between them, so both inputs are ready at the second) and the same
    exchanges carrying both values are modeled cheaper than the two as chosen."""
    out: list[Collective] = []
    prev: tuple[int, Collective] | None = None
    for i, c in found:
        if prev is not None and prev[0] == i - 1 and _fusable(prev[1], c):
            fused = _fused(prev[1], c)
            if fused.time_us() < prev[1].time_us() + c.time_us():
                out[-1] = fused
                prev = None
                continue
        out.append(c)
        prev = (i, c)
    return out


def _fusable(a: Collective, b: Collective) -> bool:
    return a.exchange == b.exchange == "sum" and a.axes == b.axes and not a.fused and a.wire == b.wire


def _fused(a: Collective, b: Collective) -> Collective:
    """b with a's value in the same exchanges (rs_ag or oneshot, the cheaper): each message holds
    a's part beside b's."""
    mask = mask_of_phases(a)
    options = []
    for algorithm in ("rs_ag", "oneshot"):
        one, two = (reduce_phases(algorithm, mask, c.width, c.phases[0].rows, c.wire) for c in (a, b))
        phases = tuple(
            Phase(mask, p.peers, p.rows, p.lanes + q.lanes, p.stage + q.stage) for p, q in zip(one, two, strict=True)
        )
        options.append(
            Collective(
                b.graph, b.op, b.value, b.axes, algorithm, phases, b.line, b.width, b.exchange, b.wire, fused=(a.value,)
            )
        )
    return min(options, key=Collective.time_us)


def mask_of_phases(c: Collective) -> int:
    """The whole mask of a collective: the union of its phases' masks."""
    out = 0
    for p in c.phases:
        out |= p.mask
    return out


def step_totals(model: Model, found: list[Collective]) -> tuple[int, float]:
    """(exchange phases per step, modeled us per step): each layer runs its kind's collectives."""
    runs = [*model.schedule, model.step.name]
    return (
        sum(len(c.phases) * runs.count(c.graph) for c in found),
        sum(c.time_us() * runs.count(c.graph) for c in found),
    )


def comm_buffers(found: list[Collective]) -> tuple[dict[int, int], int, int]:
    """(mask -> receive slot width in int32 lanes, widest staging in int32 lanes, widest kept
    half in f32 columns): what the runtime's comm_scratch() needs for these collectives. A phase
    of collectives ready together stages all their messages side by side, and each part lands in
    its own mask's slots."""
    slots: dict[int, int] = {}
    stage, half = PAIR_LANES, 0
    for c in found:
        for p in c.phases:
            for part in p.parts or (p,):
                slots[part.mask] = max(slots.get(part.mask, 0), part.lanes)
            stage = max(stage, p.stage)
        half = max(half, c.half, *(j.half for j in c.joined))
    return dict(sorted(slots.items())), stage, half


def lanes(n: int) -> int:
    """n rounded up to whole 128-lane vregs."""
    return math.ceil(n / 128) * 128


# ---------------------------------------------------------------------------- ready together

TOGETHER = ("gather", "oneshot", "rs_ag", "hier")  # the algorithms Comm.together starts in a shared phase


def mask_union(masks: list[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def union_peers(masks: list[int]) -> int:
    """Peers of a device over the union of the groups of `masks` (index offsets other than 0)."""
    offsets = set()
    for mask in masks:
        sub = mask
        while True:
            offsets.add(sub)
            if not sub:
                break
            sub = (sub - 1) & mask
    return len(offsets) - 1


def together(members: list[Collective]) -> Collective:
    """The first member carrying every member's first phase in one exchange, then each one's
    other phases in member order (what Comm.together runs)."""
    firsts = [c.phases[0] for c in members]
    shared = Phase(
        mask=mask_union([p.mask for p in firsts]),
        peers=union_peers([p.mask for p in firsts]),
        rows=max(p.rows for p in firsts),
        lanes=sum(p.lanes for p in firsts),
        stage=sum(p.stage for p in firsts),
        parts=tuple(firsts),
    )
    rest = tuple(p for c in members for p in c.phases[1:])
    return dataclasses.replace(members[0], phases=(shared, *rest), joined=tuple(members[1:]))


def _joinable(run: list[Collective], c: Collective, node) -> bool:
    """c may share the run's first phase: an algorithm Comm.together runs, alone in its exchanges,
    over a mask none of the run uses (each mask has one receive slot per member and parity), at
    most one chip first (one kept half), and it needs none of the run's results (the run's nodes
    are just before it)."""
    plain = all(m.algorithm in TOGETHER and not m.fused for m in (*run, c))
    plain = plain and sum(m.algorithm == "hier" for m in (*run, c)) <= 1
    masks = [m.phases[0].mask for m in (*run, c)]
    made = {v for m in run for v in m.values}
    return plain and len(set(masks)) == len(masks) and not any(r.name in made for r in node.inputs)


def fuse_ready(g: Graph, found: list[Collective]) -> list[Collective]:
    """Collectives of adjacent nodes (the shard pass put ready-together ones next to each other)
    that may share their first phase, merged into one carried by the first (`together`) wherever
    that is modeled cheaper than running them apart."""
    index = {n.outputs[0].name: i for i, n in enumerate(g.nodes) if n.outputs}
    out: list[Collective] = []
    run: list[Collective] = []  # the members merged into out[-1]
    for c in found:
        i = index[c.value]
        if run and i == index[run[-1].value] + 1 and _joinable(run, c, g.nodes[i]):
            merged = together([*run, c])
            if merged.time_us() < out[-1].time_us() + c.time_us():
                out[-1], run = merged, [*run, c]
                continue
        out.append(c)
        run = [c]
    return out
