"""The full gpt-oss-120b kernel (36 layers, published widths, the spec's 4-core ep 2 x tp 2 layout)
compiles with the real TPU compiler (libtpu) for the compile-only `tpu7x:2x2x1` topology (its
first 4 cores, one JAX device each), inside `jax.jit(jax.shard_map(...))` with its in-kernel
collectives; every weight and state array given with its NamedSharding.

Hidden and expert widths of 2880 are not whole tiles: the experts are stored padded (latent 2880
to 3072 rows of 512-row decode chunks, expert width 2880 to 2944 columns of 128-lane tiles, the
biases alike), `wo`'s outputs to 2944 and each core's 50272 vocabulary columns to 50304, all with
zeros (the module's PADDED); the kernel's values keep the valid widths.

VMEM is read as in tests/test_qwen3_compile.py (tests/model_checks.py): from the error of a second
compile with the module's VMEM limit patched to 4 MiB. The compiler's figure must be within RATIO (tests/model_checks.py) of the planner's
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
SPEC = ROOT / "specs" / "gpt_oss_120b.mk"
TOPOLOGY = "tpu7x:2x2x1"
BATCH = 8
SEQ_LEN = 8192


@pytest.mark.timeout(1800)
def test_gpt_oss_120b_compiles_for_4_tpu7x_cores(tmp_path, record_property):
    full = full_size(SPEC, tmp_path, "gpt_oss_kernel")
    module = full.module
    devices = tpu7x_devices(TOPOLOGY)
    assert devices[0].device_kind == "TPU7x"
    assert module.NUM_LAYERS == 36 and module.MESH_SHAPE == (2, 2), "not the published model and layout"
    # 128 experts, 32 per core, stored padded: [36, E, 3072/8, 2944] codes, [.., 3072/32, 2944] scales.
    assert module.WEIGHTS["w1_codes"][0] == (36, 128, 384, 2944)
    assert module.LOCAL_WEIGHTS["w1_codes"] == (36, 32, 384, 2944)
    assert module.PADDED["w1_scales"] == ((-2, 90, 96, 1), (-1, 2880, 2944, 1))
    assert module.PADDED["w2_codes"] == ((-2, 360, 368, 1), (-1, 2880, 3072, 1))
    assert module.PADDED["b2"] == ((-1, 2880, 3072, 1),)
    # The vocabulary split 4 ways, each core's 50272 columns stored padded to 50304 (393 lane tiles).
    assert module.WEIGHTS["lm_head"][0] == (2880, 4 * 50304)
    assert module.LOCAL_WEIGHTS["lm_head"] == (2880, 50304)
    plan = make_plan(full.out.local, batch=BATCH)
    assert plan.ring_depth == module.RING_DEPTH and plan.vmem_total <= module.VMEM_LIMIT_BYTES <= 64 * MIB
    compile_and_measure(full, plan, devices, BATCH, SEQ_LEN, f"gpt_oss_120b {TOPOLOGY} (4 cores)", record_property)
