"""Measured component costs of TPU7x: the constants a cost model predicts from.

Every figure is an isolated measurement of one component on real TPU7x hardware, published in a
hand-written megakernel's report (Sept 2026) and restated in the project's facts on TPU7x
(docs/performance.md, "The cost model", names each source). None is fitted to an end-to-end step time; the model that
combines them is in plan/cost_model.py and plan/collectives.py.
"""

from __future__ import annotations

SOURCE = "plan/measured.py (a hand-written kernel's public measurements, Sept 2026)"  # or a calibration file

# -- HBM streams (per core) ---------------------------------------------------------------
RING_STREAM_BYTES_PER_S = 3.05e12  # a dense-weight ring of 2 MiB banks
EXPERT_STREAM_BYTES_PER_S = 2.9e12  # DMA-only over dense + expert weights
LONG_STREAM_BYTES_PER_S = 3.33e12  # one long 400 MiB stream (an lm_head)
INT8_BANK_BYTES_PER_S = 2.74e12  # int8 banks of [1024, 2048], DMA-only

# -- Remote copies between cores (one pairwise copy: latency + bytes / bandwidth) ------------
SIBLING_COPY_US = 2.2  # the two cores of one chip
SIBLING_COPY_BYTES_PER_S = 663e9
CROSS_CHIP_COPY_US = 2.1  # across chips, per core
CROSS_CHIP_COPY_BYTES_PER_S = 46e9

# -- Direct (one-shot) collectives: every core sends to all its peers in one phase -----------
# Fit over 8 cores on 4 chips: 2.65 us + bytes / 101 GB/s aggregate per core. Checks from the
# same report: all-reduce of [8, 8192] bf16 as reduce-scatter + all-gather (two direct phases)
# 7.28 us; direct all-gather of [8, 512] per core 3.67 us, of [8, 1024] per core 3.87 us.
DIRECT_PHASE_US = 2.65
DIRECT_BYTES_PER_S = 101e9
DIRECT_FIT_CORES = 8  # the fit holds for 8 cores on 4 chips; more peers are an extrapolation

# -- Per decode step and per layer -------------------------------------------------------------
# Dispatch, XLA glue (the embedding and its psum), entry barrier and priming the ring: about 70 us
# per decode *step* on 8 cores, measured in runs of 16 steps per device call (several steps per
# call removed the host's round trip, not this cost).
DISPATCH_US = 70.0
DISPATCH_MEASURED_CORES = 8  # more cores: an extrapolation (a barrier over more peers)
ATTENTION_250_TOKENS_US = 1.5  # decode attention over ~250 cached tokens, batch 1, per layer
ATTENTION_MEASURED_TOKENS = 250  # longer contexts: a linear extrapolation
TOPK_ROUTING_US = 0.7  # a rank-based top-k routing, batch 1, per layer

# -- Where one layer's time went (the same hand kernel, batch 1, TP8 over 4 chips) ----------------
# About 21 us of exchange phases per layer, of which only about 7 us ran under the in-flight
# weight ring: the fraction of an exchange during which the ring's tiles may land.
EXCHANGE_US_PER_LAYER = 21.0
EXCHANGE_UNDER_STREAM_US = 7.0
EXCHANGE_STREAM_OVERLAP = EXCHANGE_UNDER_STREAM_US / EXCHANGE_US_PER_LAYER
# About 4.8 us per layer that no component explains (norms, residual gates, vector work,
# semaphores). The cost model's per-op estimate of vector and scalar work (where libtpu's schedule
# was not read) spreads it over the ops of a comparable MoE layer: Kimi K3's `kda_moe` layer runs
# 40 ops per core besides its exchanges (an estimate, not a measurement).
UNEXPLAINED_LAYER_US = 4.8
VECTOR_OPS_PER_LAYER = 40
VECTOR_OP_US = UNEXPLAINED_LAYER_US / VECTOR_OPS_PER_LAYER
# The vector unit's width (TPU7x: 4 VALU slots per bundle, each an [8, 128] f32 vreg), for the
# elements an op touches, at the assumed clock of plan --static (bundles.ASSUMED_CLOCK_HZ).
VALU_ELEMENTS_PER_CYCLE = 4 * 8 * 128
ASSUMED_CLOCK_HZ = 1.9e9

# -- Expert DMA slots: 8 MoE layers took these times with 3/4/5/6/8 outstanding expert slots ---
EXPERT_SLOT_US_PER_8_LAYERS = {3: 668.0, 4: 653.0, 5: 685.0, 6: 690.0, 8: 824.0}  # not yet in the model

# -- Chip facts (from the TPU7x specification, not measurements of a kernel; the clock that
# turns static bundles into time is bundles.ASSUMED_CLOCK_HZ) ----------------------------------
PEAK_BF16_FLOPS_PER_CORE = 2307e12 / 2  # half the chip's 2307 TFLOP/s


# -- A calibration file (`mkdsl calibrate` on a TPU) replaces these constants --------------------
def constants() -> dict[str, float]:
    """Every constant a calibration may replace: the module's upper-case numbers."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, int | float) and k != "SOURCE"}


def apply(values: dict[str, float], source: str) -> dict[str, object]:
    """Replace constants by a calibration's (unknown names are an error); returns the old values, for
    `restore`. The derived constants follow their parts."""
    known = constants()
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown constants {', '.join(unknown)} (plan/measured.py has {', '.join(sorted(known))})")
    old = {k: globals()[k] for k in (*known, "SOURCE")}
    globals().update({k: round(v) if isinstance(known[k], int) else float(v) for k, v in values.items()})
    if "EXCHANGE_STREAM_OVERLAP" not in values:
        globals()["EXCHANGE_STREAM_OVERLAP"] = EXCHANGE_UNDER_STREAM_US / EXCHANGE_US_PER_LAYER
    if "VECTOR_OP_US" not in values:
        globals()["VECTOR_OP_US"] = UNEXPLAINED_LAYER_US / VECTOR_OPS_PER_LAYER
    globals()["SOURCE"] = source
    return old


def restore(old: dict[str, object]) -> None:
    globals().update(old)
