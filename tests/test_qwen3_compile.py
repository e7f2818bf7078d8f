"""The full Qwen3-30B-A3B kernel (48 layers, published widths, the spec's 8-core ep 2 x tp 4
layout) compiles with the real TPU compiler (libtpu) for the compile-only `tpu7x:2x2x1`
topology (4 chips, 8 cores, one JAX device each), inside `jax.jit(jax.shard_map(...))` with its
in-kernel collectives; every weight and state array given with its NamedSharding.

VMEM is read as in tests/test_kimi_sharded_compile.py: from the error of a second compile with the
module's VMEM limit patched to 4 MiB. The compiler's figure must be within RATIO of the planner's
(the compiler may reuse buffers the planner keeps apart; 30% more would be a buffer the planner
missed) and below the 64 MiB of a core; a core's arguments (weights, KV cache at seq_len 8192,
batch 8) must fit its HBM.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compile_helpers import MIB, compile_sharded, compiler_vmem, load_module, tpu7x_devices

from mkdsl.compiler import compile_source
from mkdsl.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "qwen3_30b_a3b.mk"
TOPOLOGY = "tpu7x:2x2x1"
BATCH = 8
SEQ_LEN = 8192
RATIO = (0.5, 1.3)  # compiler / planner VMEM
HBM_PER_CORE = 94.7e9  # usable HBM per TPU7x core


@pytest.mark.timeout(1800)
def test_qwen3_30b_a3b_compiles_for_8_tpu7x_cores(tmp_path, record_property):
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), None, None)
    path = tmp_path / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    module = load_module(path, "qwen3_kernel")
    devices = tpu7x_devices(TOPOLOGY)
    assert len(devices) == 8 and devices[0].device_kind == "TPU7x"
    assert module.NUM_LAYERS == 48 and module.MESH_SHAPE == (2, 4), "not the published model and layout"
    assert module.WEIGHTS["w_gate"][0][1:] == (128, 2048, 768)
    assert module.LOCAL_WEIGHTS["w_gate"][1:] == (16, 2048, 768)
    assert module.WEIGHTS["lm_head"][0] == (2048, 151936)
    plan = make_plan(out.local, batch=BATCH)
    assert plan.ring_depth == module.RING_DEPTH and plan.vmem_total <= module.VMEM_LIMIT_BYTES <= 64 * MIB

    compiled, seconds = compile_sharded(module, devices, BATCH, SEQ_LEN)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes < HBM_PER_CORE, "a core's weights and state must fit its HBM"
    used, tiny_seconds = compiler_vmem(
        load_module(path, "qwen3_tiny"), lambda m: compile_sharded(m, devices, BATCH, SEQ_LEN)
    )
    planned = plan.vmem_total
    print(
        f"\nqwen3_30b_a3b batch {BATCH}, seq_len {SEQ_LEN}, {TOPOLOGY}: compiler VMEM {used / MIB:.2f} MiB per core, "
        f"planner {planned / MIB:.2f} MiB (ratio {used / planned:.3f}); per-core arguments "
        f"{memory.argument_size_in_bytes / 1e9:.2f} GB; lower+compile {seconds:.0f} s ({tiny_seconds:.0f} s at 4 MiB)"
    )
    record_property("vmem_compiler_mib", round(used / MIB, 2))
    record_property("vmem_planner_mib", round(planned / MIB, 2))
    record_property("compile_seconds", round(seconds, 1))
    assert used < 64 * MIB
    assert RATIO[0] <= used / planned <= RATIO[1], f"compiler {used / MIB:.2f} MiB vs planner {planned / MIB:.2f} MiB"
