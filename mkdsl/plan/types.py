"""Plan IR: what the planner decided, in a form the emitter and the report both read.

Frozen dataclasses that serialise to plain JSON (`as_dict`), so a plan can be diffed and
inspected without mkdsl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Stream:
    """A weight matrix streamed through the ring as [tk, tn] tiles, n-major then k.

    `start` is its first tile's index within its sequence (one layer kind, or the epilogue).
    """

    tensor: str
    node: str  # the IR value the matmul produces
    k: int
    n: int
    tk: int
    tn: int
    start: int
    stacked: bool
    line: int  # spec line of the op call
    fmt: str = "bf16"  # the tile decoder (mkdsl/backends/tpu/lowerings/linear.py `stream_format`)
    group: int = 0  # inputs per scale (the block's side for block scales)
    parts: tuple[tuple[str, str, int, int], ...] = ()  # quantised or padded: (storage suffix, ring array, rdiv, cdiv)
    transposed: bool = False  # stored [N, K] (a tied head over the embedding table); tiles are [tn, tk]
    valid: int = 0  # > 0: `n` is padded to whole 128-lane tiles and the matmul's result has `valid` columns

    @property
    def nk(self) -> int:
        return self.k // self.tk

    @property
    def nn(self) -> int:
        return self.n // self.tn

    @property
    def tiles(self) -> int:
        return self.nk * self.nn


@dataclass(frozen=True)
class Sequence:
    """The tiles one layer kind (or the epilogue after the last layer) consumes, in order."""

    name: str
    streams: tuple[Stream, ...]

    @property
    def tiles(self) -> int:
        return sum(s.tiles for s in self.streams)

    def stream(self, node: str) -> Stream:
        return next(s for s in self.streams if s.node == node)


@dataclass(frozen=True)
class Alloc:
    """One VMEM (or SMEM) allocation with the bytes Mosaic's tiling makes it occupy."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    purpose: str
    line: int  # spec line that caused it (0: the planner's own)
    memory: str = "VMEM"  # VMEM | SMEM | SEM (a DMA semaphore array)
    scratch: bool = True  # False: a kernel input or output block that lives in VMEM


@dataclass(frozen=True)
class OpScratch:
    """The scratch set one op instance uses: allocations `<base><index>_<part>` for each part."""

    graph: str
    node: int  # index of the node in its graph
    base: str
    index: int
    parts: tuple[str, ...]

    @property
    def prefix(self) -> str:
        return f"{self.base}{self.index}"

    def name(self, part: str) -> str:
        assert part in self.parts, (self.prefix, part)
        return f"{self.prefix}_{part}"


@dataclass(frozen=True)
class TensorTraffic:
    name: str
    kind: str  # weight | state
    bytes: int  # per step, as the op costs say it must move
    group: str = ""  # the spec block that reads it ("experts" for expert weights, "state" for state)


@dataclass(frozen=True)
class ScheduleItem:
    """One piece of what the schedule moves each time its graph runs (a layer kind runs once per
    layer of that kind, the step once): a matrix's tiles, a fetched vector, a KV or state stream,
    the routed experts, embedding rows. The report attributes the modeled time with these."""

    graph: str
    what: str
    line: int  # spec line of the op or declaration
    bytes: int
    dmas: int
    node: int = -1  # index of the node in its graph that moves it (-1: a weight fetched whole)


@dataclass(frozen=True)
class PhaseCost:
    """One phase of the step (an op or a collective of one graph), all its runs per step together:
    the modeled time it waits for bytes, computes, or exchanges (plan/cost_model.py)."""

    graph: str
    what: str
    line: int  # spec line (0: the kernel's own)
    op: str
    runs: int
    stream_us: float
    compute_us: float
    comm_us: float
    source: str  # where its compute figure comes from: "mxu", "latency", "static", ""
    bandwidth: str  # the measured stream rate its bytes move at (plan/measured.py)

    @property
    def us(self) -> float:
        return self.stream_us + self.compute_us + self.comm_us


@dataclass(frozen=True)
class Assumption:
    """An assumption of the cost model no measurement supports, and what rests on it per step."""

    name: str  # short key: "exchange_overlap", "vector_estimate", "attention_context", ...
    what: str  # one sentence: the assumption and the measurement it goes beyond
    effect_us: float  # us of the modeled step that depend on it (or the range it spans)
    spans_range: bool = False  # the conservative .. optimistic range is this assumption's


