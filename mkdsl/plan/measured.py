"""Measured component costs of TPU7x: the constants a cost model predicts from.

Every figure is an isolated measurement of one component on real TPU7x hardware, published in a
hand-written megakernel's report (Sept 2026) and restated in the project's facts on TPU7x
(docs/performance.md, "The cost model", names each source). None is fitted to an end-to-end step time; the model that
combines them is in plan/cost_model.py and plan/collectives.py.
"""

from __future__ import annotations

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

# -- Per device call and per layer ------------------------------------------------------------
DISPATCH_US = 70.0  # kernel dispatch + XLA glue + entry barrier per device call (8 cores)
ATTENTION_250_TOKENS_US = 1.5  # decode attention over ~250 cached tokens, batch 1, per layer
TOPK_ROUTING_US = 0.7  # a rank-based top-k routing, batch 1, per layer

# -- Expert DMA slots: 8 MoE layers took these times with 3/4/5/6/8 outstanding expert slots ---
EXPERT_SLOT_US_PER_8_LAYERS = {3: 668.0, 4: 653.0, 5: 685.0, 6: 690.0, 8: 824.0}

# -- Chip facts (from the TPU7x specification, not measurements of a kernel; the clock that
# turns static bundles into time is bundles.ASSUMED_CLOCK_HZ) ----------------------------------
PEAK_BF16_FLOPS_PER_CORE = 2307e12 / 2  # half the chip's 2307 TFLOP/s
