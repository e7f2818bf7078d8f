"""The full Qwen3-30B-A3B kernel (48 layers, published widths, the spec's 8-core ep 2 x tp 4
layout) compiles with the real TPU compiler (libtpu) for the compile-only `tpu7x:2x2x1`
topology (4 chips, 8 cores, one JAX device each), inside `jax.jit(jax.shard_map(...))` with its
in-kernel collectives; every weight and state array given with its NamedSharding.

VMEM is read as in tests/test_kimi_sharded_compile.py: from the error of a second compile with the
module's VMEM limit patched to 4 MiB. The compiler's figure must be within RATIO (tests/model_checks.py) of the planner's
(the compiler may reuse buffers the planner keeps apart; 30% more would be a buffer the planner
missed) and below the 64 MiB of a core; a core's arguments (weights, KV cache at seq_len 8192,
batch 8) must fit its HBM.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_helpers import MIB, tpu7x_devices
from model_checks import compile_and_measure, full_size

from mkdsl.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "qwen3_30b_a3b.mk"
TOPOLOGY = "tpu7x:2x2x1"
BATCH = 8
SEQ_LEN = 8192


@pytest.mark.timeout(1800)
def test_qwen3_30b_a3b_compiles_for_8_tpu7x_cores(tmp_path, record_property):
    full = full_size(SPEC, tmp_path, "qwen3_kernel")
    module = full.module
    devices = tpu7x_devices(TOPOLOGY)
    assert len(devices) == 8 and devices[0].device_kind == "TPU7x"
    assert module.NUM_LAYERS == 48 and module.MESH_SHAPE == (2, 4), "not the published model and layout"
    assert module.WEIGHTS["w_gate"][0][1:] == (128, 2048, 768)
    assert module.LOCAL_WEIGHTS["w_gate"][1:] == (16, 2048, 768)
    # The vocabulary split 8 ways, each core's 18992 columns stored padded to 19072 (149 lane tiles).
    assert module.WEIGHTS["lm_head"][0] == (2048, 8 * 19072)
    assert module.LOCAL_WEIGHTS["lm_head"] == (2048, 19072)
    plan = make_plan(full.out.local, batch=BATCH)
    assert plan.ring_depth == module.RING_DEPTH and plan.vmem_total <= module.VMEM_LIMIT_BYTES <= 64 * MIB
    compile_and_measure(full, plan, devices, BATCH, SEQ_LEN, f"qwen3_30b_a3b {TOPOLOGY}", record_property)
