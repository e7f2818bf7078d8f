"""The full Qwen3-Next-80B-A3B kernel (48 layers at published sizes, the spec's 8-core ep 4 x tp 2
layout) compiles with the real TPU compiler (libtpu) for the compile-only `tpu7x:2x2x1` topology
(8 TPU7x cores, one JAX device each), inside `jax.jit(jax.shard_map(...))` with its in-kernel
collectives; every weight and state array is given with its NamedSharding.

VMEM as in tests/test_kimi_sharded_compile.py: read from the error of a second compile with the
VMEM limit patched to 4 MiB, and held to the planner's figure within RATIO. Slow (two compiles).

libtpu reports its scoped VMEM with a 13 MiB limit when the module's limit is patched to 4 MiB
(why the applied limit is larger is not established), so `tpu_compile.compiler_vmem`'s check that
its limit was the one applied fails; `scoped_vmem` below reads the same figure without it.
Measured (2-core dev machine, busy): lower + compile 23 s, the 4 MiB-limit compile 29 s; compiler
VMEM 49.35 MiB per core against the planner's 45.25 MiB (1.091: the planner misses ~4 MiB here,
within RATIO and the 58 MiB limit); 21.58 GB of arguments per core.

`test_gdn_and_moe_layers_compile` also compiles the spec with its 12 attention layers left out (48 Gated DeltaNet + MoE layers, every other line as published). Measured (2-core dev
machine, busy): compile 11 s, the 4 MiB-limit compile 11 s; compiler VMEM 39.14 MiB per core
against the planner's 44.04 MiB (0.889); 21.27 GB of arguments per core.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import jax
import pytest
from compile_helpers import MIB, compile_sharded, compiler_vmem, load_module, summary_fixture, tpu7x_devices
from model_checks import HBM_PER_CORE, RATIO, full_size  # RATIO: compiler / planner VMEM

from mkdsl.backends.tpu.libtpu import SCOPED, TINY_LIMIT, UNITS

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "qwen3_next_80b_a3b.mk"
TOPOLOGY = "tpu7x:2x2x1"
SEQ_LEN = 8192
BATCH = 1
TINY = TINY_LIMIT  # the patched VMEM limit, far below the kernel's need

report = summary_fixture("Qwen3-Next-80B-A3B on 8 TPU7x cores: libtpu compile and VMEM vs the mkdsl planner")


def scoped_vmem(module, compile_step) -> tuple[float, float]:
    """(the compiler's scoped VMEM in bytes, the limit it applied) from the error of a compile with
    the module's VMEM limit patched to 4 MiB, far below what the kernel needs."""
    module.VMEM_LIMIT_BYTES = TINY
    with pytest.raises(jax.errors.JaxRuntimeError) as err:
        compile_step(module)
    m = SCOPED.search(str(err.value))
    assert "RESOURCE_EXHAUSTED" in str(err.value) and m, str(err.value)[:2000]
    return float(m[1]) * UNITS[m[2]], float(m[3]) * UNITS[m[4]]


def without_attention(text: str) -> str:
    """The spec with the gated-attention layer kind, its block, weights, caches and their checkpoint
    mappings (`  attn_... = "..."`) left out."""
    lines = [
        ln
        for ln in text.splitlines()
        if "per layer(full_attn)" not in ln and "full_attn: (l + 1)" not in ln and not re.match(r"  attn_\w+ += ", ln)
    ]
    text = "\n".join(lines) + "\n"
    for head in ("block gated_attention(h) {", "layer full_attn(x) {"):
        start = text.index(head)
        text = text[:start] + text[text.index("}\n", start) + 2 :]
    return text


@pytest.mark.timeout(1800)
def test_gdn_and_moe_layers_compile(tmp_path, report, record_property):
    full = full_size(SPEC, tmp_path, "qwen3_next_gdn_kernel", without_attention(SPEC.read_text(encoding="utf-8")))
    out, module = full.out, full.module
    assert set(out.model.schedule) == {"gdn"} and len(out.model.schedule) == 48
    devices = tpu7x_devices(TOPOLOGY)
    compiled, seconds = compile_sharded(module, devices, BATCH, SEQ_LEN)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes < HBM_PER_CORE
    used, _ = compiler_vmem(module, lambda m: compile_sharded(m, devices, BATCH, SEQ_LEN))
    planned = out.plan.vmem_total
    report.add(
        f"GDN + MoE layers only, batch {BATCH}: compiler VMEM {used / MIB:.2f} MiB per core, planner "
        f"{planned / MIB:.2f} MiB (ratio {used / planned:.3f}); compile {seconds:.0f} s"
    )
    record_property("gdn_vmem_compiler_mib", round(used / MIB, 2))
    assert used < 64 * MIB
    assert RATIO[0] <= used / planned <= RATIO[1], f"compiler {used / MIB:.2f} MiB vs planner {planned / MIB:.2f} MiB"


@pytest.mark.timeout(1800)
def test_qwen3_next_compiles_for_8_tpu7x_cores(tmp_path, report, record_property):
    full = full_size(SPEC, tmp_path, "qwen3_next_kernel")
    out, path, module = full.out, full.path, full.module
    devices = tpu7x_devices(TOPOLOGY)
    assert len(devices) == 8 and devices[0].device_kind == "TPU7x"
    assert module.NUM_LAYERS == 48 and module.MESH_SHAPE == (4, 2), "not the published model and layout"
    plan = out.plan
    limit = module.VMEM_LIMIT_BYTES
    assert plan.vmem_total <= limit <= 64 * MIB

    compiled, seconds = compile_sharded(module, devices, BATCH, SEQ_LEN)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes < HBM_PER_CORE, "a core's weights and state must fit its HBM"
    t0 = time.perf_counter()
    used, applied = scoped_vmem(
        load_module(path, "qwen3_next_kernel_tiny"), lambda m: compile_sharded(m, devices, BATCH, SEQ_LEN)
    )
    tiny_seconds = time.perf_counter() - t0
    assert applied < 16 * MIB, f"the compiler applied a {applied / MIB:.2f} MiB limit"
    planned = plan.vmem_total
    report.add(
        f"batch {BATCH}, seq_len {SEQ_LEN}, {TOPOLOGY} (8 cores): compiler VMEM {used / MIB:.2f} MiB per core, "
        f"planner {planned / MIB:.2f} MiB (ratio {used / planned:.3f}), limit {limit / MIB:.2f} MiB; "
        f"per-core arguments {memory.argument_size_in_bytes / 1e9:.2f} GB; "
        f"lower+compile {seconds:.0f} s (4 MiB-limit compile failed after {tiny_seconds:.0f} s)"
    )
    record_property("vmem_compiler_mib", round(used / MIB, 2))
    record_property("vmem_planner_mib", round(planned / MIB, 2))
    record_property("compile_seconds", round(seconds, 1))
    assert used < 64 * MIB
    assert RATIO[0] <= used / planned <= RATIO[1], f"compiler {used / MIB:.2f} MiB vs planner {planned / MIB:.2f} MiB"
