"""What the real-model tests share (test_qwen3.py, test_gpt_oss.py, test_deepseek_v3.py and their
`_compile` twins): a spec's mini kernel compiled with extra hints and imported fresh, its steps in
TPU interpret mode checked layer by layer against the reference (mkdsl.verify.kernel.LayerChecker,
bounds derived there), and the full-size kernel's libtpu compile with its HBM and VMEM checks
(the compiler's VMEM read as in tests/compile_helpers.py). Each model's own assertions (its
published shapes, layout and numbers) stay in its test file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from compile_helpers import MIB, compile_sharded, compiler_vmem, load_module
from jax.experimental.pallas import tpu as pltpu

from mkdsl.compiler import compile_source
from mkdsl.verify import kernel as verify

RATIO = (0.5, 1.3)  # compiler / planner VMEM: it may reuse buffers the planner keeps apart; +30% is a missed buffer
HBM_PER_CORE = 94.7e9  # usable HBM per TPU7x core
VMEM_PER_CORE = 64 * MIB


@dataclass(frozen=True)
class MiniKernel:
    model: object  # the whole mini model (the reference's view)
    module: ModuleType
    checker: verify.LayerChecker


def mini_kernel(spec: Path, directory: Path, name: str, hints: str, profile: str = "mini") -> MiniKernel:
    """The spec's `profile` compiled with `hints` appended (e.g. "kv_tile = 16", so a few steps
    cross KV tiles cheaply) and imported fresh as `name`."""
    text = spec.read_text(encoding="utf-8") + f"\nhints {{ {hints} }}\n"
    out, _ = compile_source(text, str(spec), profile, None)
    module = verify.import_generated(out.files["kernel.py"], directory, name)
    return MiniKernel(out.model, module, verify.LayerChecker(out.model))


def check_steps(
    kernel: MiniKernel, weights: dict, state: dict, tokens, positions, seq_len: int, steps: int, label: str
) -> dict[str, float]:
    """`steps` sharded interpret-mode steps (race detector on), each from the kernel's own state and
    tokens, each checked layer by layer: the worst error / bound per item over the steps. Fails on
    a race or an error beyond its bound; prints the worst ratios and the time, as `label`."""
    batch = len(tokens)
    step = kernel.module.build_decode_step(batch, seq_len, interpret=verify.interpret_params(), layer_trace=True)
    pad = getattr(kernel.module, "pad_weights", dict)
    pltpu.reset_tpu_interpret_mode_state()
    worst: dict[str, float] = {}
    t0 = time.perf_counter()
    for i in range(steps):
        out = verify.run_kernel(step, weights, state, tokens, positions, sharded=True, pad=pad)
        assert not verify.races_found(), f"step {i}: the race detector reported a race"
        result = kernel.checker.check(weights, state, tokens, positions, out)
        assert result.ok, f"batch {batch} step {i}: " + "; ".join(result.failures[:8])
        for item, ratio in result.worst.items():
            worst[item] = max(worst.get(item, 0.0), ratio)
        state, tokens, positions = out.state, out.next_tokens.astype(np.int32), positions + 1
    print(f"\n{label} batch {batch}: worst error / bound {worst}; {time.perf_counter() - t0:.0f} s")
    return worst


@dataclass(frozen=True)
class FullSize:
    out: object  # the compiler's output (whole and per-device models, plan, files)
    path: Path  # the written kernel.py
    module: ModuleType


def full_size(spec: Path, directory: Path, name: str, text: str | None = None) -> FullSize:
    """The spec (or `text` in its place) at full size, compiled by mkdsl and imported fresh from
    `directory`/kernel.py."""
    out, _ = compile_source(spec.read_text(encoding="utf-8") if text is None else text, str(spec), None, None)
    path = directory / "kernel.py"
    path.write_text(out.files["kernel.py"], encoding="utf-8")
    return FullSize(out, path, load_module(path, name))


def compile_and_measure(full: FullSize, plan, devices: list, batch: int, seq_len: int, label: str, record, vmem=True):
    """Compile the full-size kernel with libtpu for `devices` (sharded): a core's arguments must fit
    its HBM; with `vmem`, the compiler's VMEM (from a second, 4 MiB-limit compile of a fresh import)
    must be below a core's and within RATIO of the planner's `plan`. Records the figures."""
    compiled, seconds = compile_sharded(full.module, devices, batch, seq_len)
    args = compiled.memory_analysis().argument_size_in_bytes
    assert args < HBM_PER_CORE, "a core's weights and state must fit its HBM"
    record("compile_seconds", round(seconds, 1))
    if not vmem:
        print(f"\n{label}: per-core arguments {args / 1e9:.2f} GB; {seconds:.0f} s")
        return
    fresh = load_module(full.path, f"{full.module.__name__}_tiny")
    used, tiny_seconds = compiler_vmem(fresh, lambda m: compile_sharded(m, devices, batch, seq_len))
    planned = plan.vmem_total
    print(
        f"\n{label} batch {batch}, seq_len {seq_len}: compiler VMEM {used / MIB:.2f} MiB per core, planner "
        f"{planned / MIB:.2f} MiB (ratio {used / planned:.3f}); per-core arguments {args / 1e9:.2f} GB; "
        f"lower+compile {seconds:.0f} s ({tiny_seconds:.0f} s at 4 MiB)"
    )
    record("vmem_compiler_mib", round(used / MIB, 2))
    record("vmem_planner_mib", round(planned / MIB, 2))
    assert used < VMEM_PER_CORE
    assert RATIO[0] <= used / planned <= RATIO[1], f"compiler {used / MIB:.2f} MiB vs planner {planned / MIB:.2f} MiB"
