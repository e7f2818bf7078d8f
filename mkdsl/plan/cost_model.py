"""The modeled step time. No TPU measured any of this: every figure here is *modeled*.

    floor   = bytes that must move (weights read + state read/written) / HBM bandwidth
    stream  = bytes the schedule moves (whole tiles, KV tiles, resident vectors) / bandwidth
    mxu     = flops at the padded row count / peak bf16 rate of one core
    modeled = max(stream, mxu) + fixed + bubbles + issue + comm

comm:    sharded models only: every exchange phase of the in-kernel collectives, one after the
         other (plan/collectives.py); counted as not overlapping the weight stream.
fixed:   kernel entry and exit, plus the first tile's DMA before any compute can start.
bubbles: one DMA latency per op whose stream starts from data computed in the layer (KV and
         recurrent state streams, expert weights chosen by the router): the ring cannot hide it.
issue:   the scalar core's cost to issue each DMA descriptor.
"""

from __future__ import annotations

from mkdsl.ir import Model
from mkdsl.ops import OPS
from mkdsl.plan.types import TensorTraffic, Timing

HBM_BYTES_PER_S = 3.2e12  # achievable HBM read per TPU7x core (measured by a public kernel)
PEAK_BF16_FLOPS = 2307e12 / 2  # per core: half the chip's 2307 TFLOP/s
ENTRY_US = 2.0  # kernel launch and exit (assumed)
DMA_LATENCY_US = 1.0  # first byte of a DMA after issue (assumed)
ISSUE_US = 0.01  # per DMA descriptor (assumed: a few dozen scalar cycles)


def model_time(
    model: Model,
    bank_bytes: int,
    schedule_bytes: int,
    flops: int,
    dmas: int,
    traffic: tuple[TensorTraffic, ...],
    comm_us: float = 0.0,
) -> Timing:
    must_move = sum(t.bytes for t in traffic)
    floor = must_move / HBM_BYTES_PER_S * 1e6
    stream = schedule_bytes / HBM_BYTES_PER_S * 1e6
    mxu = flops / PEAK_BF16_FLOPS * 1e6
    fixed = ENTRY_US + DMA_LATENCY_US + bank_bytes / HBM_BYTES_PER_S * 1e6  # the first tile must land
    waits = sum(1 for kind in model.schedule for n in model.kind(kind).nodes if OPS[n.op].data_dependent)
    bubbles = waits * DMA_LATENCY_US
    issue = dmas * ISSUE_US
    modeled = max(stream, mxu) + fixed + bubbles + issue + comm_us
    return Timing(HBM_BYTES_PER_S, floor, stream, mxu, fixed, bubbles, issue, modeled, comm_us)
