"""The modeled step time, built from measured components. No TPU ran any of this kernel: every
figure here is *modeled*, from isolated measurements of single components (plan/measured.py, each
with its source) and the plan's own bytes, flops and exchanges. No constant is fitted to an
end-to-end step time.

The step is a sequence of phases, in the kernel's order: the prologue, each layer's ops and
collectives (the schedule's layers one after the other), the epilogue. A phase is one op (its
stream bytes at the measured bandwidth of its kind of stream, and its compute) or one collective
(the time plan/collectives.py gives it). The kernel's weight ring keeps `depth - 1` tiles in
flight across op and layer boundaries (`linear` in runtime/core.py.jinja issues tile g + depth - 1
before it waits for tile g); this file follows it as a fluid: `ahead`, the ring bytes landed or in
flight ahead of the ops, at most `depth - 1` of the coming tiles. Then

    op on the ring     t = max(compute, (bytes - ahead) / bandwidth)   (the ring refills meanwhile)
    op-issued stream   t = max(compute, bytes / bandwidth)             (KV, state, experts, fetches)
    ... rows in series t = compute + bytes / bandwidth                 (a verify step's recurrent state:
                           row r reads what row r - 1 wrote, OpDef.rows_in_series)
    collective         t = its exchange phases, one after the other; the tiles already in flight
                           land during `overlap` of it (conservative: the fraction the hand kernel
                           showed, measured.EXCHANGE_STREAM_OVERLAP; optimistic: all of it); the
                           ops run during its first phase (mkdsl/spmd/overlap.py) take that phase's
                           time off it, up to their own: the window lasts the longer of the two
    step               = dispatch (per step) + the sum of every phase's t

compute is the static schedule's when one is given for the op (compute / stream ratio from
`mkdsl plan --static --save-costs`, `static`; at least its flops at the MXU's peak), else an
estimate: the largest of flops at the MXU's peak, the op's measured latency where measured.py has
one, and the per-op estimate of vector and scalar work (measured.VECTOR_OP_US plus the elements
it touches at the vector unit's width; not charged inside layers whose code outside the tile loops
libtpu's schedule gives, `static["layer_code_us"]`, charged as a phase of its own per layer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mkdsl.plan import measured

LAYER_CODE = "layer_code_us"  # the key of `static` holding the per-layer code outside tile loops, in us


def floor_bytes_per_s() -> float:
    """The HBM floor's rate: the dense ring's (read at call time: a calibration may replace it)."""
    return measured.RING_STREAM_BYTES_PER_S


def ring_rate() -> float:
    """Ring bytes per us."""
    return measured.RING_STREAM_BYTES_PER_S / 1e6


@dataclass(frozen=True)
class Phase:
    """One op or collective of one graph, per run: what it streams and computes, or exchanges."""

    graph: str
    what: str
    line: int
    op: str
    bytes: int  # what it streams per run
    rate: float  # bytes per us of its stream (`bandwidth`)
    compute_us: float
    source: str  # where compute comes from: "mxu", "latency", "static" (or "" for none)
    bandwidth: str  # the measured stream it moves at (measured.py's name)
    ring: bool = False  # streamed through the weight ring (tiles issued ahead by earlier ops)
    tile_bytes: int = 0  # one ring tile (ring phases)
    exchange_us: float = 0.0  # a collective: its exchange phases
    overlap_us: float = 0.0  # a collective: its first phase, which the work after it may run under
    during: bool = False  # runs while the collective before it exchanges (mkdsl/spmd/overlap.py)
    extrapolated_us: float = 0.0  # of compute_us, what a constant gives beyond its measured range
    wide_peers: bool = False  # a collective with a phase of more peers than the direct fit was measured on
    serial: bool = False  # its stream waits for its compute (verify rows in series: OpDef.rows_in_series)
    decode_us: float = 0.0  # of a vector-estimated compute_us, decoding its quantised tiles (`Cost.decode`)

    @property
    def stream_us(self) -> float:
        return self.bytes / self.rate if self.bytes else 0.0


@dataclass(frozen=True)
class Charge:
    """A phase's modeled time in one run, split into what it waits for."""

    phase: Phase
    stream_us: float  # waiting for bytes
    compute_us: float
    comm_us: float


def bandwidth(group: str, graph_is_step: bool, ring: bool, int8: bool) -> tuple[str, float]:
    """The measured stream a phase's bytes move at (measured.py's constants); `group` is the op's
    `traffic_group` ("experts": routed-expert DMAs)."""
    if group == "experts":
        return "EXPERT_STREAM_BYTES_PER_S", measured.EXPERT_STREAM_BYTES_PER_S
    if ring and int8:
        return "INT8_BANK_BYTES_PER_S", measured.INT8_BANK_BYTES_PER_S
    if ring and graph_is_step:  # the output head: one long stream after the layers
        return "LONG_STREAM_BYTES_PER_S", measured.LONG_STREAM_BYTES_PER_S
    return "RING_STREAM_BYTES_PER_S", measured.RING_STREAM_BYTES_PER_S


