"""The modeled step time, built from measured components. No TPU ran any of this kernel: every
figure here is *modeled*, from isolated measurements of single components (plan/measured.py, each
with its source) and the plan's own bytes, flops and exchanges. No constant is fitted to an
end-to-end step time.

The step is a sequence of phases, in the kernel's order: the prologue, each layer's ops and
collectives (the schedule's layers one after the other), the epilogue. A phase is one op (its
stream bytes at the measured bandwidth of its kind of stream, and its compute) or one collective
(the time plan/collectives.py gives it). The kernel's weight ring keeps `depth - 1` tiles in
flight across op and layer boundaries; this file follows it as a fluid: `ahead`, the ring bytes
landed or in flight ahead of the ops, at most the ring's lookahead. Then

    op on the ring     t = max(compute, (bytes - ahead) / bandwidth)   (the ring refills meanwhile)
    op-issued stream   t = max(compute, bytes / bandwidth)             (KV, state, experts, fetches)
    collective         t = its exchange phases, one after the other; the tiles already in flight
                           land meanwhile (the kernel issues no new ones while it waits)
    step               = dispatch / steps_per_call + the sum of every phase's t

compute is the static schedule's when one is given (compute / stream ratio per op from
`mkdsl plan --static`, `static`), else an estimate: flops at the MXU's peak, or the op's measured
latency where measured.py has one, whichever is larger.
"""

from __future__ import annotations

from dataclasses import dataclass

from mkdsl.plan import measured

FLOOR_BYTES_PER_S = measured.RING_STREAM_BYTES_PER_S  # the HBM floor's rate: the dense ring's


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
    exchange_us: float = 0.0  # a collective: its exchange phases

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


def bandwidth(op: str, graph_is_step: bool, ring: bool, int8: bool) -> tuple[str, float]:
    """The measured stream a phase's bytes move at (measured.py's constants)."""
    if op == "moe_experts":
        return "EXPERT_STREAM_BYTES_PER_S", measured.EXPERT_STREAM_BYTES_PER_S
    if ring and int8:
        return "INT8_BANK_BYTES_PER_S", measured.INT8_BANK_BYTES_PER_S
    if ring and graph_is_step:  # the output head: one long stream after the layers
        return "LONG_STREAM_BYTES_PER_S", measured.LONG_STREAM_BYTES_PER_S
    return "RING_STREAM_BYTES_PER_S", measured.RING_STREAM_BYTES_PER_S


def op_latency_us(op: str, batch: int, tokens: int) -> float:
    """Measured per-op latencies (batch 1), scaled as documented in docs/performance.md."""
    if op in ("attention", "mla_attention"):  # ~1.5 us per ~250 cached tokens, per row
        return measured.ATTENTION_250_TOKENS_US * tokens / 250 * batch
    if op == "route":
        return measured.TOPK_ROUTING_US
    return 0.0


def compute_us(op: str, flops: int, stream_us: float, batch: int, tokens: int, static: dict | None):
    """(compute us, its source) of one op run."""
    mxu = flops / measured.PEAK_BF16_FLOPS_PER_CORE * 1e6
    lat = op_latency_us(op, batch, tokens)
    best, source = max((mxu, "mxu"), (lat, "latency"))
    if static and op in static and stream_us:
        best, source = max((best, source), (static[op] * stream_us, "static"))
    return best, (source if best else "")


RING_RATE = measured.RING_STREAM_BYTES_PER_S / 1e6  # ring bytes per us


def run_phase(p: Phase, ahead: float, lookahead: float) -> tuple[Charge, float]:
    """One phase's charge and the ring bytes ahead after it (the fluid ring of the docstring)."""
    rate = RING_RATE
    if p.exchange_us:
        return Charge(p, 0.0, 0.0, p.exchange_us), min(lookahead, ahead + rate * p.exchange_us)
    if p.ring:
        wait = max(0.0, p.bytes - ahead) / p.rate
        t = max(p.compute_us, wait)
        left = min(lookahead, ahead + p.rate * t - p.bytes)
        return _split(p, t, wait), max(0.0, left)
    t = max(p.compute_us, p.stream_us)
    return _split(p, t, p.stream_us), min(lookahead, ahead + rate * (t - p.stream_us))


def _split(p: Phase, t: float, wait: float) -> Charge:
    if p.compute_us >= wait:
        return Charge(p, 0.0, t, 0.0)
    return Charge(p, t, 0.0, 0.0)


def simulate(order: list[list[Phase]], lookahead: float) -> list[Charge]:
    """Every phase of the step in order (one list per graph run), the ring starting empty."""
    ahead, out = 0.0, []
    for run in order:
        for p in run:
            c, ahead = run_phase(p, ahead, lookahead)
            out.append(c)
    return out


def dispatch_us(steps_per_call: int) -> float:
    """Kernel dispatch, XLA glue and entry barrier, per device call, shared by its steps."""
    return measured.DISPATCH_US / steps_per_call
