"""The Kimi K3 kernel at published widths (profile `core`: the full per-layer dims, 5 layers) compiles
with the real TPU compiler (libtpu) for a compile-only TPU7x device at batch 1 and 8, and its VMEM use
is close to the planner's budget.

No TPU is needed: `tpu7x:2x2x1` is a compile-only topology and lowering runs under an abstract
one-core TPU7x mesh. libtpu does not report a successful kernel's VMEM use, so the figure is read
from the error of a second compile with VMEM_LIMIT_BYTES patched to 4 MiB in the module:
"Scoped allocation with size 44.80M and limit 4.00M exceeded ..." (M = MiB). That compile must fail
with RESOURCE_EXHAUSTED, which also shows the limit is enforced.

Planner figure: at batch 1 the plan the compiler reports (plan.md), at batch 8 the budget the
kernel's VMEM limit is sized by; both must describe the kernel emitted (the same ring depth).
Measured (jax 0.10.2, 2-core dev machine, SEQ_LEN 8192):

    batch 1: compiler 44.80 MiB, planner 55.57 MiB (0.81); compile 104 s, 4 MiB-limit compile 135 s
    batch 8: compiler 46.47 MiB, planner 57.24 MiB (0.81); compile 144 s, 4 MiB-limit compile 138 s

The planner is 10.8 MiB above the compiler at both batches: it counts the 5 MiB logits block (an
output in VMEM) and pads every buffer to Mosaic's tiles; libtpu's message does not break its own
figure down. RATIO bounds the compiler/planner ratio as for Llama (tests/test_tpu_compile.py).

The module takes ~4.5 minutes at batch 8 (two compiles); MKDSL_KIMI_COMPILE_BATCHES=1,8 adds batch 1.
Batch 8 is worth its time: it caught a Mosaic rejection batch 1 does not hit (the KDA conv state's
per-tap DMA squeezing a tiled dimension). Compile times and VMEM figures are printed in the terminal
summary and recorded as test properties (`--junitxml`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from compile_helpers import MIB, compile_one_core, compiler_vmem, load_module, summary_fixture, tpu7x_devices

from mkdsl.compiler import compile_source
from mkdsl.plan import make_plan

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "kimi_k3.mk"
PROFILE = "core"
# Batch 8 by default (batch 1 at full size is compiled, sharded, by tests/test_kimi_sharded_compile.py).
BATCHES = tuple(int(b) for b in os.environ.get("MKDSL_KIMI_COMPILE_BATCHES", "8").split(","))
SEQ_LEN = 8192
RATIO = (
    0.7,
    1.3,
)  # compiler / planner VMEM: the planner pads like Mosaic, so they agree within the compiler's own scratch and layout choices (measured 0.93); +-30% still fails a missed or doubled buffer

# Issue 12's acceptance: the `core` kernel's generated code at most 5 MB (it was 18.7 MB at batch 1
# and 19.8 MB at batch 8 with per-tile branchy DMA issue, 5.2 MB at batch 8 with the delta rule
# unrolled per row and MLA's absorption unrolled per head; one copy of the delta rule's slot code,
# the short convolutions as loops and MLA's absorption as loops over groups of heads bring it under
# 4 MB). Bigger code means unrolled per-tile, per-row or per-head copies somewhere.
CODE_CAP = 5_000_000
_CODE: dict[int, int] = {}  # batch -> generated code bytes, from the compile test

report = summary_fixture("Kimi K3 core: libtpu (TPU7x) compile times and VMEM vs the mkdsl planner")


@pytest.fixture(scope="module")
def device():
    return tpu7x_devices("tpu7x:2x2x1")[0]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """(compiler Output, path of the generated kernel.py) for the core profile."""
    out, _ = compile_source(SPEC.read_text(encoding="utf-8"), str(SPEC), PROFILE, None)
    path = tmp_path_factory.mktemp("kimi_k3_core") / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    return out, path


@pytest.mark.parametrize("batch", BATCHES)
def test_kimi_k3_core_compiles_for_tpu7x(batch, device, generated, report, record_property):
    out, path = generated
    module = load_module(path, "kimi_k3_core_kernel")
    assert module.NUM_LAYERS == 5 and module.WEIGHTS["moe_w1_codes"][0][1:] == (896, 3584 // 8, 3072), (
        "not the published widths"
    )
    # The planner's figures for this batch: plan.md's at batch 1 (they must describe the kernel emitted:
    # its ring is sized for the largest batch), the budget the kernel was sized by at batch 8.
    plan = out.plan if batch == out.plan.batch else make_plan(out.model, batch=batch)
    assert plan.batch == batch
    assert plan.ring_depth == module.RING_DEPTH, (
        f"the plan at batch {batch} has a ring of {plan.ring_depth} banks, the kernel {module.RING_DEPTH}"
    )
    limit = module.VMEM_LIMIT_BYTES
    assert plan.vmem_total <= limit <= 64 * MIB

    compiled, seconds = compile_one_core(module, device, batch, SEQ_LEN)
    assert compiled is not None
    code = compiled.memory_analysis().generated_code_size_in_bytes

    # The compiler's VMEM figure: compile again under a tiny limit and read the error.
    used, tiny_seconds = compiler_vmem(module, lambda m: compile_one_core(m, device, batch, SEQ_LEN))

    planned = plan.vmem_total
    ratio = used / planned
    line = (
        f"batch {batch}, seq_len {SEQ_LEN}: compiler {used / MIB:.2f} MiB, planner {planned / MIB:.2f} MiB "
        f"(ratio {ratio:.3f}); the kernel's VMEM limit {limit / MIB:.2f} MiB; compile {seconds:.0f} s "
        f"(the 4 MiB-limit compile failed after {tiny_seconds:.0f} s); generated code {code / 1e6:.3f} MB"
    )
    report.add(line)
    record_property(f"vmem_compiler_mib_batch{batch}", round(used / MIB, 2))
    record_property(f"vmem_planner_mib_batch{batch}", round(planned / MIB, 2))
    record_property(f"compile_seconds_batch{batch}", round(seconds, 1))
    record_property(f"code_mb_batch{batch}", round(code / 1e6, 3))
    assert used < 64 * MIB
    _CODE[batch] = code
    assert RATIO[0] <= ratio <= RATIO[1], f"compiler {used / MIB:.2f} MiB vs planner {planned / MIB:.2f} MiB"


@pytest.mark.parametrize("batch", BATCHES)
def test_kimi_k3_core_code_is_at_most_5_mb(batch):
    """Issue 12's acceptance on the size measured by the compile test above (same module)."""
    if batch not in _CODE:
        pytest.fail("the compile test did not record this batch's code size (run the module whole)")
    assert _CODE[batch] <= CODE_CAP, f"generated code {_CODE[batch] / 1e6:.3f} MB, over {CODE_CAP / 1e6:.1f} MB"
