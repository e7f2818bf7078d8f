"""The full DeepSeek-V3 kernel (61 layers, published widths and dtypes, the spec's 64-core ep 8 x tp 8
layout) compiles with the real TPU compiler (libtpu) for the compile-only `tpu7x:4x4x2` topology
(32 chips, 64 cores, one JAX device each), inside `jax.jit(jax.shard_map(...))` with its in-kernel
collectives; every weight and state array given with its NamedSharding.

The compile succeeds only if the kernel's VMEM fits the module's limit (at most the 64 MiB of a
core); a core's arguments (weights, latent cache at seq_len 4096, batch 8) must fit its HBM. The
compiler's own VMEM figure is read as in tests/test_qwen3_compile.py, from the error of a second
compile with the limit patched to 4 MiB, and must be within RATIO (tests/model_checks.py) of the planner's. That second
compile costs another ~110 s on 2 cores, so CI runs it only with MKDSL_DSV3_VMEM=1 (measured at
2135a17: libtpu 54.84 MiB, planner 55.72 MiB, ratio 0.984; the first compile 89 s). The 61 layers
compile in about the time of 4 (the kernel's code is per layer kind), so no shorter profile is
compiled instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from compile_helpers import MIB, tpu7x_devices
from model_checks import compile_and_measure, full_size

from mkdsl.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "deepseek_v3.mk"
TOPOLOGY = "tpu7x:4x4x2"
BATCH = 8
SEQ_LEN = 4096
MEASURE_VMEM = os.environ.get("MKDSL_DSV3_VMEM") == "1"


@pytest.mark.timeout(3600)
def test_deepseek_v3_compiles_for_64_tpu7x_cores(tmp_path, record_property):
    full = full_size(SPEC, tmp_path, "deepseek_v3_kernel")
    module = full.module
    devices = tpu7x_devices(TOPOLOGY)
    assert len(devices) == 64 and devices[0].device_kind == "TPU7x"
    assert module.NUM_LAYERS == 61 and module.MESH_SHAPE == (8, 8), "not the published model and layout"
    assert module.WEIGHTS["w_gate_codes"][0][1:] == (256, 7168, 2048)
    assert module.LOCAL_WEIGHTS["w_gate_codes"][1:] == (32, 7168, 256)
    assert module.WEIGHTS["w_gate_scales"][0][1:] == (256, 56, 16)
    plan = make_plan(full.out.local, batch=BATCH)
    assert plan.ring_depth == module.RING_DEPTH and plan.vmem_total <= module.VMEM_LIMIT_BYTES <= 64 * MIB
    label = f"deepseek_v3 {TOPOLOGY}"
    compile_and_measure(full, plan, devices, BATCH, SEQ_LEN, label, record_property, vmem=MEASURE_VMEM)