# Measured per-op latencies (batch 1), by the op's `latency` trait, scaled as docs/performance.md
# says: decode attention ~1.5 us per ~250 cached tokens, per row (mkdsl's attention walks the
# (row, KV tile) pairs one after the other); a rank-based top-k routing 0.7 us.
LATENCIES = {
    "cached_tokens": lambda batch, tokens: (
        measured.ATTENTION_250_TOKENS_US * tokens / measured.ATTENTION_MEASURED_TOKENS * batch
    ),
    "routing": lambda batch, tokens: measured.TOPK_ROUTING_US,
}


def op_latency_us(latency: str, batch: int, tokens: int) -> float:
    rule = LATENCIES.get(latency)
    return rule(batch, tokens) if rule else 0.0


def vector_us(elements: int) -> float:
    """The per-op estimate of vector and scalar work: a fixed share of the hand kernel's unexplained
    per-layer time, plus `elements` (inputs and outputs, padded rows) at the vector unit's width."""
    return measured.VECTOR_OP_US + elements / (measured.VALU_ELEMENTS_PER_CYCLE * measured.ASSUMED_CLOCK_HZ) * 1e6


def compute_us(
    op: str,
    flops: int,
    stream_us: float,
    batch: int,
    tokens: int,
    static: dict | None,
    key: str = "",
    latency: str = "",
    vector: float = 0.0,
):
    """(compute us, its source) of one op run; `static` is read at `key` (`OP:WEIGHT`), then `op`;
    `latency` is the op's `latency` trait; `vector` the per-op estimate of its vector work (0: the
    layer's code is charged whole from libtpu's schedule)."""
    mxu = flops / measured.PEAK_BF16_FLOPS_PER_CORE * 1e6
    ratio = (static or {}).get(key, (static or {}).get(op))
    if ratio is not None and stream_us:  # the compiler's own schedule replaces the estimate
        best, source = max((mxu, "mxu"), (ratio * stream_us, "static"))
    else:
        best, source = max((mxu, "mxu"), (vector, "vector"), (op_latency_us(latency, batch, tokens), "latency"))
    return best, (source if best else "")


def run_phase(p: Phase, ahead: float, cap: float, overlap: float = 1.0) -> tuple[Charge, float]:
    """One phase's charge and the ring bytes ahead after it (the fluid ring of the docstring).
    `cap`: what the ring may hold ahead here (its slots times the coming tiles); bytes already
    landed stay, the ring only stops growing past it. `overlap`: the fraction of an exchange
    during which the tiles in flight land."""
    rate = ring_rate()
    if p.exchange_us:
        t, used, gain, wait = p.exchange_us, 0.0, rate * p.exchange_us * overlap, 0.0
    elif p.ring:
        wait = max(0.0, p.bytes - ahead) / p.rate
        t = max(p.compute_us, wait)
        used, gain = p.bytes, p.rate * t
    elif p.serial:  # each row's state read waits for the previous row's write: nothing overlaps
        wait = p.stream_us
        t = p.compute_us + wait
        used, gain = 0.0, rate * p.compute_us
    else:
        wait = t = p.stream_us
        t = max(p.compute_us, wait)
        used, gain = 0.0, rate * (t - wait)
    left = max(0.0, min(ahead + gain - used, max(cap, ahead - used)))
    if p.exchange_us:
        return Charge(p, 0.0, 0.0, t), left
    if p.serial:
        return Charge(p, wait, p.compute_us, 0.0), left
    return _split(p, t, wait), left


def _split(p: Phase, t: float, wait: float) -> Charge:
    if p.compute_us >= wait:
        return Charge(p, 0.0, t, 0.0)
    return Charge(p, t, 0.0, 0.0)


def simulate(order: list[list[Phase]], slots: int, overlap: float = 1.0) -> list[Charge]:
    """Every phase of the step in order (one list per graph run), the ring starting empty; the
    ring keeps `slots` tiles in flight, each the size of the next ring phase's tiles; they land
    during `overlap` of each exchange."""
    flat = [p for run in order for p in run]
    caps, nxt = [0.0] * len(flat), 0.0
    for i in range(len(flat) - 1, -1, -1):
        if flat[i].ring:
            nxt = float(flat[i].tile_bytes)
        caps[i] = slots * nxt
    ahead, out = 0.0, []
    window: list | None = None  # [index of the collective's charge, its first phase's us, work under it]
    for p, cap in zip(flat, caps, strict=True):
        c, ahead = run_phase(p, ahead, cap, overlap)
        if p.during and window is not None:
            window[2] += c.stream_us + c.compute_us
        else:
            ahead = _close(out, window, ahead)
            window = [len(out), p.overlap_us, 0.0] if p.exchange_us and p.overlap_us else None
        out.append(c)
    _close(out, window, ahead)
    return out


def _close(out: list[Charge], window: list | None, ahead: float) -> float:
    """Charge a collective only the part of its first phase the work run during it leaves (the
    window's time is the longer of the two), and take back the ring bytes both counted as landing."""
    if window is None:
        return ahead
    at, first, work = window
    overlap = min(first, work)
    out[at] = replace(out[at], comm_us=out[at].comm_us - overlap)
    return max(0.0, ahead - ring_rate() * overlap)


def dispatch_us() -> float:
    """Kernel dispatch, XLA glue, entry barrier and ring priming: measured per decode step (in
    runs of 16 steps per device call), so several steps per call do not share it."""
    return measured.DISPATCH_US