@dataclass(frozen=True)
class Timing:
    """Modeled figures (no TPU measured them), from measured components (plan/cost_model.py)."""

    hbm_bytes_per_s: float  # the HBM floor's rate (the measured dense-ring stream)
    floor_us: float  # bytes that must move / that rate
    stream_us: float  # every phase's bytes at its measured stream rate, one after the other
    mxu_us: float  # all flops at the MXU's peak
    compute_us: float  # every phase's compute: static schedule, measured latency or MXU peak
    fixed_us: float  # dispatch per step (a device call's cost over its steps)
    modeled_us: float
    comm_us: float = 0.0  # exchange phases of the in-kernel collectives (sharded models)
    steps_per_call: int = 1
    during_us: float = 0.0  # of comm_us, the time ops ran while an exchange travelled (mkdsl/spmd/overlap.py)
    optimistic_us: float = 0.0  # the step with every unmeasured overlap granted (the range's other end)
    assumptions: tuple[Assumption, ...] = ()
    constants: str = "plan/measured.py"  # where the measured constants came from (or a calibration file)
    compute_from: str = "the static ratios given"  # libtpu's schedule (which file) or the per-op estimate

    @property
    def tokens_per_s(self) -> float:
        return 1e6 / self.modeled_us

    @property
    def overlap_us(self) -> float:
        """Time the phases' streams spend hidden (under compute, exchanges or the ring's lookahead)."""
        return self.stream_us + self.compute_us + self.comm_us + self.fixed_us - self.modeled_us


@dataclass(frozen=True)
class Plan:
    model: str
    profile: str | None
    batch: int
    rows: int  # batch padded to the f32 sublane tile
    context: int  # tokens of KV read per row, for the traffic figures
    ring_depth: int
    bank: tuple[int, int]  # [tk, tn] of one ring bank (bf16)
    kv_tile: int
    sequences: tuple[Sequence, ...]  # one per layer kind, then "epilogue"
    vmem: tuple[Alloc, ...]
    vmem_cap: int
    traffic: tuple[TensorTraffic, ...]
    schedule_bytes: int  # bytes the tile schedule and KV streaming move per step
    dma_count: int
    flops: int
    timing: Timing
    buffers: tuple[tuple[str, str, str], ...] = ()  # (graph, value, VMEM buffer)
    scratch: tuple[OpScratch, ...] = ()  # per op instance that keeps scratch, by (graph, node index)
    mesh: tuple[tuple[str, int], ...] = ()  # (axis, size); the plan is per device when it has several
    wire: str = "f32"  # what all-reduces send between devices
    collectives: tuple = ()  # collectives.Collective per graph
    one_row: tuple = ()  # the collectives a kernel built for batch 1 runs (picked for 1-row messages)
    # (masks a kernel built for batch 1 exchanges over, masks the others do) where they differ
    comm_masks: tuple[tuple[int, ...], tuple[int, ...]] | tuple = ()
    # (graph, collective value, node indices): the nodes run while its first exchange travels (mkdsl/spmd/overlap.py)
    windows: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
    exchange_phases: int = 0  # per step
    collective_id: int | None = None  # the barrier semaphore's id (sharded kernels)
    schedule_items: tuple[ScheduleItem, ...] = ()  # per run of their graph; they sum to schedule_bytes
    graph_flops: tuple[tuple[str, int], ...] = ()  # (graph, flops of all its runs per step); they sum to flops
    hbm_bytes: int = 0  # what one device holds in HBM: weights, state (largest batch, shortest cache), outputs
    hbm_max_cache: int = 0  # the longest cache (tokens) whose state fits one device's HBM at the largest batch
    pads: tuple[tuple[str, int, int], ...] = ()  # (tensor, axis, padded width): stored wider than one device's shape
    phases: tuple[PhaseCost, ...] = ()  # the modeled step, phase by phase; their `us` and the dispatch sum to it

    @property
    def devices(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n

    def sequence(self, name: str) -> Sequence:
        return next(s for s in self.sequences if s.name == name)

    @property
    def vmem_total(self) -> int:
        return sum(a.bytes for a in self.vmem if a.memory == "VMEM")

    @property
    def weight_bytes(self) -> int:
        return sum(t.bytes for t in self.traffic if t.kind == "weight")

    @property
    def state_bytes(self) -> int:
        return sum(t.bytes for t in self.traffic if t.kind == "state")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
